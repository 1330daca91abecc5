"""ModelCheckpoint: save full checkpoints by epoch/step, keep the best k by a monitored metric, and `last`."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

import torch

from fabric_lite.callbacks.base import Callback
from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint.files import copy_checkpoint
from fabric_lite.checkpoint.saver import IF_BUSY

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ModelCheckpoint", "CONTINUOUS"]

#: `every_n_train_steps` of a ModelCheckpoint that starts the next background save as soon as the last is published.
CONTINUOUS = "continuous"


class ModelCheckpoint(Callback):
    """Save checkpoints (directories, any fsspec URL) at epoch ends or every N steps.

    `filename` is a template over `epoch`, `step` and logged metrics, e.g. ``"{epoch}-{val/acc:.3f}"``
    (a `/` in a metric name becomes `_` in the file name). With `monitor`, the best `save_top_k` stay.
    Saves are written in the background where the strategy allows it (`async_save=None`; True asks for it and
    warns where it cannot be, False never): training waits only for a copy of the state. One save is in flight
    at a time (`if_busy` says what a save due meanwhile does); checkpoints it displaces are deleted only once
    the new one is published, and `fit` returns once the last one is. During `fit`, `best_model_path` may name
    a checkpoint that is still being written.

    ``every_n_train_steps="continuous"`` saves as often as the writes allow: after each training batch where no
    save is in flight on any process (the previous one published), the next background save starts, so a
    preemption loses little more than one write's time of training. It keeps the newest `save_top_k` checkpoints,
    at least two (a smaller `save_top_k` is raised to 2): the one being written never replaces the last whole
    one before it is itself whole. It needs background saves (`async_save` not False, and a strategy whose
    checkpoints can be copied to the host) and no `monitor` (the newest are kept, not the best).
    """

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None, monitor: Optional[str] = None,
                 mode: str = "min", save_top_k: int = 1, save_last: Optional[bool] = None,
                 every_n_train_steps: Union[int, str, None] = None, every_n_epochs: Optional[int] = None,
                 async_save: Optional[bool] = None, if_busy: str = "wait") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): allowed values are 'min' and 'max'.")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}) must be -1 (keep all), 0 or more.")
        if if_busy not in IF_BUSY:
            raise ValueError(f"ModelCheckpoint(if_busy={if_busy!r}): allowed values are "
                             f"{', '.join(map(repr, IF_BUSY))}.")
        #: Save after every batch where the previous save is published (``every_n_train_steps="continuous"``).
        self.continuous = every_n_train_steps == CONTINUOUS
        if isinstance(every_n_train_steps, str) and not self.continuous:
            raise ValueError(f"ModelCheckpoint(every_n_train_steps={every_n_train_steps!r}): a number of steps or "
                             f"{CONTINUOUS!r}.")
        if self.continuous:
            if monitor is not None:
                raise ValueError(f"ModelCheckpoint(every_n_train_steps={CONTINUOUS!r}) keeps the newest checkpoints, "
                                 f"not the best by a metric: leave monitor={monitor!r} out (or save every N steps).")
            if async_save is False:
                raise ValueError(f"ModelCheckpoint(every_n_train_steps={CONTINUOUS!r}) saves in the background: "
                                 f"async_save=False would block training at every step.")
            if save_top_k != -1:
                save_top_k = max(save_top_k, 2)  # the one being written, and the last whole one
        steps: Optional[int] = None if isinstance(every_n_train_steps, str) else every_n_train_steps
        #: Write in the background: training waits only for a copy of the state (`Accelerator.save_state`).
        #: None: wherever the strategy's checkpoints allow it (state dicts), else on the training thread.
        self.async_save = async_save
        #: A save due while the previous one is still being written waits for it ("wait") or is skipped ("skip").
        self.if_busy = if_busy
        self.dirpath = dirpath
        self.filename = filename or "{epoch}-{step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (0 if steps or self.continuous else 1)
        self.best_k_models: Dict[str, float] = {}
        self.best_model_path = ""
        self.last_model_path = ""
        self._pending: Optional[Tuple[Dict[str, float], str, str]] = None

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[{self.monitor}]"

    def state_dict(self) -> Dict[str, Any]:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "last_model_path": self.last_model_path, "dirpath": self.dirpath}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("dirpath") != self.dirpath:
            return  # a run resumed into another directory must not prune the old run's checkpoints
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.best_model_path = state.get("best_model_path", "")
        self.last_model_path = state.get("last_model_path", "")

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = f"{trainer.default_root_dir.rstrip('/')}/checkpoints"
        if self.continuous and stage == "fit":
            reason = trainer.accelerator.checkpoint_saver.why_blocking()
            if reason is not None:
                raise ValueError(f"ModelCheckpoint(every_n_train_steps={CONTINUOUS!r}) needs background saves, but "
                                 f"{reason}: every step would wait for a whole write. Save every N steps instead.")

    # -- when to save ------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.continuous:
            # every process asks together (a collective), so all start the next save at the same batch
            if trainer.global_step > 0 and trainer.global_step != getattr(self, "_last_step", -1) \
                    and not trainer.accelerator.checkpoint_saver.busy_anywhere():
                self._last_step = trainer.global_step
                self._save(trainer)
            return
        n = self.every_n_train_steps
        if n and trainer.global_step > 0 and trainer.global_step % n == 0 and trainer.global_step != getattr(self, "_last_step", -1):
            self._last_step = trainer.global_step
            self._save(trainer)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    # -- saving ------------------------------------------------------------------------------------
    def _format(self, trainer: "Trainer") -> str:
        values: Dict[str, float] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({k: float(v) for k, v in trainer.callback_metrics.items()})

        def fill(match: "re.Match[str]") -> str:
            key, spec = match.group(1), match.group(2) or ""
            if key not in values:
                raise KeyError(f"ModelCheckpoint filename uses {{{key}}}, which was never logged; logged: {sorted(values)}.")
            return f"{key.replace('/', '_')}={format(values[key], spec.lstrip(':'))}"

        return re.sub(r"\{([^}:]+)(:[^}]*)?\}", fill, self.filename)

    def _current(self, trainer: "Trainer") -> Optional[float]:
        if self.monitor is None:
            return None
        if self.monitor not in trainer.callback_metrics:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such logged metric. Logged: "
                f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, ...), or fix the name."
            )
        return float(trainer.callback_metrics[self.monitor])

    def _decide(self, trainer: "Trainer") -> Tuple[Optional[float], str]:
        """The monitored value and the file name, from rank 0 for every rank: saving is collective, so
        every process must make the same decision and write into the same checkpoint."""
        if trainer.world_size == 1:
            return self._current(trainer), self._format(trainer)
        result: Any = None
        if trainer.is_global_zero:
            try:
                result = ("ok", (self._current(trainer), self._format(trainer)))
            except KeyError as err:
                result = ("error", err.args[0])
        result = trainer.strategy.collectives.broadcast_object(result)
        if result[0] == "error":
            raise KeyError(result[1])
        return result[1]

    @property
    def best_model_score(self) -> Optional[torch.Tensor]:
        """The monitored value of `best_model_path` (Lightning's), or None: before a save, or without `monitor`."""
        if self.monitor is None or self.best_model_path not in self.best_k_models:
            return None
        return torch.tensor(self.best_k_models[self.best_model_path])

    def _save(self, trainer: "Trainer") -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        self._settle(trainer)
        current, filename = self._decide(trainer)
        assert self.dirpath is not None  # (setup placed it)
        base = self.dirpath.rstrip("/")
        # The checkpoint carries this callback's state as it will be once the save is done (itself in, the ones
        # it displaces out, `last` pointing at it), so a run resumed from it prunes exactly what it should.
        before = (dict(self.best_k_models), self.best_model_path, self.last_model_path)
        after: list = []
        path = None
        if self.save_top_k != 0 and (self.monitor is None or self.save_top_k == -1 or self._is_top_k(current)):
            path = f"{base}/{filename}"
            self.best_k_models[path] = current if current is not None else float(trainer.global_step)
            displaced = self._displaced(keep=path)

            def delete_displaced() -> None:
                """deleting the checkpoints it displaced"""
                self._delete(displaced)

            after.append(delete_displaced)  # only once the new one is whole
            if self.save_last:
                def copy_to_last(source: str = path) -> None:
                    """copying it to `last`"""
                    copy_checkpoint(source, f"{base}/last")

                after.append(copy_to_last)  # `last` is a copy of this one, made after it is published
        elif self.save_last:
            path = f"{base}/last"
        if path is None:
            return
        if self.save_last:
            self.last_model_path = f"{base}/last"
        try:
            saved = trainer.save_checkpoint(path, blocking=self._blocking(trainer), if_busy=self.if_busy,
                                            after_commit=after)
        except BaseException:
            self.best_k_models, self.best_model_path, self.last_model_path = before
            raise
        if saved is None:  # skipped: the previous save was still being written
            self.best_k_models, self.best_model_path, self.last_model_path = before
        elif not self._blocking(trainer):
            self._pending = before  # what to go back to if this background save fails

    def _settle(self, trainer: "Trainer") -> None:
        """Before the next save: wait for this callback's background save (every process waits, so no collective
        is needed) and, if it failed, put the bookkeeping back as it was before it, then raise its error. With
        ``if_busy="skip"`` the save in flight is left alone (a failure then surfaces through the per-step check)."""
        pending, self._pending = self._pending, None
        if pending is None or self.if_busy == "skip":
            return
        try:
            trainer.accelerator.wait_for_checkpoint()
        except BaseException:
            self.best_k_models, self.best_model_path, self.last_model_path = pending
            raise

    def _blocking(self, trainer: "Trainer") -> bool:
        if self.continuous:
            return False
        if self.async_save is None:
            return trainer.accelerator.checkpoint_saver.why_blocking() is not None
        return not self.async_save

    def _is_top_k(self, current: Optional[float]) -> bool:
        if current is None or math.isnan(current):
            return False
        if len(self.best_k_models) < self.save_top_k:
            return True
        worst = self._worst()[1]
        return current < worst if self.mode == "min" else current > worst

    @property
    def _mode(self) -> str:
        return self.mode if self.monitor is not None else "max"  # no monitor: the score is the step, newest wins

    def _worst(self) -> Tuple[str, float]:
        items = sorted(self.best_k_models.items(), key=lambda kv: kv[1], reverse=(self._mode == "min"))
        return items[0]

    def _displaced(self, keep: str) -> list:
        """Drop the entries beyond the best `save_top_k` (never `keep`); returns their paths."""
        displaced = []
        while self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            items = sorted(self.best_k_models.items(), key=lambda kv: kv[1], reverse=(self._mode == "min"))
            path = next(p for p, _ in items if p != keep)
            del self.best_k_models[path]
            displaced.append(path)
        if self.best_k_models:
            best = sorted(self.best_k_models.items(), key=lambda kv: kv[1], reverse=(self._mode == "max"))[0]
            self.best_model_path = best[0]
        return displaced

    @staticmethod
    def _delete(paths: list) -> None:
        """Main process, after the save that displaced them is published."""
        for path in paths:
            fs, p = checkpoint_io.filesystem(path)
            if fs.exists(p):
                fs.rm(p, recursive=True)
