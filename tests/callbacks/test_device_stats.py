"""DeviceStatsMonitor on a CPU: psutil's statistics under Lightning's keys, at the start and end of the batches
whose step metrics are logged, through the Trainer's loggers; cpu_stats=False and filter_keys; clear refusals."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, DeviceStatsMonitor

pytest.importorskip("psutil")

CPU_KEYS = ("cpu_vm_percent", "cpu_percent", "cpu_swap_percent")


class Tiny(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Collect(Callback):
    """A logger (it implements on_log) that keeps what it is sent."""

    def __init__(self):
        self.rows = []

    def on_log(self, trainer, metrics, step):
        self.rows.append((step, dict(metrics)))


def fit(callbacks, logger, **kwargs):
    x = torch.randn(24, 2)
    t = Trainer(callbacks=callbacks, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_epochs=1, **kwargs)
    t.fit(Tiny(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4))  # 6 batches
    return t


def stats_rows(logger):
    return [(step, m) for step, m in logger.rows if any(k.startswith("DeviceStatsMonitor.") for k in m)]


def test_cpu_statistics_at_the_logged_batches_under_lightnings_keys():
    logger = Collect()
    fit([DeviceStatsMonitor()], [logger], log_every_n_steps=2)
    rows = stats_rows(logger)
    # batches that make steps 2, 4 and 6 (global_step 1, 3, 5 when they start): start and end of each
    assert [step for step, _ in rows] == [1, 1, 3, 3, 5, 5]
    for i, (_, metrics) in enumerate(rows):
        hook = "on_train_batch_start" if i % 2 == 0 else "on_train_batch_end"
        assert sorted(metrics) == sorted(f"DeviceStatsMonitor.{hook}/{k}" for k in CPU_KEYS)
        assert all(0.0 <= v <= 100.0 for v in metrics.values())


def test_cpu_stats_false_logs_nothing_on_a_cpu_and_filter_keys_keeps_the_named():
    logger = Collect()
    fit([DeviceStatsMonitor(cpu_stats=False)], [logger], log_every_n_steps=1)
    assert stats_rows(logger) == []
    logger = Collect()
    fit([DeviceStatsMonitor(filter_keys={"cpu_percent"})], [logger], log_every_n_steps=3)
    assert [sorted(m) for _, m in stats_rows(logger)] == [["DeviceStatsMonitor.on_train_batch_start/cpu_percent"],
                                                          ["DeviceStatsMonitor.on_train_batch_end/cpu_percent"]] * 2


def test_unknown_filter_keys_warn():
    with pytest.warns(UserWarning, match=r"\['allocated_bytes.all.peak'\] are not statistics of cpu"):
        fit([DeviceStatsMonitor(filter_keys={"allocated_bytes.all.peak", "cpu_percent"})], [Collect()])


def test_refused_without_a_logger_or_without_psutil(monkeypatch):
    with pytest.raises(ValueError, match="has none"):
        fit([DeviceStatsMonitor()], False)
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(ModuleNotFoundError, match="pip install psutil"):
        fit([DeviceStatsMonitor()], [Collect()])
    with pytest.raises(ValueError, match="cpu_stats='yes'"):
        DeviceStatsMonitor(cpu_stats="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_statistics_are_torchs_keys():
    from fabric_lite.callbacks.device_stats import device_stats

    stats = device_stats(torch.device("cuda", 0))
    assert "allocated_bytes.all.current" in stats and "reserved_bytes.all.peak" in stats
