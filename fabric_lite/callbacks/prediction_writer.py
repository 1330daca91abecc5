"""`BasePredictionWriter`: write predictions as they come (per batch) or once per run (per epoch), on every process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["BasePredictionWriter", "WriteInterval"]


class WriteInterval:
    """When a writer writes: "batch", "epoch" or "batch_and_epoch"."""

    CHOICES = ("batch", "epoch", "batch_and_epoch")

    def __init__(self, value: str) -> None:
        if value not in self.CHOICES:
            raise ValueError(f"write_interval={value!r} is not one of {', '.join(map(repr, self.CHOICES))}; "
                             f"choose when write_on_batch_end / write_on_epoch_end are called.")
        self.value = value

    @property
    def on_batch(self) -> bool:
        return self.value in ("batch", "batch_and_epoch")

    @property
    def on_epoch(self) -> bool:
        return self.value in ("epoch", "batch_and_epoch")

    def __repr__(self) -> str:
        return f"WriteInterval({self.value!r})"


class BasePredictionWriter(Callback):
    """Subclass it and write `write_on_batch_end` and/or `write_on_epoch_end`; every process calls them with its
    own predictions and their dataset indices. To put every process's predictions together in dataset order,
    call `fabric_lite.trainer.predict_loop.gather_in_dataset_order` in `write_on_epoch_end` (a collective), or
    `trainer.predict(..., gather=True)`.

    Examples:
        >>> class Saver(BasePredictionWriter):
        ...     def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        ...         torch.save((predictions, batch_indices), f"preds_{trainer.global_rank}.pt")
    """

    def __init__(self, write_interval: str = "batch") -> None:
        self.interval = WriteInterval(write_interval)

    def write_on_batch_end(self, trainer: "Trainer", pl_module: "TrainModule", prediction: Any,
                           batch_indices: Optional[Sequence[int]], batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        """Write one batch's prediction; `batch_indices`: the dataset indices of its samples (None: unknown)."""
        raise NotImplementedError(f"{type(self).__name__} writes per batch (write_interval="
                                  f"{self.interval.value!r}) but has no write_on_batch_end.")

    def write_on_epoch_end(self, trainer: "Trainer", pl_module: "TrainModule", predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        """Write this process's predictions (a list of batch outputs; a list of such lists for several loaders)
        and, per loader, each batch's dataset indices."""
        raise NotImplementedError(f"{type(self).__name__} writes per epoch (write_interval="
                                  f"{self.interval.value!r}) but has no write_on_epoch_end.")

    def on_predict_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.interval.on_batch:
            self.write_on_batch_end(trainer, module, outputs, trainer.predict_loop.current_batch_indices, batch,
                                    batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.interval.on_epoch:
            loop = trainer.predict_loop
            self.write_on_epoch_end(trainer, module, loop.predictions, loop.epoch_batch_indices)


