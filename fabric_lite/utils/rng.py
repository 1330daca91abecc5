"""`synchronize_rng_state(s)`: give every process the random state of process 0 (Accelerate's functions of the
name). fabric_lite's prepared dataloaders do not need it (their order is seeded and the same on every process);
scripts call it to make the processes draw the same numbers from here on."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import torch

from fabric_lite.seed import runtime_rng

__all__ = ["synchronize_rng_state", "synchronize_rng_states"]


def _kinds() -> Tuple[str, ...]:
    """torch, cuda, the device runtimes' own streams (one per device type the connector lists), generator."""
    from fabric_lite.strategies.connector import RUNTIME_DEVICES

    return ("torch", "cuda", *RUNTIME_DEVICES, "generator")


def _get(kind: str, generator: Optional[torch.Generator]) -> Any:
    if kind == "torch":
        return torch.get_rng_state()
    if kind == "cuda":
        return torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    if kind != "generator":  # a device runtime's stream, where that runtime started here
        stream = runtime_rng(kind)
        return None if stream is None else int(stream[0]())
    return None if generator is None else generator.get_state()


def _set(kind: str, value: Any, generator: Optional[torch.Generator]) -> None:
    if value is None:
        return
    if kind == "torch":
        torch.set_rng_state(value)
    elif kind == "cuda":
        torch.cuda.set_rng_state(value)
    elif kind != "generator":
        stream = runtime_rng(kind)
        if stream is not None:
            stream[1](int(value))
    elif generator is not None:
        generator.set_state(value)


def synchronize_rng_state(rng_type: Optional[str] = None, generator: Optional[torch.Generator] = None) -> None:
    """Set this process's random state of kind `rng_type` ("torch", "cuda", a device runtime's own (Accelerate's
    `RNGType` names it) or "generator": `generator`'s state) to process 0's. A collective: every process calls it.
    On one process, or with no `rng_type`, nothing changes."""
    if rng_type is None:
        return
    kind = str(getattr(rng_type, "value", rng_type)).lower()
    if kind not in _kinds():
        raise ValueError(f"synchronize_rng_state: rng_type={rng_type!r} is not one fabric_lite synchronizes; use "
                         f"one of {list(_kinds())}.")
    if kind == "generator" and generator is None:
        raise ValueError("synchronize_rng_state('generator') needs the generator to synchronize: pass generator=.")
    from fabric_lite.state import PartialState

    state = PartialState()
    if state.num_processes == 1:
        return
    box = [_get(kind, generator) if state.is_main_process else None]
    state.broadcast_object_list(box, from_process=0)
    _set(kind, box[0], generator)


def synchronize_rng_states(rng_types: Iterable[str], generator: Optional[torch.Generator] = None) -> None:
    """`synchronize_rng_state` for each of `rng_types`."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
