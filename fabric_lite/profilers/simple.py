"""`SimpleProfiler` (`Trainer(profiler="simple")`) lives with the Trainer (`fabric_lite/trainer/profiler.py`)."""

from fabric_lite.trainer.profiler import SimpleProfiler

__all__ = ["SimpleProfiler"]
