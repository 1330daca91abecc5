"""Profilers for the Trainer (Lightning's `lightning.pytorch.profilers`): `Trainer(profiler="simple" | "advanced" |
"pytorch")`, a device runtime's own profiler by the runtime's name, or an instance.

- `SimpleProfiler`: wall time of each hook, step and batch fetch, as a table.
- `AdvancedProfiler`: Python's cProfile inside each of them.
- `PyTorchProfiler`: torch.profiler (operators, shapes, memory, CPU and GPU time) and Chrome traces, built by the
  same function as the raw door's `accelerator.profile(ProfileKwargs(...))`.
- A device runtime's profiler (the registry's `register_runtime`): importable from here by its class name, where
  its runtime is installed.

Each writes its files per rank, ``{stage}-{filename}-{rank}...``, into `dirpath` (default: the Trainer's log_dir).
With no profiler the Trainer's loops make no profiling call at all.

The Trainer never imports this package: `fabric_lite/integrations.py` turns `profiler=` into the Trainer's
instrument (`resolve_profiler`). The base classes and `SimpleProfiler` live with the Trainer
(`fabric_lite/trainer/profiler.py`); the others import the accelerator's profiling core.
"""

import importlib
from typing import Any

from fabric_lite.profilers.advanced import AdvancedProfiler
from fabric_lite.profilers.pytorch import PyTorchProfiler, RegisterRecordFunction
from fabric_lite.profilers.resolve import PROFILERS, resolve_profiler, runtime_profiler_classes
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler, TimedHooks

__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler",
           *runtime_profiler_classes(), "RegisterRecordFunction", "TimedHooks", "resolve_profiler", "PROFILERS"]


def __getattr__(name: str) -> Any:
    """A device runtime's profiler class, imported when first read."""
    module = runtime_profiler_classes().get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
