"""The base of the profilers lives with the Trainer that calls it (`fabric_lite/trainer/profiler.py`)."""

from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, TimedHooks

__all__ = ["Profiler", "PassThroughProfiler", "TimedHooks"]
