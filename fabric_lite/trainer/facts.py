"""What callbacks and modules read from a Trainer: where this process is (ranks, devices), its loggers and log
directory, its checkpoint callback, the logged metrics. A base class of `Trainer`, over its accelerator, strategy and callbacks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from fabric_lite.callbacks.base import Callback, is_logger

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator

__all__ = ["TrainerFacts"]


class TrainerFacts:
    """The read-only facts of a Trainer (Lightning's Trainer properties of the same names)."""

    accelerator: "Accelerator"
    strategy: Any
    callbacks: List[Callback]
    default_root_dir: str
    metric_store: Any
    loaded_epoch: int  # (set by the loops: the epoch the loaders were last asked for)
    train_dataloader_source: Tuple[Any, str]  # (set by data_connector: the user's training loader, its origin)

    @property
    def callback_metrics(self) -> Dict[str, torch.Tensor]:
        """Every logged value for callbacks (early stopping, checkpoints): the latest training step values
        (`name` and `name_step`) and epoch results (`name` and `name_epoch`), as device tensors."""
        self.metric_store.refresh()
        return self.metric_store.callback_metrics

    @property
    def logged_metrics(self) -> Dict[str, torch.Tensor]:
        """The latest value of each name sent to the loggers (`logger=True`), as tensors."""
        self.metric_store.refresh()
        return self.metric_store.logged_metrics

    @property
    def progress_bar_metrics(self) -> Dict[str, float]:
        """The latest `prog_bar=True` values, as floats."""
        self.metric_store.refresh()
        return self.metric_store.progress_bar_metrics

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def world_size(self) -> int:
        """Processes in the job (Lightning's `world_size`)."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 on the main process)."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.process.local_rank

    @property
    def node_rank(self) -> int:
        """The rank of this process's node."""
        return self.strategy.process.node_rank

    @property
    def num_nodes(self) -> int:
        return self.strategy.process.num_nodes

    @property
    def num_devices(self) -> int:
        """Devices this node trains on: one per process, or under SPMD (one process driving every device) the
        devices of its mesh."""
        devices = self.strategy.runtime.driven_devices
        if devices is not None:
            return max(1, devices // self.num_nodes)
        return self.strategy.process.local_world_size

    @property
    def loggers(self) -> List[Callback]:
        """The logger callbacks (from `logger=` and `callbacks=`), in the order they run."""
        return [c for c in self.callbacks if is_logger(c)]

    @property
    def logger(self) -> Optional[Callback]:
        """The first logger callback, or None."""
        return next((c for c in self.callbacks if is_logger(c)), None)

    @property
    def log_dir(self) -> str:
        """The first logger's directory (its save_dir until it has chosen its version), else default_root_dir."""
        logger = self.logger
        found = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        return os.fspath(found) if found is not None else self.default_root_dir

    @property
    def checkpoint_callback(self) -> Optional[Callback]:
        from fabric_lite.callbacks.checkpoint import ModelCheckpoint

        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)
