"""`resolve_profiler`: what `Trainer(profiler=...)` accepts, a name or a Profiler, as the Profiler it runs."""

from __future__ import annotations

from typing import Any, Callable, Dict

from fabric_lite.arguments import fail
from fabric_lite.profilers.advanced import AdvancedProfiler
from fabric_lite.profilers.pytorch import PyTorchProfiler
from fabric_lite.strategies.registry import load_path, runtime_profilers
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler

__all__ = ["resolve_profiler", "PROFILERS", "runtime_profiler_classes"]

#: The names `Trainer(profiler=...)` takes (Lightning's), each with the profiler it builds with its defaults; a
#: device runtime's profiler is under the runtime's name (the registry's `register_runtime`), imported when built.
PROFILERS: Dict[str, Callable[[], Profiler]] = {"simple": SimpleProfiler, "advanced": AdvancedProfiler,
                                                 "pytorch": PyTorchProfiler}


def _built_from(path: str) -> Callable[[], Profiler]:
    def build() -> Profiler:
        profiler: Profiler = load_path(path)()
        return profiler

    return build


for _name, _path in runtime_profilers().items():
    PROFILERS[_name] = _built_from(_path)


def runtime_profiler_classes() -> Dict[str, str]:
    """{class name: module} of the device runtimes' profilers (`fabric_lite.profilers` exports them by name)."""
    return {path.partition(":")[2]: path.partition(":")[0] for path in runtime_profilers().values()}


def resolve_profiler(value: Any, owner: str = "Trainer") -> Profiler:
    """None (no profiling: a PassThroughProfiler), a name among `PROFILERS` (any case), or a Profiler instance."""
    if value is None:
        return PassThroughProfiler()
    if isinstance(value, Profiler):
        return value
    rule = (f"must be one of {', '.join(map(repr, PROFILERS))}, a Profiler instance such as "
            f"PyTorchProfiler(filename='perf'), or None")
    if not isinstance(value, str):
        fail(owner, "profiler", value, f"{rule}; got {type(value).__name__}.", TypeError)
    if value.lower() not in PROFILERS:
        fail(owner, "profiler", value, rule + ".")
    return PROFILERS[value.lower()]()
