"""OnExceptionCheckpoint: a full checkpoint when fit() fails, to resume from with `fit(ckpt_path=...)`."""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Optional

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["OnExceptionCheckpoint"]


class OnExceptionCheckpoint(Callback):
    """Save a checkpoint at ``dirpath/filename.ckpt`` when an exception (a KeyboardInterrupt too) ends fit().

    The save is the Trainer's (`trainer.save_checkpoint`: written whole or not at all), taken where training
    stopped, so ``trainer.fit(module, ..., ckpt_path=callback.ckpt_path)`` goes on from there. A fit that ends
    normally removes an older one. Saving is collective: under several processes every process must reach the
    exception (as with a signal or a failure in a collective), or the save waits for the others.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("OnExceptionCheckpoint(filename='') needs a name for the checkpoint, e.g. "
                             "filename='on_exception' (written as dirpath/on_exception.ckpt).")
        # set now, not in setup: the exception may come before any hook ran
        self.dirpath = os.fspath(dirpath)
        self.filename = filename
        self._saved: Optional[str] = None

    @property
    def ckpt_path(self) -> str:
        """Where the checkpoint is written (a checkpoint directory)."""
        return f"{self.dirpath.rstrip('/')}/{self.filename}{self.FILE_EXTENSION}"

    def on_exception(self, trainer: "Trainer", module: "TrainModule", exception: BaseException) -> None:
        try:
            self._saved = trainer.save_checkpoint(self.ckpt_path)
        except Exception as err:  # the run's own exception is the one to see; say why there is no checkpoint
            warnings.warn(f"OnExceptionCheckpoint could not save {self.ckpt_path} after {type(exception).__name__}: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)
            return
        if trainer.is_global_zero:
            print(f"OnExceptionCheckpoint: saved {self.ckpt_path} after {type(exception).__name__} (epoch "
                  f"{trainer.current_epoch}, step {trainer.global_step}); resume with "
                  f"fit(..., ckpt_path={self.ckpt_path!r}).", file=sys.stderr, flush=True)

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        if self._saved is not None:  # this fit failed: keep what it saved
            self._saved = None
            return
        if trainer.is_global_zero:  # a fit that ended well: an older checkpoint of a failure is stale
            from fabric_lite.checkpoint import files as checkpoint_io

            fs, path = checkpoint_io.filesystem(self.ckpt_path)
            if fs.exists(path):
                fs.rm(path, recursive=True)
