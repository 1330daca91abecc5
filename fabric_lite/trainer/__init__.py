"""The trainer door: `Trainer` (settings and entry points), its loops, `TrainModule`/`DataModule`,
`configure_optimizers` parsing and logged metrics."""

from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainModule", "DataModule"]
