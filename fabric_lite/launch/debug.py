"""`debug_launcher`: run a function on several processes on the CPU (Accelerate's function of the name), to
try distributed code on a machine without GPUs, or in a test."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from fabric_lite.launch.launcher import notebook_launcher, patched_environ, runtime_unset
from fabric_lite.strategies.environments import ENV_USE_CPU

__all__ = ["debug_launcher"]


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> List[Any]:
    """Run ``function(*args)`` on `num_processes` forked processes that train on the CPU (gloo), even where there
    are GPUs or a device whose runtime starts its own replicas. Each process's `Accelerator()` / `PartialState()` sees its rank as under
    `fabric-lite launch --cpu`. Returns each rank's return value, in rank order (Accelerate's returns nothing)."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"debug_launcher(num_processes={num_processes!r}): give a number of processes >= 1.")
    with patched_environ({ENV_USE_CPU: "1", **runtime_unset()}):  # (a runtime's variables would pick its replicas)
        return notebook_launcher(function, args, num_processes=num_processes, start_method="fork") or []
