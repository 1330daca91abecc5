"""The trainer door: `Trainer` (settings and entry points), its loops, `TrainModule`/`DataModule`,
`configure_optimizers` parsing, logged metrics and profilers."""

from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler
from fabric_lite.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainModule", "DataModule", "Profiler", "SimpleProfiler", "PassThroughProfiler"]
