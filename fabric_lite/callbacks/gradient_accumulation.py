"""GradientAccumulationScheduler: how many batches make one optimizer step, changing from epoch to epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["GradientAccumulationScheduler"]


class GradientAccumulationScheduler(Callback):
    """Accumulate `scheduling[e]` batches per optimizer step from (zero-based) epoch `e` on.

    ``GradientAccumulationScheduler(scheduling={0: 8, 4: 4, 8: 1})`` accumulates 8 batches in epochs 0-3, 4 in
    epochs 4-7 and none from epoch 8 on; without a key 0, epochs before the first key accumulate nothing. Each
    epoch's windows are the step engine's (a short last window averages over its real length), set through
    `trainer.accumulate_grad_batches` when the epoch starts. Leave `Trainer(accumulate_grad_batches=...)` at 1.
    """

    def __init__(self, scheduling: Dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(f"GradientAccumulationScheduler(scheduling={scheduling!r}) must be a non-empty dict "
                            f"{{epoch: batches per step}}, e.g. {{0: 8, 4: 4, 8: 1}}.")
        bad_keys = [k for k in scheduling if not _is_int(k) or k < 0]
        if bad_keys:
            raise ValueError(f"GradientAccumulationScheduler(scheduling={scheduling!r}): epochs {bad_keys} must be "
                             f"integers >= 0 (zero-based: {{4: 2}} changes the factor from the fifth epoch on).")
        bad_values = [v for v in scheduling.values() if not _is_int(v) or v < 1]
        if bad_values:
            raise ValueError(f"GradientAccumulationScheduler(scheduling={scheduling!r}): accumulation factors "
                             f"{bad_values} must be integers >= 1 (1: an optimizer step every batch).")
        self.scheduling = dict(scheduling)
        self.scheduling.setdefault(0, 1)
        self.epochs = sorted(self.scheduling)
        self._given: Optional[int] = None  # the Trainer's own value, put back when fit ends

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether any epoch accumulates more than one batch."""
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The accumulation factor of `epoch`: the value of the last key at or before it."""
        factor = 1
        for start in self.epochs:
            if epoch >= start:
                factor = self.scheduling[start]
        return factor

    def on_train_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not module.automatic_optimization:
            raise RuntimeError(
                f"GradientAccumulationScheduler accumulates for automatic optimization, and "
                f"{type(module).__name__} sets automatic_optimization=False (its training_step steps the optimizers "
                f"itself). Remove the callback, or accumulate in training_step.")
        if trainer.strategy.engine_step is not None:
            raise RuntimeError(
                f"{type(trainer.strategy).__name__} fixes the accumulation window when its engine is built, so it "
                f"cannot change between epochs. Remove GradientAccumulationScheduler, or use another strategy.")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and a "
                f"GradientAccumulationScheduler both set the accumulation: leave accumulate_grad_batches at 1 "
                f"(put the factor in scheduling={{0: {trainer.accumulate_grad_batches}, ...}}) or drop the callback.")
        self._given = trainer.accumulate_grad_batches

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage == "fit" and self._given is not None:  # a later fit() of this Trainer starts from its own value
            trainer.accumulate_grad_batches = self._given
            self._given = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
