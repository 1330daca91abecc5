"""Accelerate's profiler handler: `ProfileKwargs`, and the context manager behind `accelerator.profile()`.

`ProfileKwargs` holds the arguments of `torch.profiler.profile` under Accelerate's names (activities by name,
the schedule as a dict); `profile_context` runs the block under that profiler and, when `output_trace_dir` is
set, writes each process's Chrome trace there as ``profile_<process_index>.json``.

>>> handler = ProfileKwargs(activities=["cpu"], record_shapes=True)
>>> with profile_context(handler, process_index=0) as prof:  # doctest: +SKIP
...     model(inputs)
>>> print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Union

import torch

from fabric_lite.accelerator.configs import KwargsHandler

__all__ = ["ProfileKwargs", "profile_context", "trace_file_name", "PROFILE_PATTERN_NAME", "torch_profiler_arguments",
           "make_torch_profiler", "write_chrome_trace", "default_activities", "resolve_activities", "resolve_schedule"]

#: The name of each process's trace in `output_trace_dir` (Accelerate's pattern).
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
#: Activity names, as Accelerate spells them; those this torch build knows are accepted.
ACTIVITY_NAMES = ("cpu", "cuda", "xpu", "mtia", "hpu")
#: `torch.profiler.schedule`'s arguments: the first three are required.
SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait")
_REQUIRED_SCHEDULE_KEYS = ("wait", "warmup", "active")


def trace_file_name(process_index: int) -> str:
    """The file a process writes its trace to, inside `output_trace_dir`: ``profile_0.json`` for process 0."""
    return PROFILE_PATTERN_NAME.format(suffix=process_index)


def profiler_activities() -> Dict[str, Any]:
    """The activity names this torch build can profile, with their `torch.profiler.ProfilerActivity`."""
    known = {}
    for name in ACTIVITY_NAMES:
        member = getattr(torch.profiler.ProfilerActivity, name.upper(), None)
        if member is not None:
            known[name] = member
    return known


def default_activities() -> List[Any]:
    """The CPU, plus CUDA where a GPU is available (what the Trainer's PyTorchProfiler records by default)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def resolve_activities(value: Any, where: str) -> Optional[List[Any]]:
    """`value` (activity names, `ProfilerActivity` members, or None) as `ProfilerActivity` members; `where` names
    the argument in errors, e.g. ``"ProfileKwargs(activities"``."""
    if value is None:
        return None
    names = [value] if isinstance(value, (str, torch.profiler.ProfilerActivity)) else value
    known = profiler_activities()
    out = []
    for name in names:
        if isinstance(name, torch.profiler.ProfilerActivity):
            out.append(name)
        elif isinstance(name, str) and name.lower() in known:
            out.append(known[name.lower()])
        else:
            raise ValueError(f"{where}={value!r}): unknown activity {name!r}; allowed: "
                             f"{', '.join(map(repr, known))} (or torch.profiler.ProfilerActivity members), or "
                             f"None for the CPU plus the GPU when there is one.")
    return out


def resolve_schedule(option: Any, where: str) -> Optional[Callable[[int], Any]]:
    """`option` as a `torch.profiler.schedule`: a dict of its arguments, a schedule function (called once here,
    to check it answers with a `ProfilerAction`), or None (no schedule: the whole block is recorded)."""
    if option is None:
        return None
    example = "{'wait': 1, 'warmup': 1, 'active': 3, 'repeat': 1}"
    if callable(option):
        action = option(0)
        if not isinstance(action, torch.profiler.ProfilerAction):
            raise TypeError(f"{where}={option!r}): a schedule answers a step number with a "
                            f"torch.profiler.ProfilerAction, and this one answered {action!r}; build it with "
                            f"torch.profiler.schedule(wait=1, warmup=1, active=3).")
        return option
    if not isinstance(option, dict):
        raise TypeError(f"{where}={option!r}): pass a dict of torch.profiler.schedule's arguments, e.g. {example}, "
                        f"a torch.profiler.schedule(...), or None.")
    unknown = [k for k in option if k not in SCHEDULE_KEYS]
    missing = [k for k in _REQUIRED_SCHEDULE_KEYS if k not in option]
    if unknown or missing:
        what = f"unknown key(s) {unknown}" if unknown else f"missing key(s) {missing}"
        raise ValueError(f"{where}={option!r}): {what}; the keys are {list(SCHEDULE_KEYS)}, "
                         f"of which {list(_REQUIRED_SCHEDULE_KEYS)} are required, e.g. {example}.")
    for key, value in option.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}={option!r}): {key}={value!r} must be an integer >= 0.")
    if option["active"] < 1:
        raise ValueError(f"{where}={option!r}): active=0 records nothing; pass active >= 1.")
    return torch.profiler.schedule(**option)


def torch_profiler_arguments(owner: str, schedule_name: str = "schedule", activities: Any = None,
                             schedule: Any = None, on_trace_ready: Optional[Callable[..., Any]] = None,
                             record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
                             with_flops: bool = False, with_modules: bool = False,
                             **extra: Any) -> Dict[str, Any]:
    """The checked arguments of `torch.profiler.profile`, for both doors: `accelerator.profile(ProfileKwargs(...))`
    and the Trainer's `PyTorchProfiler` build their profiler from this one function.

    `activities` by name or member, `schedule` as a dict or a schedule function; `extra` takes torch's other
    arguments (``experimental_config``, ``acc_events``, ...). `owner` names the caller in errors."""
    if on_trace_ready is not None and not callable(on_trace_ready):
        raise TypeError(f"{owner}(on_trace_ready={on_trace_ready!r}): pass a function that takes the profiler, e.g. "
                        f"torch.profiler.tensorboard_trace_handler('runs/'), or None.")
    flags = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack,
             "with_flops": with_flops, "with_modules": with_modules}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{owner}({name}={value!r}): pass True or False.")
    accepted = set(inspect.signature(torch.profiler.profile.__init__).parameters) - {"self"}
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise TypeError(f"{owner}: unknown torch.profiler.profile argument(s) {unknown}; torch {torch.__version__} "
                        f"takes {sorted(accepted)}.")
    return {"activities": resolve_activities(activities, f"{owner}(activities"),
            "schedule": resolve_schedule(schedule, f"{owner}({schedule_name}"),
            "on_trace_ready": on_trace_ready, **flags, **extra}


def make_torch_profiler(owner: str, **arguments: Any) -> torch.profiler.profile:
    """A `torch.profiler.profile` (not started) from `torch_profiler_arguments(owner, **arguments)`."""
    return torch.profiler.profile(**torch_profiler_arguments(owner, **arguments))


def write_chrome_trace(profiler: Any, path: str) -> None:
    """Write `profiler`'s Chrome trace to `path`, under another name first and then renamed, so a reader never
    sees half a file (the directory is made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        profiler.export_chrome_trace(partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@dataclass
class ProfileKwargs(KwargsHandler):
    """How `accelerator.profile()` profiles: the arguments of `torch.profiler.profile`, by Accelerate's names.

    - `activities`: names among "cpu", "cuda", "xpu", "mtia", "hpu" (or `ProfilerActivity` members); None:
      torch's default, the CPU plus the GPU when there is one. A GPU asked for where there is none is left out
      by torch, with a warning.
    - `schedule_option`: the arguments of `torch.profiler.schedule` (`wait`, `warmup`, `active`, and optionally
      `repeat`, `skip_first`): record only some steps, marked by `prof.step()`. None: record the whole block.
    - `on_trace_ready`: called with the profiler each time a scheduled cycle is recorded.
    - `record_shapes`, `profile_memory`, `with_stack`, `with_flops`, `with_modules`: as in torch.
    - `output_trace_dir`: where each process writes its Chrome trace, ``profile_<process_index>.json``, when
      the block ends (open it in chrome://tracing or https://ui.perfetto.dev).

    Example:
        >>> handler = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2},
        ...                         output_trace_dir="traces")
        >>> accelerator = Accelerator(kwargs_handlers=[handler])  # doctest: +SKIP
        >>> with accelerator.profile() as prof:  # doctest: +SKIP
        ...     for batch in loader:
        ...         train_step(batch)
        ...         prof.step()
    """

    accelerator_attribute: ClassVar[str] = "profile_handler"  # (Accelerator.profile_handler)

    activities: Optional[List[Any]] = None
    schedule_option: Optional[Dict[str, int]] = None
    on_trace_ready: Optional[Callable[..., Any]] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[Union[str, os.PathLike]] = None

    def __post_init__(self) -> None:
        self.torch_arguments()  # (mistakes are reported where the handler is written)
        trace_dir = self.output_trace_dir
        if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
            raise TypeError(f"ProfileKwargs(output_trace_dir={trace_dir!r}): pass a directory path, or None to "
                            f"write no trace.")

    def torch_arguments(self) -> Dict[str, Any]:
        """The checked arguments of `torch.profiler.profile` these settings stand for."""
        return torch_profiler_arguments(
            "ProfileKwargs", schedule_name="schedule_option", activities=self.activities,
            schedule=self.schedule_option, on_trace_ready=self.on_trace_ready, record_shapes=self.record_shapes,
            profile_memory=self.profile_memory, with_stack=self.with_stack, with_flops=self.with_flops,
            with_modules=self.with_modules)

    def profiler_activities(self) -> Optional[List[Any]]:
        """`activities` as `ProfilerActivity` members (None: torch's default)."""
        return resolve_activities(self.activities, "ProfileKwargs(activities")

    def profiler_schedule(self) -> Optional[Callable[[int], Any]]:
        """`schedule_option` as a `torch.profiler.schedule` (None: no schedule, the whole block is recorded)."""
        return resolve_schedule(self.schedule_option, "ProfileKwargs(schedule_option")

    def build(self) -> torch.profiler.profile:
        """A `torch.profiler.profile` with these settings (not started: use it as a context manager)."""
        return torch.profiler.profile(**self.torch_arguments())


@contextlib.contextmanager
def profile_context(handler: Optional[ProfileKwargs] = None, process_index: int = 0,
                    wait_for_everyone: Optional[Callable[[], None]] = None) -> Iterator[torch.profiler.profile]:
    """Profile the enclosed block with `handler`'s settings (None: `ProfileKwargs()`); yields the torch profiler.

    With `output_trace_dir`, the directory is made before profiling starts (a bad path fails before the work,
    not after it), and when the block ends each process writes its trace there, ``profile_<process_index>.json``
    (written under another name and renamed, so a reader never sees half a file); then `wait_for_everyone`,
    when given, holds every process until all traces are written. A block that raises writes no trace and
    waits for no one: the error goes on as it came.
    """
    handler = ProfileKwargs() if handler is None else handler
    if not isinstance(handler, ProfileKwargs):
        raise TypeError(f"profile(profile_handler={handler!r}): pass a ProfileKwargs, or None for the "
                        f"Accelerator's own (from kwargs_handlers) or the defaults.")
    target = None
    if handler.output_trace_dir is not None:
        trace_dir = os.fspath(handler.output_trace_dir)
        os.makedirs(trace_dir, exist_ok=True)
        target = os.path.join(trace_dir, trace_file_name(process_index))
    profiler = handler.build()
    with profiler:
        yield profiler
    if target is None:
        return
    write_chrome_trace(profiler, target)
    if wait_for_everyone is not None:
        wait_for_everyone()

