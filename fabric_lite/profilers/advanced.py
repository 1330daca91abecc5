"""`AdvancedProfiler` (`Trainer(profiler="advanced")`): Python's cProfile inside each action, reported per action
sorted by cumulative time, to find which functions a slow hook or step spends its time in.

    trainer = Trainer(profiler=AdvancedProfiler(dirpath="prof", filename="perf", line_count_restriction=20))
    trainer.fit(module, loader)     # prof/fit-perf.txt (fit-perf-{rank}.txt on several processes)

The report is long: every function called inside every action. Nested actions (an epoch holds its steps) are
counted once, in the innermost action running: while a step runs, the epoch's profile pauses.
"""

from __future__ import annotations

import cProfile
import io
import numbers
import os
import pstats
from typing import Dict, List, Optional

from fabric_lite.trainer.profiler import Profiler

__all__ = ["AdvancedProfiler"]


class AdvancedProfiler(Profiler):
    """One cProfile per action; the report lists each action's functions by cumulative time.

    `line_count_restriction`: how many functions each action lists, a count (an int >= 1) or a share of them
    (a float in (0, 1]; 1.0 lists all). `dump_stats`: also write each action's raw stats, ``{stem}-{action}.prof``,
    for `pstats`/snakeviz, into `dirpath` (or the Trainer's log_dir).
    """

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None,
                 line_count_restriction: float = 1.0, dump_stats: bool = False) -> None:
        super().__init__(dirpath, filename)
        value = line_count_restriction
        valid = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
            (isinstance(value, numbers.Integral) and value >= 1) or 0 < value <= 1)
        if not valid:
            raise ValueError(f"AdvancedProfiler(line_count_restriction={value!r}): pass how many functions each "
                             f"action lists, an int >= 1, or the share of them, a float in (0, 1] (1.0 lists all).")
        if not isinstance(dump_stats, bool):
            raise TypeError(f"AdvancedProfiler(dump_stats={dump_stats!r}): pass True or False.")
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats
        self.profiled_actions: Dict[str, cProfile.Profile] = {}
        # The actions running, innermost last: only the innermost records (one cProfile may run at a time).
        self.running: List[str] = []

    def setup(self, stage: str, rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        super().setup(stage, rank, log_dir)
        self.stop_all()
        self.profiled_actions.clear()

    def start(self, action: str) -> None:
        if self.running:
            self.profiled_actions[self.running[-1]].disable()
        profile = self.profiled_actions.get(action)
        if profile is None:
            profile = self.profiled_actions[action] = cProfile.Profile()
        self.running.append(action)
        profile.enable()

    def stop(self, action: str) -> None:
        if action not in self.running:
            raise ValueError(f"AdvancedProfiler.stop({action!r}): that action was not started.")
        self.profiled_actions[self.running[-1]].disable()
        # (the innermost one normally; an action stopped out of order leaves the others running)
        del self.running[len(self.running) - 1 - self.running[::-1].index(action)]
        if self.running:
            self.profiled_actions[self.running[-1]].enable()

    def stop_all(self) -> None:
        """Stop every action still running (a stage that ended by an error)."""
        if self.running:
            self.profiled_actions[self.running[-1]].disable()
        self.running.clear()

    def summary(self) -> str:
        self.stop_all()
        if not self.profiled_actions:
            return ""
        sections = [f"{(self.stage or '').upper()} Profiler Report".strip()]
        rank = "" if self.rank is None else f" rank: {self.rank}"
        for action, profile in self.profiled_actions.items():
            if self.dump_stats:
                path = os.path.join(self.output_dir() or os.getcwd(), self.file_stem(action) + ".prof")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                profile.dump_stats(path)
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative")
            stats.print_stats(self.line_count_restriction)
            sections += [f"Profile stats for: {action}{rank}", text.getvalue()]
        return "\n".join(sections)

    def teardown(self, stage: Optional[str] = None) -> None:
        self.stop_all()
