"""Checkpoint engines other than fabric_lite's own: a strategy whose engine writes its own files registers the
class that reads and consolidates them (strategies/registry.py does, for the registered strategies). Exporting
the weights of such a checkpoint (`fabric-lite consolidate`) looks the class up here by the manifest's "engine"."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional, Type, Union

__all__ = ["register_engine_format", "engine_format"]

# engine name (a manifest's "engine") -> its CheckpointFormat class, or "module:Class" imported on first use
_FORMATS: Dict[str, Union[type, str]] = {}


def register_engine_format(engine: str, checkpoint_format: Union[type, str]) -> None:
    """Say which class (or "module:Class") reads and consolidates the checkpoints the engine `engine` writes."""
    _FORMATS[engine] = checkpoint_format


def engine_format(engine: str) -> Optional[Type[Any]]:
    """The class registered for `engine` (its `consolidate(url, manifest)` needs no strategy), or None."""
    entry = _FORMATS.get(engine)
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return entry
