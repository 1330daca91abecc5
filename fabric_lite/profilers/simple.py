"""`SimpleProfiler` (`Trainer(profiler="simple")`): the wall time of every hook, step and batch fetch the Trainer
makes, as a table printed at the end of each stage (fit, validate, test, predict) on the main process.

    trainer = Trainer(profiler="simple")            # or profiler=SimpleProfiler(filename="perf")
    trainer.fit(module, loader)                     # the table is printed when fit returns
    text = trainer.profiler.describe()              # the same table, as text

Actions nest (an epoch holds its steps), so the percentages do not add up to 100. Times are host (CPU) times:
CUDA kernels run asynchronously, so a step's GPU work is counted where the host waits for it (often at a later
`.item()` or at the optimizer step), as in any profiler that does not synchronize.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Dict, List, Optional

from fabric_lite.profilers.profiler import Profiler

__all__ = ["SimpleProfiler"]


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
