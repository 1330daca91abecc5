"""Profilers for the Trainer (Lightning's `lightning.pytorch.profilers`): `Trainer(profiler="simple" | "advanced" |
"pytorch" | "xla")` or an instance.

- `SimpleProfiler`: wall time of each hook, step and batch fetch, as a table.
- `AdvancedProfiler`: Python's cProfile inside each of them.
- `PyTorchProfiler`: torch.profiler (operators, shapes, memory, CPU and GPU time) and Chrome traces, built by the
  same function as the raw door's `accelerator.profile(ProfileKwargs(...))`.
- `XLAProfiler`: torch_xla's profiler, where torch_xla is installed.

Each writes its files per rank, ``{stage}-{filename}-{rank}...``, into `dirpath` (default: the Trainer's log_dir).
With no profiler the Trainer's loops make no profiling call at all.

The Trainer never imports this package: `fabric_lite/integrations.py` turns `profiler=` into the Trainer's
instrument (`resolve_profiler`). The base classes and `SimpleProfiler` live with the Trainer
(`fabric_lite/trainer/profiler.py`); the others import the accelerator's profiling core.
"""

from fabric_lite.profilers.advanced import AdvancedProfiler
from fabric_lite.profilers.pytorch import PyTorchProfiler, RegisterRecordFunction
from fabric_lite.profilers.resolve import PROFILERS, resolve_profiler
from fabric_lite.profilers.xla import XLAProfiler
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler, TimedHooks

PROFILERS["xla"] = XLAProfiler  # (always imported with the package: resolve_profiler knows the name)

__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler", "XLAProfiler",
           "RegisterRecordFunction", "TimedHooks", "resolve_profiler", "PROFILERS"]
