"""LearningRateMonitor: log each optimizer's learning rate to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["LearningRateMonitor"]


class LearningRateMonitor(Callback):
    def __init__(self, logging_interval: str = "epoch") -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step' or 'epoch'.")
        self.logging_interval = logging_interval
        self._logged_step = 0  # report after optimizer steps, not before the first

    def _rates(self, trainer: "Trainer") -> Dict[str, float]:
        out: Dict[str, float] = {}
        for i, opt in enumerate(trainer.optimizers):
            name = f"lr-{type(opt.optimizer).__name__}" + (f"-{i}" if len(trainer.optimizers) > 1 else "")
            groups = opt.param_groups
            for g, group in enumerate(groups):
                out[name if len(groups) == 1 else f"{name}/pg{g}"] = float(group["lr"])
        return out

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.logging_interval == "step" and step % trainer.log_every_n_steps == 0 and step != self._logged_step:
            self._logged_step = step  # with accumulation, several batches end on one optimizer step
            trainer.log_metrics(self._rates(trainer))

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.logging_interval == "epoch":
            trainer.log_metrics(self._rates(trainer))
