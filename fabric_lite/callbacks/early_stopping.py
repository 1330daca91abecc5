"""EarlyStopping: stop when a monitored metric has not improved for `patience` checks (all ranks agree)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict


from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    def __init__(self, monitor: str, patience: int = 3, mode: str = "min", min_delta: float = 0.0,
                 check_finite: bool = True) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): allowed values are 'min' and 'max'.")
        self.monitor = monitor
        self.patience = patience
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.check_finite = check_finite
        self.best = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch = -1

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[{self.monitor}]"

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.wait_count, self.stopped_epoch = state["best"], state["wait_count"], state["stopped_epoch"]

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if trainer.sanity_checking:
            return
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(
                f"EarlyStopping(monitor={self.monitor!r}) found no such logged metric. Logged: "
                f"{sorted(trainer.callback_metrics)}."
            )
        # Rank 0 decides from its value; every rank receives the same decision, so none waits alone.
        current = float(trainer.strategy.collectives.broadcast(trainer.callback_metrics[self.monitor].detach().float()
                                                   .reshape(1).to(trainer.device).clone(), 0))
        improved = (current < self.best - self.min_delta) if self.mode == "min" else (current > self.best + self.min_delta)
        if improved:
            self.best, self.wait_count = current, 0
        else:
            self.wait_count += 1
        if (self.check_finite and not math.isfinite(current)) or self.wait_count >= self.patience:
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
