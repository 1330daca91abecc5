"""The Trainer's profilers live in `fabric_lite.profilers` (Lightning's `lightning.pytorch.profilers`); these names
stay importable from here."""

from fabric_lite.profilers import PassThroughProfiler, Profiler, SimpleProfiler, TimedHooks

__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "TimedHooks"]
