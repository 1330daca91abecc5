"""Whether this process runs under `fabric-lite explain` (FABRIC_LITE_EXPLAIN), what launch it plans (the request
the command hands down), and whether a plan was printed."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

__all__ = ["requested", "planned_request", "rehearsal_world", "mark_explained", "was_explained"]


def requested() -> bool:
    """Whether this process runs under `fabric-lite explain` (FABRIC_LITE_EXPLAIN is set)."""
    from fabric_lite.strategies.environments import read_launch_environment

    return read_launch_environment().launch.explain is not None


def planned_request() -> Dict[str, Any]:
    """The planned launch `fabric-lite explain` handed down ({} for a bare FABRIC_LITE_EXPLAIN=1)."""
    from fabric_lite.strategies.environments import read_launch_environment

    raw = read_launch_environment().launch.explain
    if raw and raw.lstrip().startswith("{"):
        try:
            value = json.loads(raw)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def rehearsal_world() -> Optional[int]:
    """The world size `fabric-lite explain --rehearse` plays rank 0 of, or None (no rehearsal)."""
    value = planned_request().get("rehearse")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_STATE = {"explained": False}


def mark_explained(value: bool = True) -> None:
    """Note that a plan was printed in this process (`fabric-lite explain` reads it with `was_explained`)."""
    _STATE["explained"] = value


def was_explained() -> bool:
    return _STATE["explained"]
