"""A tqdm progress bar on the main process, with `prog_bar` metrics refreshed every few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.module import TrainModule
    from fabric_lite.trainer import Trainer

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Shows epoch progress and it/s; metric values are read from the device only every `refresh_rate` steps."""

    def __init__(self, refresh_rate: int = 20) -> None:
        self.refresh_rate = refresh_rate
        self._bar: Any = None

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        total: Optional[int]
        try:
            total = len(trainer._train_loader)
        except TypeError:
            total = None
        self._bar = tqdm(total=total, desc=f"Epoch {trainer.current_epoch}", leave=True, dynamic_ncols=True)

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._bar is None or (batch_idx + 1) % self.refresh_rate:
            return
        # Once every `refresh_rate` steps: tqdm's bookkeeping and reading metrics off the device both cost.
        self._bar.update(batch_idx + 1 - self._bar.n)
        self._bar.set_postfix({k: f"{float(v):.4g}" for k, v in trainer.progress_bar_metrics.items()}, refresh=False)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._bar is not None:
            if self._bar.total is not None:
                self._bar.update(self._bar.total - self._bar.n)
            self._bar.set_postfix({k: f"{float(v):.4g}" for k, v in trainer.progress_bar_metrics.items()})
            self._bar.close()
            self._bar = None

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
