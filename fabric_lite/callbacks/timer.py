"""Timer: how long training, validation and testing took, and a stop once training has used its time."""

from __future__ import annotations

import re
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["Timer", "STAGES"]

#: The stages a Timer measures (Lightning's running-stage names).
STAGES = ("train", "sanity_check", "validate", "test", "predict")
_INTERVALS = ("step", "epoch")


class Timer(Callback):
    """Stop training once `duration` has passed, checked after every batch (``interval="step"``) or epoch.

    `duration` is ``"DD:HH:MM:SS"`` (``"00:12:00:00"``: twelve hours), a `timedelta`, a dict of timedelta's
    arguments (``dict(weeks=1, days=2)``) or None (measure only). The training time spent so far is saved in
    checkpoints, so a resumed run stops when the total, not its own part, reaches `duration`. Times are in
    seconds: ``timer.time_elapsed("train")``, ``timer.time_remaining()``, ``timer.start_time("validate")``.
    """

    def __init__(self, duration: Union[str, timedelta, Dict[str, int], None] = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if isinstance(duration, str):
            found = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
            if not found:
                raise ValueError(f"Timer(duration={duration!r}) is not a duration: write it DD:HH:MM:SS, e.g. "
                                 f"'00:12:00:00' for twelve hours, or pass a datetime.timedelta or a dict.")
            days, hours, minutes, seconds = (int(g) for g in found.groups())
            duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        elif isinstance(duration, dict):
            try:
                duration = timedelta(**duration)
            except TypeError as err:
                raise ValueError(f"Timer(duration={duration!r}): {err}; use timedelta's arguments (weeks, days, "
                                 f"hours, minutes, seconds, ...).") from None
        elif duration is not None and not isinstance(duration, timedelta):
            raise TypeError(f"Timer(duration={duration!r}) must be a 'DD:HH:MM:SS' string, a datetime.timedelta, a "
                            f"dict of timedelta arguments, or None; got {type(duration).__name__}.")
        if interval not in _INTERVALS:
            raise ValueError(f"Timer(interval={interval!r}): allowed values are 'step' (check after every batch) "
                             f"and 'epoch' (check at epoch ends).")
        self.duration: Optional[float] = duration.total_seconds() if duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._start: Dict[str, Optional[float]] = dict.fromkeys(STAGES)
        self._end: Dict[str, Optional[float]] = dict.fromkeys(STAGES)
        self._offset = 0.0  # training seconds of the runs before a resume

    # -- what users read -----------------------------------------------------------------------------
    def start_time(self, stage: str = "train") -> Optional[float]:
        """When `stage` last started (time.monotonic() seconds), or None."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> Optional[float]:
        """When `stage` last ended (time.monotonic() seconds), or None while it runs or before it ran."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in `stage` (its last run; for training, with the time of the runs before a resume)."""
        stage = _stage(stage)
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> Optional[float]:
        """Seconds left of `duration` (negative once over), or None without a duration."""
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    # -- measuring -----------------------------------------------------------------------------------
    def _mark(self, which: Dict[str, Optional[float]], stage: str) -> None:
        which[stage] = time.monotonic()
        if which is self._start:
            self._end[stage] = None

    def on_train_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._start, "train")

    def on_train_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._end, "train")

    def on_validation_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._start, "sanity_check" if trainer.sanity_checking else "validate")

    def on_validation_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._end, "sanity_check" if trainer.sanity_checking else "validate")

    def on_test_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._start, "test")

    def on_test_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._mark(self._end, "test")

    # -- stopping ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.duration is not None:  # a resumed run whose time was already used up trains no batch
            self._check(trainer)

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.interval == "step" and self.duration is not None:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.interval == "epoch" and self.duration is not None:
            self._check(trainer)

    def _check(self, trainer: "Trainer") -> None:
        assert self.duration is not None
        up = self.time_elapsed("train") >= self.duration
        if trainer.world_size > 1:  # every process stops at the same batch: rank 0's clock decides
            up = bool(trainer.strategy.collectives.broadcast_object(up))
        if up and not trainer.should_stop:
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                spent = timedelta(seconds=int(self.time_elapsed("train")))
                print(f"Timer: time limit reached ({spent} of training). Stopping.", file=sys.stderr, flush=True)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))


def _stage(stage: Any) -> str:
    name = str(getattr(stage, "value", stage))
    if name not in STAGES:
        raise ValueError(f"Timer: unknown stage {stage!r}; allowed values are {', '.join(map(repr, STAGES))}.")
    return name
