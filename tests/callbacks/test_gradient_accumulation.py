"""GradientAccumulationScheduler: each epoch's window length follows the schedule, and the weights equal a
plain loop that accumulates that many batches (a short last window averaged over its real length)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, GradientAccumulationScheduler


def dataset(n=28):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g))


class Regressor(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(callbacks, **kwargs):
    return Trainer(callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, logger=False, **kwargs)


def plain_loop(factors):
    """What the schedule means, written by hand: per epoch, windows of `k` batches, each loss / window length."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = list(DataLoader(dataset(), batch_size=4))
    for k in factors:
        for start in range(0, len(batches), k):
            window = batches[start:start + k]
            for x, y in window:
                (F.mse_loss(net(x), y) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    return net


class Windows(Callback):
    """Notes the Trainer's accumulation factor each epoch."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_start(self, trainer, module):
        self.seen.append(trainer.accumulate_grad_batches)


def test_epochs_accumulate_as_scheduled_and_equal_a_plain_loop():
    module, windows = Regressor(), Windows()
    t = trainer([GradientAccumulationScheduler({0: 2, 1: 3, 3: 1}), windows], max_epochs=4)
    t.fit(module, DataLoader(dataset(), batch_size=4))
    # 7 batches an epoch: windows of 2 (4 steps, the last of 1 batch), of 3 (3 steps), then 1 and 1 (7 steps each)
    assert windows.seen == [2, 3, 3, 1]
    assert t.global_step == 4 + 3 + 3 + 7
    expected = plain_loop([2, 3, 3, 1])
    torch.testing.assert_close(module.net.weight, expected.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(module.net.bias, expected.bias, rtol=1e-6, atol=1e-7)
    assert t.accumulate_grad_batches == 1  # the Trainer's own value again after fit


def test_epochs_before_the_first_key_do_not_accumulate():
    sched = GradientAccumulationScheduler({2: 4})
    assert [sched.get_accumulate_grad_batches(e) for e in range(4)] == [1, 1, 4, 4]
    assert sched.going_to_accumulate_grad_batches()
    assert not GradientAccumulationScheduler({0: 1}).going_to_accumulate_grad_batches()


def test_bad_schedules_are_refused_with_the_value():
    with pytest.raises(TypeError, match="non-empty dict"):
        GradientAccumulationScheduler({})
    with pytest.raises(ValueError, match=r"epochs \[-1\] must be integers >= 0"):
        GradientAccumulationScheduler({-1: 2})
    with pytest.raises(ValueError, match=r"factors \[0\] must be integers >= 1"):
        GradientAccumulationScheduler({0: 0})
    with pytest.raises(ValueError, match=r"factors \[2.5\]"):
        GradientAccumulationScheduler({0: 2.5})


def test_refused_with_a_trainer_that_accumulates_itself():
    t = trainer([GradientAccumulationScheduler({0: 2})], max_epochs=1, accumulate_grad_batches=4)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4\) and a GradientAccumulationScheduler"):
        t.fit(Regressor(), DataLoader(dataset(), batch_size=4))


def test_refused_with_manual_optimization():
    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self.net(x), y))
            opt.step()
            opt.zero_grad()

    with pytest.raises(RuntimeError, match="automatic_optimization=False"):
        trainer([GradientAccumulationScheduler({0: 2})], max_epochs=1).fit(
            Manual(), DataLoader(dataset(), batch_size=4))


def test_trainer_accumulate_grad_batches_is_the_engines_window():
    t = trainer([], max_epochs=1, accumulate_grad_batches=3)
    assert t.accumulate_grad_batches == 3 == t.accelerator.gradient_accumulation_steps
    t.accumulate_grad_batches = 5
    assert t.accelerator.gradient_accumulation_steps == 5
    with pytest.raises(ValueError, match=r"trainer.accumulate_grad_batches=0 must be an integer >= 1"):
        t.accumulate_grad_batches = 0


def test_a_run_resumed_mid_epoch_keeps_the_epochs_windows(tmp_path):
    from fabric_lite.callbacks import ModelCheckpoint

    whole = Regressor()
    trainer([GradientAccumulationScheduler({0: 2, 1: 3})], max_epochs=3).fit(whole, DataLoader(dataset(), batch_size=4))

    first = Trainer(callbacks=[GradientAccumulationScheduler({0: 2, 1: 3}),
                               ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=5, save_top_k=-1)],
                    enable_progress_bar=False, enable_model_summary=False, logger=False, max_epochs=2)
    first.fit(Regressor(), DataLoader(dataset(), batch_size=4))
    resumed = Regressor()
    t = trainer([GradientAccumulationScheduler({0: 2, 1: 3})], max_epochs=3)
    # step 5: the first window of epoch 1 (batches 0-2), the epoch's 3-batch windows go on from batch 3
    t.fit(resumed, DataLoader(dataset(), batch_size=4), ckpt_path=f"{tmp_path}/epoch=1-step=5")
    assert t.global_step == 4 + 3 + 3
    assert torch.equal(resumed.net.weight, whole.net.weight) and torch.equal(resumed.net.bias, whole.net.bias)
