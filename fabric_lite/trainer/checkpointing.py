"""The Trainer's checkpoint glue: its own part of a checkpoint, where a resumed fit starts from, and the weights
validate/test/predict load for `ckpt_path`. The files themselves are written and read by `fabric_lite.checkpoint`."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["TrainerCheckpointState", "LoggedAggregates", "restore", "load_eval_weights"]


class TrainerCheckpointState:
    """The Trainer's part of a checkpoint: counters, callback states, hyperparameters."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> Dict[str, Any]:
        t, module = self.trainer, self.trainer.module
        assert module is not None  # (saved and loaded while a run holds its module)
        extra: Dict[str, Any] = {}
        module.on_save_checkpoint(extra)
        for cb in t.callbacks:
            cb.on_save_checkpoint(t, module, extra)
        state = {
            "epoch": t.current_epoch, "global_step": t.global_step, "epoch_finished": t.epoch_finished,
            "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
            "hyper_parameters": dict(module.hparams), "extra": extra,
        }
        if t.datamodule is not None:  # (under its class's name, as Lightning keeps it)
            state["datamodule"] = {type(t.datamodule).__qualname__: t.datamodule.state_dict()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        t, module = self.trainer, self.trainer.module
        assert module is not None
        t.current_epoch = int(state["epoch"]) + (1 if state.get("epoch_finished") else 0)
        t.global_step = int(state["global_step"])
        saved = state.get("datamodule", {})
        if t.datamodule is not None and type(t.datamodule).__qualname__ in saved:
            t.datamodule.load_state_dict(saved[type(t.datamodule).__qualname__])
        for cb in t.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        extra = state.get("extra", {})
        module.on_load_checkpoint(extra)
        for cb in t.callbacks:
            cb.on_load_checkpoint(t, module, extra)


class LoggedAggregates:
    """Each process's unfinished epoch aggregates of `self.log` (saved per rank: they differ between ranks)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> Dict[str, Any]:
        return self.trainer.metric_store.state_dict(self.trainer.module)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.trainer.metric_store.load_state_dict(state, self.trainer.module)


def restore(trainer: "Trainer", ckpt_path: str) -> None:
    """Load a whole checkpoint to go on training: a path, or "last" (the newest whole one; none: a fresh start)."""
    if ckpt_path == "last":
        from fabric_lite.checkpoint import files as checkpoint_io

        root = trainer.checkpoint_dir()
        found = checkpoint_io.newest_whole_checkpoint(root) if trainer.is_global_zero else None
        found = trainer.strategy.collectives.broadcast_object(found)
        if found is None:
            return  # nothing saved yet: a fresh start, as Lightning does
        ckpt_path = found
    trainer.accelerator.load_state(ckpt_path)


def load_eval_weights(trainer: "Trainer", stage: str, ckpt_path: str) -> None:
    """validate/test/predict(ckpt_path=...): the weights of "best" (the checkpoint callback's best model),
    "last" (its newest checkpoint) or a path, into the module (Lightning's rules, its errors)."""
    path: Optional[str] = ckpt_path
    callback: Any = trainer.checkpoint_callback
    if ckpt_path == "best":
        path = callback.best_model_path if callback is not None else ""
        if not path and trainer.fast_dev_run:
            raise ValueError(f'{stage}(ckpt_path="best") with fast_dev_run: fast_dev_run saves no checkpoints. '
                             f'Pass a checkpoint path to {stage}(ckpt_path=...).')
        if callback is None:
            raise ValueError(f'{stage}(ckpt_path="best") needs a ModelCheckpoint, and this Trainer has none '
                             f'(enable_checkpointing=False). Pass a checkpoint path instead.')
        if not path:
            raise ValueError(f'{stage}(ckpt_path="best"): the ModelCheckpoint has no best model: no checkpoint '
                             f'has been saved yet (fit() first, or the monitored metric was never logged). Pass a '
                             f'checkpoint path to {stage}(ckpt_path=...).')
    elif ckpt_path == "last":
        from fabric_lite.checkpoint import files as checkpoint_io

        path = callback.last_model_path if callback is not None else ""
        if not path:
            found = checkpoint_io.newest_whole_checkpoint(trainer.checkpoint_dir()) if trainer.is_global_zero else None
            path = trainer.strategy.collectives.broadcast_object(found)
        if not path:
            warnings.warn(f'{stage}(ckpt_path="last"): there is no checkpoint yet; the module runs with the '
                          f'weights it has.', UserWarning, stacklevel=4)
            return
    assert trainer.model is not None  # (the module was attached before its loaders)
    trainer.accelerator.load_model_weights(trainer.model, path)
