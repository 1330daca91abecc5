"""DeviceStatsMonitor: the device's memory statistics (CUDA) or the machine's CPU use (psutil), sent to the
Trainer's loggers around training batches."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional, Set

import torch

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["DeviceStatsMonitor", "cpu_stats", "device_stats"]


def cpu_stats() -> Dict[str, float]:
    """The machine's CPU and memory use in percent (Lightning's keys), from psutil."""
    try:
        import psutil
    except ImportError:
        raise ModuleNotFoundError("CPU statistics need psutil: pip install psutil (or pass "
                                  "DeviceStatsMonitor(cpu_stats=False) to leave them out).") from None
    return {"cpu_vm_percent": psutil.virtual_memory().percent, "cpu_percent": psutil.cpu_percent(),
            "cpu_swap_percent": psutil.swap_memory().percent}


def device_stats(device: torch.device) -> Dict[str, float]:
    """What the device reports: CUDA's caching-allocator statistics (torch.cuda.memory_stats keys, bytes and
    counts); CPU statistics on a CPU; nothing for other devices."""
    if device.type == "cuda":
        return {k: float(v) for k, v in torch.cuda.memory_stats(device).items()}
    if device.type == "cpu":
        return cpu_stats()
    return {}


class DeviceStatsMonitor(Callback):
    """Log device statistics at the start and end of training batches, when step metrics are logged (every
    `log_every_n_steps`), under ``DeviceStatsMonitor.on_train_batch_start/<stat>`` and ``..._end/<stat>``.

    `cpu_stats`: None logs CPU statistics only when training on a CPU, True also beside a GPU's, False never.
    `filter_keys`: the statistic names to keep (all by default). Needs a logger and, for CPU statistics, psutil.
    """

    def __init__(self, cpu_stats: Optional[bool] = None, filter_keys: Optional[Set[str]] = None) -> None:
        if cpu_stats not in (None, True, False):
            raise ValueError(f"DeviceStatsMonitor(cpu_stats={cpu_stats!r}): allowed values are None (CPU statistics "
                             f"when training on a CPU), True (always) and False (never).")
        self.cpu_stats = cpu_stats
        self.filter_keys = set(filter_keys) if filter_keys is not None else None
        self._due = False
        self._step = 0

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise ValueError("DeviceStatsMonitor logs through the Trainer's loggers, and this Trainer has none "
                             "(logger=False). Pass a logger, e.g. Trainer(logger=CSVLogger('logs')), or drop the "
                             "callback.")
        device = trainer.device
        if (self.cpu_stats is None and device.type == "cpu") or self.cpu_stats:
            cpu_stats()  # psutil missing: say so now, not at the first batch
        if self.filter_keys is not None:
            unknown = self.filter_keys - set(self._read(trainer))
            if unknown:
                warnings.warn(f"DeviceStatsMonitor(filter_keys=...): {sorted(unknown)} are not statistics of "
                              f"{device}; they are ignored.", UserWarning, stacklevel=2)

    def _read(self, trainer: "Trainer") -> Dict[str, float]:
        device = trainer.device
        if device.type == "cpu":
            stats = cpu_stats() if self.cpu_stats is not False else {}
        else:
            stats = device_stats(device)
            if self.cpu_stats:
                stats.update(cpu_stats())
        if self.filter_keys is not None:
            stats = {k: v for k, v in stats.items() if k in self.filter_keys}
        return stats

    def _log(self, trainer: "Trainer", hook: str) -> None:
        stats = self._read(trainer)
        if not stats:
            return
        prefix = f"{type(self).__qualname__}.{hook}/"
        metrics = {prefix + k: float(v) for k, v in stats.items()}
        for logger in trainer.loggers:  # (straight to the loggers: these are not the module's logged metrics)
            logger.on_log(trainer, metrics, self._step)

    def on_train_batch_start(self, trainer: "Trainer", module: "TrainModule", batch: Any, batch_idx: int) -> None:
        # the batch that will make optimizer step N logs when step metrics of step N are written
        self._due = (trainer.global_step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop
        if self._due:
            self._step = trainer.global_step  # (the batch's end logs under the same step)
            self._log(trainer, "on_train_batch_start")

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._due:
            self._log(trainer, "on_train_batch_end")
