"""Lightning's tuner, `from lightning.pytorch.tuner import Tuner`: `Tuner(trainer).scale_batch_size(module)` and
`Tuner(trainer).lr_find(module)`.

Each call runs a fit that stops once its search is done: the finder callback (`fabric_lite.callbacks.finders`)
is the only callback of that fit, probes at its start, puts the module's and the fit's state back and ends it
before the first training step. The module's batch-size or learning-rate attribute is then set; a fit afterwards
starts from the state the module had before (the same weights, and the same random generators' state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fabric_lite.callbacks.finders import (
    BATCH_SIZE_MODES, LR_MODES, BatchSizeFinder, LearningRateFinder, LRFinder, TuningFinished,
)

if TYPE_CHECKING:
    from fabric_lite.trainer.module import DataModule, TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["Tuner", "LRFinder", "BATCH_SIZE_MODES", "LR_MODES"]


class Tuner:
    """`Tuner(trainer)`: the batch-size search and the learning-rate range test, run before `trainer.fit`."""

    def __init__(self, trainer: "Trainer") -> None:
        self._trainer = trainer

    def scale_batch_size(self, model: "TrainModule", train_dataloaders: Any = None, val_dataloaders: Any = None,
                         dataloaders: Any = None, datamodule: Optional["DataModule"] = None, method: str = "fit",
                         mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                         batch_arg_name: str = "batch_size", keep_global_batch: bool = False) -> Optional[int]:
        """The largest batch size that fits (see `BatchSizeFinder`), set on `batch_arg_name` and returned (None
        where the search did not run: fast_dev_run, or `fabric-lite explain`). The loaders must come from
        train_dataloader() of the module or the datamodule; loaders given directly are refused."""
        _check_method("scale_batch_size", method, dataloaders)
        if train_dataloaders is not None and not _is_datamodule(train_dataloaders):
            raise ValueError("Tuner.scale_batch_size: a loader given as train_dataloaders= keeps its batch size; "
                             "build it in train_dataloader() of the module or a DataModule from the attribute "
                             f"{batch_arg_name!r} instead.")
        finder = BatchSizeFinder(mode=mode, steps_per_trial=steps_per_trial, init_val=init_val, max_trials=max_trials,
                                 batch_arg_name=batch_arg_name, keep_global_batch=keep_global_batch)
        self._run(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_batch_size

    def lr_find(self, model: "TrainModule", train_dataloaders: Any = None, val_dataloaders: Any = None,
                dataloaders: Any = None, datamodule: Optional["DataModule"] = None, method: str = "fit",
                min_lr: float = 1e-08, max_lr: float = 1.0, num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: Optional[float] = 4.0, update_attr: bool = True,
                attr_name: str = "") -> Optional[LRFinder]:
        """The learning-rate range test (see `LearningRateFinder`): returns its `LRFinder` (`results`,
        `suggestion()`, `plot()`), or None where it did not run; with `update_attr`, the suggestion is set on
        `attr_name` (or "lr" / "learning_rate")."""
        _check_method("lr_find", method, dataloaders)
        finder = LearningRateFinder(min_lr=min_lr, max_lr=max_lr, num_training_steps=num_training, mode=mode,
                                    early_stop_threshold=early_stop_threshold, update_attr=update_attr,
                                    attr_name=attr_name)
        self._run(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_lr

    def _run(self, finder: Any, model: "TrainModule", train_dataloaders: Any, val_dataloaders: Any,
             datamodule: Optional["DataModule"]) -> None:
        trainer = self._trainer
        finder.stop_after_search = True
        kept = {name: getattr(trainer, name) for name in _TRAINER_STATE}
        try:
            trainer.callbacks = [finder]  # (the fit's own: loggers, checkpoints, progress bars stay out of it)
            trainer.enable_model_summary = False
            trainer.fit(model, train_dataloaders, val_dataloaders, datamodule=datamodule)
        except TuningFinished:
            pass
        finally:
            for name, value in kept.items():
                setattr(trainer, name, value)


#: What a tuning fit changes on the Trainer and the Tuner puts back.
_TRAINER_STATE = ("callbacks", "global_step", "current_epoch", "should_stop", "enable_model_summary")


def _is_datamodule(value: Any) -> bool:
    from fabric_lite.trainer.module import DataModule

    return isinstance(value, DataModule)


def _check_method(name: str, method: str, dataloaders: Any) -> None:
    if method != "fit":
        raise ValueError(f"Tuner.{name}(method={method!r}): only method='fit' is available (the search runs "
                         f"training steps).")
    if dataloaders is not None:
        raise ValueError(f"Tuner.{name}: dataloaders= goes with validate/test/predict; pass train_dataloaders= "
                         f"(or a datamodule) for method='fit'.")
