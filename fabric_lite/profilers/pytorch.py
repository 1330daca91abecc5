"""`PyTorchProfiler` (`Trainer(profiler="pytorch")`): torch.profiler over the Trainer's stages, with Lightning's
options: which operators ran, how long (CPU and GPU), with which shapes and memory, in a table per stage and in
Chrome traces per rank.

    profiler = PyTorchProfiler(dirpath="prof", filename="perf", record_shapes=True, profile_memory=True)
    Trainer(profiler=profiler).fit(module, loader)
    # prof/fit-perf.txt                                                       the operator table
    # prof/fit-perf-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json  (chrome://tracing, Perfetto)

On several processes each rank writes its own files, ``fit-perf-{rank}...``. The torch profiler is built by
`fabric_lite.accelerator.profiling.make_torch_profiler`, the same function behind the raw door's
`accelerator.profile(ProfileKwargs(...))`.

The schedule counts each kind of step apart (training, validation, test, predict steps), as Lightning's does: by
default it waits 1, warms up 1 and records 3, once per kind, so a fit writes a training trace and, when it
validates, a validation trace. A cycle that has begun (warm-up or recording) runs to its end before another kind's
steps count: steps of another kind inside it are recorded in its trace. In fit, the sanity-check validation steps
before training do not count. Pass ``schedule=torch.profiler.schedule(...)`` for other cycles, or
``schedule=None`` to record every step. Each recorded cycle is written as one Chrome trace. Every action of the
Trainer (hooks, steps, batch fetches) shows in the trace as ``[pl][profile]{action}`` and, with
`record_module_names`, each layer's forward as ``[pl][module]{class path}: {name}`` (Lightning's labels).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch.autograd.profiler import record_function

from fabric_lite.accelerator.profiling import (
    default_activities,
    make_torch_profiler,
    torch_profiler_arguments,
    write_chrome_trace,
)
from fabric_lite.trainer.profiler import Profiler

__all__ = ["PyTorchProfiler", "RegisterRecordFunction", "STEP_ACTIONS", "SORT_KEYS"]

#: The actions whose end advances the schedule: the steps, each kind counted apart.
STEP_ACTIONS = ("training_step", "validation_step", "test_step", "predict_step")
#: What the table can be sorted by (`sort_by_key`).
SORT_KEYS = ("cpu_time", "cuda_time", "cpu_time_total", "cuda_time_total", "self_cpu_time_total",
             "self_cuda_time_total", "device_time_total", "self_device_time_total", "cpu_memory_usage",
             "cuda_memory_usage", "self_cpu_memory_usage", "self_cuda_memory_usage", "count")
_TABLE_KEYS = tuple(name for name in inspect.signature(torch.autograd.profiler_util.EventList.table).parameters
                    if name not in ("self", "sort_by", "row_limit"))


class RegisterRecordFunction:
    """While entered, each submodule's forward of `module` runs inside a `record_function` labelled
    ``[pl][module]{class path}: {name}``, so a profile shows which layer ran each operator.

        with RegisterRecordFunction(model), torch.profiler.profile() as prof:
            model(batch)
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.handles: List[Any] = []
        self.open: Dict[str, List[Any]] = {}  # (a stack per layer: a layer may be called inside itself)

    def __enter__(self) -> "RegisterRecordFunction":
        for name, layer in self.module.named_modules():
            if not name:
                continue
            label = f"[pl][module]{type(layer).__module__}.{type(layer).__name__}: {name}"
            self.handles.append(layer.register_forward_pre_hook(self.opener(label)))
            self.handles.append(layer.register_forward_hook(self.closer(label), always_call=True))
        return self

    def opener(self, label: str) -> Any:
        def open_range(layer: torch.nn.Module, args: Any) -> None:
            record = record_function(label)
            record.__enter__()
            self.open.setdefault(label, []).append(record)
        return open_range

    def closer(self, label: str) -> Any:
        def close_range(layer: torch.nn.Module, args: Any, output: Any) -> None:
            stack = self.open.get(label)
            if stack:
                stack.pop().__exit__(None, None, None)
        return close_range

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for stack in self.open.values():
            while stack:
                stack.pop().__exit__(None, None, None)


class PyTorchProfiler(Profiler):
    """torch.profiler over each stage: an operator table (the report) and Chrome traces, per rank.

    - `dirpath`, `filename`: where the report (``{stage}-{filename}[-{rank}].txt``) and the traces go; `dirpath`
      defaults to the Trainer's log_dir. Without `filename` the report is printed only.
    - `group_by_input_shapes`: one table row per operator and input shapes (turns `record_shapes` on).
    - `emit_nvtx`: NVTX ranges for NVIDIA's nsys/nvprof instead of torch's own profiler (needs a CUDA GPU).
    - `export_to_chrome`: write each recorded cycle as a Chrome trace, ``{stem}-{step action}.{cycle}.pt.trace.json``.
    - `row_limit` (-1: every row), `sort_by_key` (one of `SORT_KEYS`; default the device time where CUDA is
      profiled, else the CPU time), `table_kwargs` (more arguments of torch's `EventList.table`).
    - `record_module_names`: label each layer's forward in the trace (with torch 2.13, torch's profiler has been seen
      to crash at shutdown now and then with the labels on; False avoids it).
    - `profiler_kwargs`: torch.profiler.profile's own (`schedule`, `activities` (default: the CPU, plus CUDA where
      a GPU is available), `record_shapes`, `profile_memory`, `with_stack`, `with_flops`, `with_modules`,
      `on_trace_ready` (replaces the Chrome export), ...), and Lightning's `export_to_flame_graph` / `metric`
      (``{stem}-{step action}.{cycle}.stack``, for flamegraph.pl). The report covers every cycle of the stage.
    """

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None,
                 group_by_input_shapes: bool = False, emit_nvtx: bool = False, export_to_chrome: bool = True,
                 row_limit: int = 20, sort_by_key: Optional[str] = None, record_module_names: bool = True,
                 table_kwargs: Optional[Dict[str, Any]] = None, **profiler_kwargs: Any) -> None:
        super().__init__(dirpath, filename)
        for name, value in (("group_by_input_shapes", group_by_input_shapes), ("emit_nvtx", emit_nvtx),
                            ("export_to_chrome", export_to_chrome), ("record_module_names", record_module_names)):
            if not isinstance(value, bool):
                raise TypeError(f"PyTorchProfiler({name}={value!r}): pass True or False.")
        if isinstance(row_limit, bool) or not isinstance(row_limit, int) or row_limit == 0 or row_limit < -1:
            raise ValueError(f"PyTorchProfiler(row_limit={row_limit!r}): pass how many rows the table shows, an int "
                             f">= 1, or -1 for all of them.")
        kwargs = dict(profiler_kwargs)
        self.export_to_flame_graph = kwargs.pop("export_to_flame_graph", False)
        self.metric = kwargs.pop("metric", "self_cpu_time_total")
        if self.export_to_flame_graph:
            kwargs["with_stack"] = True  # (the stacks are what a flame graph draws)
            # torch keeps the Python frames of the stacks only in verbose mode (its export_stacks docs say so)
            kwargs.setdefault("experimental_config", torch.profiler._ExperimentalConfig(verbose=True))
        if group_by_input_shapes:
            if kwargs.get("record_shapes") is False:
                raise ValueError("PyTorchProfiler(group_by_input_shapes=True, record_shapes=False): grouping by input "
                                 "shapes needs the shapes recorded; drop record_shapes=False.")
            kwargs["record_shapes"] = True
        if emit_nvtx and not torch.cuda.is_available():
            raise ValueError("PyTorchProfiler(emit_nvtx=True): NVTX ranges are for NVIDIA's nsys/nvprof and need a "
                             "CUDA GPU, and none is available; drop emit_nvtx to use torch's profiler.")
        kwargs.setdefault("schedule", torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1))
        if kwargs.get("activities") is None:
            kwargs["activities"] = default_activities()
        self.user_on_trace_ready = kwargs.pop("on_trace_ready", None)
        # (checked now, so a mistake shows where the profiler is written, not when the first stage starts)
        checked = torch_profiler_arguments("PyTorchProfiler", on_trace_ready=self.user_on_trace_ready, **kwargs)
        cuda = torch.profiler.ProfilerActivity.CUDA in checked["activities"]
        sort_by_key = sort_by_key or ("device_time_total" if cuda else "cpu_time_total")
        if sort_by_key not in SORT_KEYS:
            raise ValueError(f"PyTorchProfiler(sort_by_key={sort_by_key!r}): pass one of {list(SORT_KEYS)}.")
        table_kwargs = dict(table_kwargs or {})
        for key in table_kwargs:
            if key not in _TABLE_KEYS:
                why = "is an argument of PyTorchProfiler itself" if key in ("sort_by", "row_limit") else \
                    f"is not an argument of torch's EventList.table; it takes {list(_TABLE_KEYS)}"
                raise ValueError(f"PyTorchProfiler(table_kwargs={table_kwargs!r}): {key!r} {why}.")
        self.group_by_input_shapes = group_by_input_shapes
        self.emit_nvtx = emit_nvtx
        self.export_to_chrome = export_to_chrome
        self.row_limit = row_limit
        self.sort_by_key = sort_by_key
        self.record_module_names = record_module_names
        self.table_kwargs = table_kwargs
        self.profiler_kwargs = kwargs
        #: The torch profiler of the running stage (None between stages).
        self.profiler: Optional[torch.profiler.profile] = None
        #: The events of the stage's recorded cycles, in order, read after the stage (None before).
        self.function_events: Optional[List[Any]] = None
        self.cycle_events: List[Any] = []
        self.cycle_averages: List[Any] = []  # each cycle's key_averages(), summed in the report
        self.nvtx: List[Any] = []
        self.labels: Optional[RegisterRecordFunction] = None
        self.recording: Dict[str, List[Any]] = {}
        self.user_schedule = checked["schedule"]
        self.counts: Dict[str, int] = {}  # the stage's steps of each kind that the schedule counted
        self.owner: Optional[str] = None  # the kind of step whose cycle is running (None: none is)
        self.next_action: Any = None  # what the schedule answers torch at its next step
        self.cycles = 0  # recorded cycles handed to on_trace_ready
        self.last_step_action: Optional[str] = None

    # -- a stage -----------------------------------------------------------------------------------
    def setup(self, stage: str, rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        self.close()
        super().setup(stage, rank, log_dir)
        self.function_events = None
        self.cycle_events, self.cycle_averages = [], []
        self.counts = {}
        self.owner = self.last_step_action = None
        self.cycles = 0

    def open(self) -> None:
        """Start profiling (at the stage's first action)."""
        if self.emit_nvtx:
            self.nvtx = [torch.cuda.profiler.profile(),
                         torch.autograd.profiler.emit_nvtx(record_shapes=self.profiler_kwargs.get("record_shapes",
                                                                                                   False))]
            for context in self.nvtx:
                context.__enter__()
        else:
            arguments = dict(self.profiler_kwargs, on_trace_ready=self.trace_ready, schedule=None)
            if self.user_schedule is not None:
                self.next_action = self.user_schedule(0)
                arguments["schedule"] = self.scheduled_action
            self.profiler = make_torch_profiler("PyTorchProfiler", **arguments)
            self.profiler.__enter__()
        if self.record_module_names and isinstance(self.module, torch.nn.Module):
            self.labels = RegisterRecordFunction(self.module).__enter__()

    def close(self) -> None:
        """Stop profiling: close what is still open, keep the recorded events for the report."""
        for stack in self.recording.values():
            while stack:
                stack.pop().__exit__(None, None, None)
        self.recording.clear()
        if self.labels is not None:
            self.labels.__exit__(None, None, None)
            self.labels = None
        while self.nvtx:
            self.nvtx.pop().__exit__(None, None, None)
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)  # (a cycle still recording is handed to trace_ready here)
            if self.cycle_events:
                self.function_events = list(self.cycle_events)

    # -- actions -----------------------------------------------------------------------------------
    def start(self, action: str) -> None:
        if self.profiler is None and not self.nvtx:
            self.open()
        record = record_function("[pl][profile]" + action)
        record.__enter__()
        self.recording.setdefault(action, []).append(record)

    def stop(self, action: str) -> None:
        stack = self.recording.get(action)
        if not stack:
            raise ValueError(f"PyTorchProfiler.stop({action!r}): that action was not started.")
        stack.pop().__exit__(None, None, None)
        if self.profiler is None or not action.endswith(STEP_ACTIONS):
            return
        kind = action[action.rindex(".") + 1:] if "." in action else action
        if self.owner not in (None, kind):
            return  # inside another kind's cycle: recorded there, not counted
        if kind == "validation_step" and self.stage == "fit" and not self.counts.get("training_step"):
            return  # the sanity check
        self.counts[kind] = count = self.counts.get(kind, 0) + 1
        self.last_step_action = action
        if self.user_schedule is not None:
            self.next_action = self.user_schedule(count)
            self.owner = None if self.next_action == torch.profiler.ProfilerAction.NONE else kind
        with warnings.catch_warnings():
            # (torch says a new cycle drops the last one's events: trace_ready has kept them for the report;
            # torch's own acc_events=True, which would keep them, crashes the process now and then)
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
            self.profiler.step()

    def scheduled_action(self, step: int) -> Any:
        """The schedule torch asks at each step: the user's, at the count of the kind of step that just ended
        (torch's own count runs over every kind)."""
        return self.next_action

    def trace_ready(self, profiler: torch.profiler.profile) -> None:
        """A cycle was recorded: keep its events for the report; hand it to the user's `on_trace_ready`, or write
        its Chrome trace (and stacks)."""
        self.cycles += 1
        events = profiler.events()
        self.cycle_events.extend(events)
        self.cycle_averages.append(events.key_averages(group_by_input_shapes=self.group_by_input_shapes))
        if self.user_on_trace_ready is not None:
            self.user_on_trace_ready(profiler)
            return
        stem = os.path.join(self.output_dir() or os.getcwd(), f"{self.file_stem(self.last_step_action)}.{self.cycles}")
        if self.export_to_chrome:
            write_chrome_trace(profiler, stem + ".pt.trace.json")
        if self.export_to_flame_graph:
            profiler.export_stacks(stem + ".stack", metric=self.metric)

    # -- the report --------------------------------------------------------------------------------
    def summary(self) -> str:
        self.close()
        if self.emit_nvtx:
            return ""
        title = f"{(self.stage or '').upper()} Profiler Report".strip()
        rank = "" if self.rank is None else f" rank: {self.rank}"
        if not self.function_events:
            steps = sum(self.counts.values())
            if not steps:
                return ""
            return (f"{title}\nNothing recorded: the stage ran {steps} step(s) and the schedule recorded none of "
                    f"them; pass schedule=None to PyTorchProfiler to record every step, or run more steps.")
        averages = self.summed_averages()
        table = averages.table(sort_by=self.sort_by_key, row_limit=self.row_limit, **self.table_kwargs)
        return f"{title}\nProfile stats for: records{rank}\n{table}"

    def summed_averages(self) -> Any:
        """The operators' averages over every cycle of the stage (torch's EventList of FunctionEventAvg)."""
        averages = self.cycle_averages[0]
        if len(self.cycle_averages) > 1:
            merged: Dict[Any, Any] = {}
            for cycle in self.cycle_averages:
                for average in cycle:
                    key = (average.key, str(average.input_shapes) if self.group_by_input_shapes else None)
                    if key in merged:
                        merged[key].add(average)
                    else:
                        merged[key] = average
            averages[:] = list(merged.values())
            self.cycle_averages = [averages]
        return averages

    def teardown(self, stage: Optional[str] = None) -> None:
        self.close()
