"""ThroughputMonitor: batches/s and samples/s (and FLOPs/s and MFU where they can be known) to the loggers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, Optional

from fabric_lite._tree import batch_size_of
from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ThroughputMonitor"]

# Dense bf16/fp16 tensor-core peak FLOP/s per device, by a substring of torch.cuda.get_device_name().
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def device_peak_flops(device: Any) -> Optional[float]:
    """The device's peak FLOP/s where it is known (NVIDIA data-centre GPUs), else None (CPUs)."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_FLOPS.items() if key in name), None)


class ThroughputMonitor(Callback):
    """Every `log_every_n_steps` optimizer steps, log throughput over the window since the last report.

    `flops_per_batch` (e.g. measured once with `torch.utils.flop_counter.FlopCounterMode`, forward
    and backward) adds `throughput/flops_per_sec` and, on a device whose peak is known, `throughput/mfu`.
    Samples are counted from each batch's first tensor; times are wall-clock on rank 0's side.
    """

    def __init__(self, flops_per_batch: Optional[float] = None) -> None:
        self.flops_per_batch = flops_per_batch
        self._start: Optional[float] = None
        self._batches = 0
        self._samples = 0
        self._reported_step = 0  # report after optimizer steps, not before the first

    def on_train_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._start, self._batches, self._samples = time.perf_counter(), 0, 0

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        self._samples += batch_size_of(batch) or 0
        step = trainer.global_step
        # (with accumulation, several batches end on one optimizer step: report once per step)
        if self._start is None or step % trainer.log_every_n_steps or step == self._reported_step:
            return
        self._reported_step = step
        elapsed = time.perf_counter() - self._start
        if elapsed <= 0:
            return
        # different batches run on the data-parallel replicas; every device of the world counts for the peak
        world, replicas = trainer.world_size, trainer.strategy.dp_size
        metrics: Dict[str, float] = {
            "throughput/batches_per_sec": self._batches * replicas / elapsed,
            "throughput/samples_per_sec": self._samples * replicas / elapsed,
        }
        if self.flops_per_batch is not None:
            flops = self.flops_per_batch * self._batches * replicas / elapsed
            metrics["throughput/flops_per_sec"] = flops
            peak = device_peak_flops(trainer.device)
            if peak is not None:
                metrics["throughput/mfu"] = flops / (peak * world)
        trainer.log_metrics(metrics)
        self._start, self._batches, self._samples = time.perf_counter(), 0, 0
