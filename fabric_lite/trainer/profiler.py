"""What the Trainer's `profiler=` takes: `Profiler` (start/stop around each action, a report per stage, written per
rank), `PassThroughProfiler` (profiling off), `TimedHooks` (a callback's or module's hooks read as timed calls) and
`SimpleProfiler` (wall times as a table). The others live in `fabric_lite.profilers`, with the names they go by.

A profiler is the instrument on the Trainer's event bus (`fabric_lite/events.py`): its `wrap`, `iterate` and
`timed` give the loops what they call in place of each step, hook and loader.

Actions are named as in Lightning: ``[Strategy]DDPStrategy.training_step`` (the step through the strategy's
wrapper), ``[Strategy]DDPStrategy.backward``, ``[Strategy]DDPStrategy.optimizer_step``,
``[TrainModule]MyModule.on_train_epoch_start``, ``[Callback]ModelCheckpoint.on_train_batch_end``,
``train_dataloader_next``, ``run_training_epoch``, ...

Without a profiler (`profiler=None`) the Trainer holds a `PassThroughProfiler`, which is no instrument: the loops
call their steps as they are.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

__all__ = ["Profiler", "PassThroughProfiler", "TimedHooks", "SimpleProfiler"]


class Profiler:
    """The base of profilers: `start(action)` / `stop(action)` around each timed call, `summary()` the report.

    `dirpath` / `filename`: where `describe()` also writes the report, as ``{stage}-{filename}.txt`` (with
    ``-{rank}`` on several processes, as Lightning names it) under `dirpath`, by default the Trainer's `log_dir`.
    """

    #: False for the profiler that times nothing: the Trainer's loops then skip every timing wrapper.
    enabled: bool = True

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None) -> None:
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.stage: Optional[str] = None
        self.rank: Optional[int] = None
        #: Where the report file goes when `dirpath` is None (the Trainer sets its `log_dir`).
        self.log_dir: Optional[str] = None
        #: The module being trained (set by the Trainer before `setup`), for profilers that label its layers.
        self.module: Any = None

    # -- what a profiler implements ----------------------------------------------------------------
    def start(self, action: str) -> None:
        raise NotImplementedError

    def stop(self, action: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        """The report of the stage that ran last ("" when there is nothing to report)."""
        return ""

    # -- shared ------------------------------------------------------------------------------------
    def setup(self, stage: str, rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        """A stage starts: forget the previous stage's records. `rank` names this process in the report's
        file name (None on one process)."""
        self.stage, self.rank = stage, rank
        if log_dir is not None:
            self.log_dir = os.fspath(log_dir)

    def teardown(self, stage: Optional[str] = None) -> None:
        """A stage ended (its report stays readable until the next `setup`)."""

    @contextlib.contextmanager
    def profile(self, action: str) -> Iterator[str]:
        """`with trainer.profiler.profile("my_action"): ...` times the block as one call of `action`."""
        self.start(action)
        try:
            yield action
        finally:
            self.stop(action)

    def wrap(self, action: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, timed as one call of `action` each time it is called."""
        start, stop = self.start, self.stop

        def timed(*args: Any, **kwargs: Any) -> Any:
            start(action)
            try:
                return fn(*args, **kwargs)
            finally:
                stop(action)

        return timed

    def iterate(self, action: str, iterable: Iterable[Any]) -> Iterator[Any]:
        """The items of `iterable`, each fetch timed as one call of `action` (the last, empty one too).
        Closing this generator closes the iterator beneath it."""
        iterator = iter(iterable)
        try:
            while True:
                self.start(action)
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self.stop(action)
                yield item
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def timed(self, owner: Any, kind: str, base: Optional[type] = None) -> "TimedHooks":
        """`owner` (a callback, a module) whose methods, read through the result, are timed as
        ``[kind]OwnerClass.method``; those it leaves as `base` defines them (empty hooks) are not timed."""
        return TimedHooks(self, owner, kind, base)

    def file_stem(self, action: Optional[str] = None) -> str:
        """The name this stage's files start with: ``{stage}-{filename}-{rank}-{action}``, each part only where
        there is one (Lightning's naming): ``fit-perf-1`` for rank 1's report of fit."""
        parts = [self.stage, self.filename, None if self.rank is None else str(self.rank), action]
        return "-".join(part for part in parts if part)

    def output_dir(self) -> Optional[str]:
        """Where this profiler writes its files: `dirpath`, else the Trainer's `log_dir` (None outside one)."""
        return self.dirpath or self.log_dir

    def report_path(self) -> Optional[str]:
        """The file `describe()` writes, or None without a `filename`."""
        if not self.filename:
            return None
        return os.path.join(self.output_dir() or os.getcwd(), self.file_stem() + ".txt")

    def describe(self) -> str:
        """The report of the stage that ran last (written to `report_path()` too, where there is one)."""
        text = self.summary()
        path = self.report_path()
        if text and path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
        return text


class PassThroughProfiler(Profiler):
    """Times nothing (`Trainer(profiler=None)`); `profile()` blocks in user code still run."""

    enabled = False

    def start(self, action: str) -> None:
        pass

    def stop(self, action: str) -> None:
        pass

    def summary(self) -> str:
        return ""


class TimedHooks:
    """Reads the methods of `owner` as timed wrappers (``[kind]OwnerClass.method``); other attributes, and the
    methods `owner` inherits unchanged from `base` (the empty default hooks), as they are.
    Built by `Profiler.timed`, once per epoch or stage, only when a profiler is on."""

    def __init__(self, profiler: Profiler, owner: Any, kind: str, base: Optional[type] = None) -> None:
        self.profiler_ = profiler
        self.owner_ = owner
        self.base_ = base
        self.prefix_ = f"[{kind}]{type(owner).__name__}."

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.owner_, name)
        if not callable(value):
            return value
        base = self.base_
        default = base is not None and name not in vars(self.owner_) and \
            getattr(type(self.owner_), name, None) is getattr(base, name, self)
        timed = value if default else self.profiler_.wrap(self.prefix_ + name, value)
        self.__dict__[name] = timed  # (read once: the next read finds it without __getattr__)
        return timed


class SimpleProfiler(Profiler):
    """Wall time of each action: mean duration, number of calls, total time and share of the stage.

    `extended=False` leaves out the number of calls and the share. The stage's time ("Total") runs from the
    start of the stage to the report.
    """

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None, extended: bool = True) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended
        self.recorded_durations: Dict[str, List[float]] = defaultdict(list)
        self.current_actions: Dict[str, List[float]] = {}
        self.start_time = time.perf_counter()

    def setup(self, stage: str, rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        super().setup(stage, rank, log_dir)
        self.recorded_durations.clear()
        self.current_actions.clear()
        self.start_time = time.perf_counter()

    def start(self, action: str) -> None:
        # (a stack per action: a hook may run again inside itself, e.g. a save inside a save hook)
        self.current_actions.setdefault(action, []).append(time.perf_counter())

    def stop(self, action: str) -> None:
        end = time.perf_counter()
        started = self.current_actions.get(action)
        if not started:
            raise ValueError(f"SimpleProfiler.stop({action!r}): that action was not started.")
        self.recorded_durations[action].append(end - started.pop())

    def summary(self) -> str:
        if not self.recorded_durations:
            return ""
        total = time.perf_counter() - self.start_time
        rows = sorted(((action, sum(times), len(times)) for action, times in self.recorded_durations.items()),
                      key=lambda row: row[1], reverse=True)
        calls = sum(n for _, _, n in rows)
        if self.extended:
            header = ["Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"]
            body = [["Total", "-", str(calls), f"{total:.5g}", "100 %"]]
            body += [[action, f"{spent / n:.5g}", str(n), f"{spent:.5g}", f"{100.0 * spent / total:.4g} %"]
                     for action, spent, n in rows]
        else:
            header = ["Action", "Mean duration (s)", "Total time (s)"]
            body = [["Total", "-", f"{total:.5g}"]] + [[action, f"{spent / n:.5g}", f"{spent:.5g}"]
                                                       for action, spent, n in rows]
        widths = [max(len(header[i]), *(len(row[i]) for row in body)) for i in range(len(header))]

        def line(cells: List[str]) -> str:
            return "|  " + "  |  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  |"

        rule = "-" * len(line(header))
        title = f"{(self.stage or '').upper()} Profiler Report".strip()
        return "\n".join([title, "", rule, line(header), rule, line(body[0]), rule, *map(line, body[1:]), rule])
