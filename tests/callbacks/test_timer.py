"""Timer: Lightning's duration formats, a stop after the batch or epoch that uses up the time (on a clock the
test moves: one second per training batch), stage times, and a resumed run that counts the time before it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fabric_lite.callbacks.timer as timer_module
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import ModelCheckpoint, Timer


class Clock:
    """Stands in for the `time` module inside timer.py: it moves only when a step moves it."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(timer_module, "time", c)
    return c


class Ticking(TrainModule):
    """Each training batch takes one second, each validation batch a quarter, on `clock`."""

    def __init__(self, clock):
        super().__init__()
        torch.manual_seed(0)
        self.clock = clock
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        self.clock.now += 1.0
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.clock.now += 0.25

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n=16):
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 4 batches


def trainer(callbacks, tmp_path, checkpointing=False, **kwargs):
    return Trainer(callbacks=callbacks, default_root_dir=tmp_path, enable_checkpointing=checkpointing,
                   enable_progress_bar=False, enable_model_summary=False, logger=False, **kwargs)


def test_duration_formats():
    assert Timer("00:12:00:00").duration == 12 * 3600
    assert Timer("01:00:00:30").duration == 86400 + 30
    assert Timer(timedelta(weeks=1)).duration == 7 * 86400
    assert Timer(dict(weeks=4, days=2)).duration == 30 * 86400
    assert Timer().duration is None and Timer().time_remaining() is None
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer("12:00")
    with pytest.raises(ValueError, match="timedelta's arguments"):
        Timer(dict(fortnights=1))
    with pytest.raises(ValueError, match="interval='batch'.*'step'.*'epoch'"):
        Timer("00:00:01:00", interval="batch")
    with pytest.raises(ValueError, match="unknown stage 'training'"):
        Timer().time_elapsed("training")


def test_stops_after_the_batch_that_uses_up_the_time(tmp_path, clock, capsys):
    timer = Timer("00:00:00:05")
    t = trainer([timer], tmp_path, max_epochs=10)
    t.fit(Ticking(clock), loader())
    assert t.global_step == 5  # batches 1..5 take seconds 1..5
    assert timer.time_elapsed("train") == 5.0 and timer.time_remaining() == 0.0
    assert timer.start_time("train") == 100.0 and timer.end_time("train") == 105.0
    assert "Timer: time limit reached (0:00:05 of training)" in capsys.readouterr().err


def test_interval_epoch_stops_at_the_end_of_the_epoch(tmp_path, clock):
    timer = Timer(timedelta(seconds=5), interval="epoch", verbose=False)
    t = trainer([timer], tmp_path, max_epochs=10)
    t.fit(Ticking(clock), loader())
    assert t.global_step == 8 and t.current_epoch == 2  # epoch 0 ends at 4 s, epoch 1 at 8 s: two epochs ran
    assert timer.time_elapsed() == 8.0


def test_validation_time_is_measured_apart(tmp_path, clock):
    timer = Timer(verbose=False)
    t = trainer([timer], tmp_path, max_epochs=1, num_sanity_val_steps=1)
    t.fit(Ticking(clock), loader(), loader(8))
    assert timer.time_elapsed("sanity_check") == 0.25
    assert timer.time_elapsed("validate") == 0.5  # 2 validation batches
    assert timer.time_elapsed("train") == 4.0 + 0.5  # training time holds its validation, as in Lightning
    assert timer.time_elapsed("test") == 0.0 and timer.start_time("test") is None


def test_a_resumed_run_counts_the_time_before_it(tmp_path, clock):
    first = Timer("00:00:00:10", verbose=False)
    t = trainer([first, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))], tmp_path, checkpointing=True,
                max_epochs=1)
    t.fit(Ticking(clock), loader())
    assert first.time_elapsed() == 4.0
    saved = t.checkpoint_callback.best_model_path

    second = Timer("00:00:00:10", verbose=False)
    t2 = trainer([second], tmp_path, max_epochs=10)
    t2.fit(Ticking(clock), loader(), ckpt_path=saved)
    assert t2.global_step == 10  # 4 s before the resume, then 6 batches
    assert second.time_elapsed() == 10.0


def test_a_resumed_run_whose_time_is_used_up_trains_nothing(tmp_path, clock):
    t = trainer([Timer("00:00:00:04", verbose=False), ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))], tmp_path,
                checkpointing=True, max_epochs=1)
    t.fit(Ticking(clock), loader())
    module = Ticking(clock)
    t2 = trainer([Timer("00:00:00:04", verbose=False)], tmp_path, max_epochs=5)
    t2.fit(module, loader(), ckpt_path=t.checkpoint_callback.best_model_path)
    assert t2.global_step == 4  # the checkpoint's
