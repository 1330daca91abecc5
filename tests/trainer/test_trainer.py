"""The trainer door on one process: the fit loop's counters and limits, accumulation and clipping
against raw PyTorch, self.log semantics, optimizer/scheduler forms, loggers, checkpoints, resume,
early stopping, evaluation entry points, DataModule, manual optimization and the errors people see.

Every numerical claim is checked against numbers computed here by hand or by a plain PyTorch loop.
"""

from __future__ import annotations

import copy
import csv
import glob
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import DataModule, Trainer, TrainModule, set_seed
from fabric_lite.callbacks import (
    Callback, CSVLogger, EarlyStopping, LearningRateMonitor, ModelCheckpoint, TensorBoardLogger,
)

# -- helpers ---------------------------------------------------------------------------------------

def regression_data(n=40, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    return TensorDataset(x, scale * (x @ w + 0.1 * torch.randn(n, 1, generator=g)))


def classification_data(n=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def loader(ds, batch_size=4, shuffle=False, seed=0):
    gen = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen)


class Regressor(TrainModule):
    """A linear regression; records every training loss (as a float) in order."""

    def __init__(self, lr=0.1, momentum=0.0, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(4, 1)
        self.lr, self.momentum = lr, momentum
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Scripted(Regressor):
    """Logs a scripted validation metric: `values[current_epoch]`."""

    def __init__(self, values, name="val/metric", **kwargs):
        super().__init__(**kwargs)
        self.values, self.name = values, name

    def validation_step(self, batch, batch_idx):
        self.log(self.name, float(self.values[self.current_epoch]))


class Recorder(Callback):
    """Records where the loop is when things happen (sanity-check runs are kept apart)."""

    def __init__(self):
        self.epoch_starts, self.train_batches, self.validations = [], [], []
        self.sanity_batches, self.val_batches, self.logs = 0, 0, []
        self.callback_metrics_at_train_start = None

    def on_train_start(self, trainer, module):
        self.callback_metrics_at_train_start = dict(trainer.callback_metrics)

    def on_train_epoch_start(self, trainer, module):
        self.epoch_starts.append(trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_batches.append((trainer.current_epoch, batch_idx, trainer.global_step))

    def on_validation_epoch_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.validations.append((trainer.current_epoch, trainer.global_step))

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1

    def on_log(self, trainer, metrics, step):
        self.logs.append((step, dict(metrics)))

    def steps_of(self, key):
        return [step for step, metrics in self.logs if key in metrics]

    def values_of(self, key):
        return [metrics[key] for _, metrics in self.logs if key in metrics]


def make_trainer(tmp_path, callbacks=(), **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(default_root_dir=tmp_path, callbacks=list(callbacks), **kwargs)


def weights(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def raw_sgd_loop(net, dl, epochs, lr, momentum=0.0, accumulate=1, clip_norm=None, clip_value=None):
    """The plain PyTorch loop the Trainer must reproduce (the last, shorter window divided by its size)."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    n = len(dl)
    steps = 0
    for _ in range(epochs):
        for i, (x, y) in enumerate(dl):
            start = i - i % accumulate
            size = min(accumulate, n - start)
            (F.mse_loss(net(x), y) / size).backward()
            if i - start == size - 1:
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
                if clip_value is not None:
                    torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
                opt.step()
                opt.zero_grad()
                steps += 1
    return steps


# -- the fit loop: counters, stopping, limits ---------------------------------------------------

def test_fit_trains_and_counts_steps_and_epochs(tmp_path):
    module, rec = Regressor(), Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=3)
    trainer.fit(module, loader(regression_data()), loader(regression_data(seed=5)))
    first, last = module.losses[:10], module.losses[-10:]
    assert sum(last) / 10 < 0.2 * sum(first) / 10, (first, last)
    assert trainer.global_step == 30 and module.global_step == 30
    assert trainer.current_epoch == 3
    assert rec.epoch_starts == [0, 1, 2]
    # global_step after each batch: one optimizer step per batch, never reset per epoch
    assert [g for _, _, g in rec.train_batches] == list(range(1, 31))
    assert [b for _, b, _ in rec.train_batches] == list(range(10)) * 3
    assert rec.validations == [(0, 10), (1, 20), (2, 30)]


def test_max_steps_stops_mid_epoch(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_steps=13)
    trainer.fit(Regressor(), loader(regression_data()))
    assert trainer.global_step == 13
    assert len(rec.train_batches) == 13
    assert rec.epoch_starts == [0, 1]


def test_max_steps_wins_over_max_epochs(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=5, max_epochs=3)
    trainer.fit(Regressor(), loader(regression_data()))
    assert trainer.global_step == 5


def test_max_epochs_beats_max_steps(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=100, max_epochs=2)
    trainer.fit(Regressor(), loader(regression_data()))
    assert trainer.global_step == 20 and trainer.current_epoch == 2


def test_max_steps_at_an_epoch_end_still_validates_that_epoch(tmp_path):
    # Lightning checks validation after the epoch's last batch before it looks at max_steps: a run
    # stopped by max_steps exactly at an epoch end still validates that (complete) epoch.
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_steps=20, num_sanity_val_steps=0)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert trainer.global_step == 20
    assert rec.validations == [(0, 10), (1, 20)]


@pytest.mark.parametrize("limit,per_epoch", [(3, 3), (0.25, 2), (0.5, 5), (1.0, 10)])
def test_limit_train_batches(tmp_path, limit, per_epoch):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=2, limit_train_batches=limit)
    trainer.fit(Regressor(), loader(regression_data()))
    assert trainer.global_step == 2 * per_epoch
    assert [b for _, b, _ in rec.train_batches] == list(range(per_epoch)) * 2


def test_limit_val_batches(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=2, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert rec.val_batches == 4


@pytest.mark.parametrize("fast_dev_run,n", [(True, 1), (3, 3)])
def test_fast_dev_run(tmp_path, fast_dev_run, n):
    rec = Recorder()
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[rec], fast_dev_run=fast_dev_run, max_epochs=50,
                      enable_progress_bar=False)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert trainer.global_step == n
    assert len(rec.train_batches) == n
    assert rec.epoch_starts == [0] and rec.sanity_batches == 0
    assert not os.path.exists(tmp_path / "checkpoints")
    # fast_dev_run exists to run n batches of training *and* validation end to end
    assert rec.val_batches == n, f"{rec.val_batches} validation batches ran, expected {n}"


@pytest.mark.parametrize("interval,expected", [
    (0.25, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]),   # every int(10 * 0.25) = 2 batches
    (0.5, [5, 10, 15, 20]),
    (4, [4, 8, 14, 18]),                              # int: every 4 batches of the epoch
    (5, [5, 10, 15, 20]),                             # int that divides the epoch: its last batch too
])
def test_val_check_interval(tmp_path, interval, expected):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=2, val_check_interval=interval, num_sanity_val_steps=0)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert [step for _, step in rec.validations] == expected
    # every validation is logged at the step where it ran
    assert rec.steps_of("val/loss") == expected


def test_check_val_every_n_epoch(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=5, check_val_every_n_epoch=2, num_sanity_val_steps=0)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert rec.validations == [(1, 20), (3, 40)]


def test_num_sanity_val_steps_runs_batches_before_training_without_logging(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=1, num_sanity_val_steps=2, log_every_n_steps=1)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))   # 10 val batches
    assert rec.sanity_batches == 2
    assert rec.val_batches == 10 and rec.validations == [(0, 10)]
    assert rec.steps_of("val/loss") == [10]    # the sanity check logged nothing
    assert not trainer.sanity_checking

    rec0 = Recorder()
    make_trainer(tmp_path, [rec0], max_epochs=1, num_sanity_val_steps=0).fit(
        Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert rec0.sanity_batches == 0


def test_sanity_check_leaves_no_metrics_behind(tmp_path):
    # Lightning resets the metrics after the sanity check: a monitor (checkpoint, early stopping,
    # plateau scheduler) must never see values from 2 sanity batches as if they were a validation.
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=1, num_sanity_val_steps=2)
    trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert "val/loss" not in rec.callback_metrics_at_train_start, rec.callback_metrics_at_train_start


# -- accumulation and clipping against raw PyTorch --------------------------------------------------

def test_accumulate_grad_batches_matches_raw_loop_with_short_last_window(tmp_path):
    ds = regression_data(n=40)                       # 10 batches of 4: windows 3, 3, 3 and a last one of 1
    module = Regressor(lr=0.05, momentum=0.9)
    raw = copy.deepcopy(module.net)
    trainer = make_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(module, loader(ds))
    steps = raw_sgd_loop(raw, loader(ds), epochs=2, lr=0.05, momentum=0.9, accumulate=3)
    assert trainer.global_step == steps == 8
    torch.testing.assert_close(weights(module.net), weights(raw), atol=1e-6, rtol=0)


@pytest.mark.parametrize("algorithm,clip", [("norm", 0.5), ("value", 0.05)])
def test_gradient_clipping_matches_raw_loop(tmp_path, algorithm, clip):
    ds = regression_data(n=40, scale=10.0)          # large targets: gradients far above the clip
    module = Regressor(lr=0.01)
    raw, unclipped = copy.deepcopy(module.net), copy.deepcopy(module.net)
    trainer = make_trainer(tmp_path, max_epochs=2, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    trainer.fit(module, loader(ds))
    kw = {"clip_norm": clip} if algorithm == "norm" else {"clip_value": clip}
    raw_sgd_loop(raw, loader(ds), epochs=2, lr=0.01, **kw)
    raw_sgd_loop(unclipped, loader(ds), epochs=2, lr=0.01)
    assert (weights(raw) - weights(unclipped)).abs().max() > 1e-2   # the clip really acted
    torch.testing.assert_close(weights(module.net), weights(raw), atol=1e-6, rtol=0)


# -- self.log ----------------------------------------------------------------------------------

class LogDefaults(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("a", loss)                                      # default: per step only
        self.log("b", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("hidden", loss, logger=False)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("v", F.mse_loss(self(x), y))                    # default: per epoch only

    def on_train_epoch_end(self):
        self.log("end", 7.0)                                     # epoch-end hooks: per epoch


def test_log_defaults_and_step_epoch_names(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], max_epochs=2, log_every_n_steps=1, num_sanity_val_steps=0)
    module = LogDefaults()
    trainer.fit(module, loader(regression_data()), loader(regression_data(seed=5)))
    assert rec.steps_of("a") == list(range(1, 21))
    assert rec.steps_of("b_step") == list(range(1, 21))
    assert rec.steps_of("b_epoch") == [10, 20]
    assert rec.steps_of("v") == [10, 20]
    assert rec.steps_of("end") == [10, 20] and rec.values_of("end") == [7.0, 7.0]
    logged_names = {k for _, m in rec.logs for k in m}
    assert not logged_names & {"a_step", "a_epoch", "b", "v_step", "v_epoch", "hidden"}
    # (as Lightning: callback_metrics also holds the plain name "b", last set to the epoch value)
    assert set(trainer.callback_metrics) == {"a", "b", "b_step", "b_epoch", "hidden", "v", "end"}
    assert set(trainer.logged_metrics) == {"a", "b_step", "b_epoch", "v", "end"}
    assert set(trainer.progress_bar_metrics) == {"b_step", "b_epoch"}
    # the step value is the last batch's loss; the epoch value the size-weighted mean of the epoch
    assert trainer.logged_metrics["a"] == pytest.approx(trainer.logged_metrics["b_step"])
    assert float(trainer.callback_metrics["b_epoch"]) == pytest.approx(sum(module.losses[-10:]) / 10)


class Reductions(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        v = float(batch_idx)
        self.log("t_mean", v, on_step=False, on_epoch=True)
        self.log("t_sum", v, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("t_max", v, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("t_min", torch.tensor(v), on_step=False, on_epoch=True, reduce_fx="min")
        self.log("t_mean_bs1", v, on_step=False, on_epoch=True, batch_size=1)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("v_mean", batch[0][:, 0].mean())         # mean of a feature, weighted by batch size


def test_log_reduce_fx_mean_weighted_by_batch_size_sum_max_min(tmp_path):
    train, val = regression_data(n=10), regression_data(n=10, seed=5)   # batches of 4, 4, 2
    trainer = make_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Reductions(), loader(train), loader(val))
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["t_mean"] == pytest.approx((0 * 4 + 1 * 4 + 2 * 2) / 10)
    assert m["t_sum"] == pytest.approx(3.0)
    assert m["t_max"] == 2.0 and m["t_min"] == 0.0
    assert m["t_mean_bs1"] == pytest.approx(1.0)
    assert m["v_mean"] == pytest.approx(float(val.tensors[0][:, 0].mean()), abs=1e-6)


class WithAccuracy(TrainModule):
    def __init__(self):
        super().__init__()
        import torchmetrics

        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def hand_accuracy(net, ds):
    with torch.no_grad():
        x, y = ds.tensors
        return (net(x).argmax(-1) == y).float().mean().item()


class AccuracyWatcher(Callback):
    def __init__(self, val_ds):
        self.val_ds, self.pairs = val_ds, []

    def on_validation_epoch_end(self, trainer, module):
        self.pairs.append((float(trainer.callback_metrics["val/acc"]), hand_accuracy(module.net, self.val_ds)))


def test_logged_torchmetrics_accuracy_is_computed_over_the_whole_set_and_reset(tmp_path):
    train, val = classification_data(n=64, seed=1), classification_data(n=37, seed=2)   # 37 = 4 x 8 + 5
    watcher = AccuracyWatcher(val)
    module = WithAccuracy()
    trainer = make_trainer(tmp_path, [watcher], max_epochs=3, num_sanity_val_steps=2)
    trainer.fit(module, loader(train, batch_size=8), loader(val, batch_size=8))
    assert len(watcher.pairs) == 3
    for logged, by_hand in watcher.pairs:
        assert logged == pytest.approx(by_hand, abs=1e-6)
    # compute + reset: two validations over different sets each give that set's own accuracy
    first, second = classification_data(n=21, seed=3), classification_data(n=13, seed=4)
    r1 = trainer.validate(module, loader(first, batch_size=8))
    r2 = trainer.validate(module, loader(second, batch_size=8))
    assert r1[0]["val/acc"] == pytest.approx(hand_accuracy(module.net, first), abs=1e-6)
    assert r2[0]["val/acc"] == pytest.approx(hand_accuracy(module.net, second), abs=1e-6)


# -- the errors people see ---------------------------------------------------------------------

class BadLog(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("vector", self(x))            # shape (4, 1)
        return F.mse_loss(self(x), y)


class ReturnsNone(Regressor):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


class ReturnsVector(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y, reduction="none")


class UnknownOptimizerForm(Regressor):
    def configure_optimizers(self):
        return {"optim": torch.optim.SGD(self.parameters(), lr=0.1)}


class StringOptimizer(Regressor):
    def configure_optimizers(self):
        return "sgd"


def test_logging_a_non_scalar_tensor_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"'vector'.*shape \(4, 1\)"):
        make_trainer(tmp_path, max_epochs=1).fit(BadLog(), loader(regression_data()))


def test_training_step_returning_none_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"training_step returned nothing.*automatic_optimization = False"):
        make_trainer(tmp_path, max_epochs=1).fit(ReturnsNone(), loader(regression_data()))


def test_training_step_returning_a_non_scalar_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"training_step returned a tensor of shape \(4, 1\).*scalar"):
        make_trainer(tmp_path, max_epochs=1).fit(ReturnsVector(), loader(regression_data()))


@pytest.mark.parametrize("cls", [UnknownOptimizerForm, StringOptimizer])
def test_configure_optimizers_in_an_unknown_form_lists_the_forms(tmp_path, cls):
    with pytest.raises(ValueError) as err:
        make_trainer(tmp_path, max_epochs=1).fit(cls(), loader(regression_data()))
    msg = str(err.value)
    for form in ("an optimizer", "a list of optimizers", "(optimizers, schedulers)", "'lr_scheduler'"):
        assert form in msg, msg


def test_unknown_trainer_argument_suggests_the_close_name(tmp_path):
    with pytest.raises(TypeError, match=r"'max_epoch' \(did you mean 'max_epochs'\?\)"):
        Trainer(max_epoch=3)
    with pytest.raises(TypeError, match=r"'gradient_clip_value' \(did you mean 'gradient_clip_val'\?\)"):
        Trainer(gradient_clip_value=1.0)


@pytest.mark.parametrize("callback", [
    lambda: ModelCheckpoint(monitor="val/acc"), lambda: EarlyStopping(monitor="val/acc"),
], ids=["ModelCheckpoint", "EarlyStopping"])
def test_monitor_never_logged_lists_the_logged_keys(tmp_path, callback):
    trainer = make_trainer(tmp_path, [callback()], max_epochs=1, enable_checkpointing=True)
    with pytest.raises(KeyError) as err:
        trainer.fit(Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    msg = str(err.value)
    assert "val/acc" in msg and "'train/loss'" in msg and "'val/loss'" in msg, msg


# -- configure_optimizers forms and schedulers ------------------------------------------------------

class LRTrace(Callback):
    def __init__(self):
        self.after_step, self.after_epoch = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after_step.append([g["lr"] for opt in trainer.optimizers for g in opt.param_groups])

    def on_train_epoch_end(self, trainer, module):
        self.after_epoch.append([g["lr"] for opt in trainer.optimizers for g in opt.param_groups])


class WithOptimizers(Regressor):
    def __init__(self, make, **kwargs):
        super().__init__(**kwargs)
        self.make = make

    def configure_optimizers(self):
        return self.make(self)


def sgd(m, lr=0.1):
    return torch.optim.SGD(m.parameters(), lr=lr)


def step_lr(opt, gamma=0.5):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)


def test_configure_optimizers_single_optimizer_equals_raw_loop(tmp_path):
    module = WithOptimizers(lambda m: sgd(m))
    raw = copy.deepcopy(module.net)
    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, loader(regression_data()))
    raw_sgd_loop(raw, loader(regression_data()), epochs=2, lr=0.1)
    assert len(trainer.optimizers) == 1
    torch.testing.assert_close(weights(module.net), weights(raw), atol=1e-6, rtol=0)


class TwoNets(Regressor):
    def __init__(self):
        super().__init__()
        self.other = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x) + self.other(x)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.02)]


def test_configure_optimizers_list_steps_every_optimizer(tmp_path):
    module = TwoNets()
    raw = copy.deepcopy(module)
    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, loader(regression_data()))
    opts = [torch.optim.SGD(raw.net.parameters(), lr=0.1), torch.optim.SGD(raw.other.parameters(), lr=0.02)]
    for _ in range(2):
        for x, y in loader(regression_data()):
            F.mse_loss(raw(x), y).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert len(trainer.optimizers) == 2
    torch.testing.assert_close(weights(module), weights(raw), atol=1e-6, rtol=0)


def test_configure_optimizers_tuple_of_lists_steps_scheduler_each_epoch(tmp_path):
    def make(m):
        opt = sgd(m)
        return [opt], [step_lr(opt)]

    trace = LRTrace()
    make_trainer(tmp_path, [trace], max_epochs=3).fit(WithOptimizers(make), loader(regression_data()))
    assert [lr for (lr,) in trace.after_epoch] == pytest.approx([0.05, 0.025, 0.0125])
    assert trace.after_step[9] == [0.1]     # not stepped per batch


def test_lr_scheduler_dict_interval_step_with_frequency(tmp_path):
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "interval": "step", "frequency": 2}}

    trace = LRTrace()
    make_trainer(tmp_path, [trace], max_steps=7).fit(WithOptimizers(make), loader(regression_data()))
    assert [lr for (lr,) in trace.after_step] == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125])


def test_lr_scheduler_dict_interval_epoch_with_frequency(tmp_path):
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt), "interval": "epoch", "frequency": 2}}

    trace = LRTrace()
    make_trainer(tmp_path, [trace], max_epochs=4).fit(WithOptimizers(make), loader(regression_data()))
    assert [lr for (lr,) in trace.after_epoch] == pytest.approx([0.1, 0.05, 0.05, 0.025])
    assert all(lr == [0.1] for lr in trace.after_step[:19])


def test_lr_scheduler_bare_scheduler_in_dict_steps_per_epoch(tmp_path):
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": step_lr(opt)}

    trace = LRTrace()
    make_trainer(tmp_path, [trace], max_epochs=2).fit(WithOptimizers(make), loader(regression_data()))
    assert [lr for (lr,) in trace.after_epoch] == pytest.approx([0.05, 0.025])


class PlateauModule(Scripted):
    def configure_optimizers(self):
        opt = sgd(self)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/metric"}}


def test_reduce_lr_on_plateau_reads_this_epochs_validation_metric(tmp_path):
    # epoch 0: 1.0 (best) | epoch 1: 2.0 worse -> halve | epoch 2: 3.0 worse -> halve | epoch 3: 0.5 better
    trace = LRTrace()
    trainer = make_trainer(tmp_path, [trace], max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(PlateauModule([1.0, 2.0, 3.0, 0.5]), loader(regression_data()), loader(regression_data(seed=5)))
    lrs_during_epoch = [trace.after_step[i][0] for i in (9, 19, 29, 39)]   # each epoch's last batch
    assert lrs_during_epoch == pytest.approx([0.1, 0.1, 0.05, 0.025])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


def test_reduce_lr_on_plateau_without_monitor_is_a_clear_error(tmp_path):
    class NoMonitor(Regressor):
        def configure_optimizers(self):
            opt = sgd(self)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}

    with pytest.raises(ValueError, match="monitor"):
        make_trainer(tmp_path, max_epochs=1).fit(NoMonitor(), loader(regression_data()))


# -- loggers ---------------------------------------------------------------------------------------

def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_logger_writes_tags_at_log_every_n_steps(tmp_path):
    tb = TensorBoardLogger(tmp_path / "tb", name="exp")
    rec = Recorder()
    module = Regressor()
    trainer = make_trainer(tmp_path, [tb, rec], max_epochs=2, log_every_n_steps=3)
    trainer.fit(module, loader(regression_data()), loader(regression_data(seed=5)))
    assert tb.log_dir == str(tmp_path / "tb" / "exp" / "version_0")
    scalars = _scalars(tb.log_dir)
    assert set(scalars) == {"train/loss", "val/loss"}
    # every 3 optimizer steps, plus the last batch of each epoch
    expected_steps = [3, 6, 9, 10, 12, 15, 18, 20]
    assert [s for s, _ in scalars["train/loss"]] == expected_steps
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([module.losses[s - 1] for s in expected_steps],
                                                                  rel=1e-6)
    assert [s for s, _ in scalars["val/loss"]] == [10, 20]
    assert [v for _, v in scalars["val/loss"]] == pytest.approx(rec.values_of("val/loss"), rel=1e-6)
    # a second run gets the next version
    tb2 = TensorBoardLogger(tmp_path / "tb", name="exp")
    make_trainer(tmp_path, [tb2], max_epochs=1).fit(Regressor(), loader(regression_data()))
    assert tb2.log_dir.endswith("version_1")


def _csv_rows(log_dir):
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_csv_logger_rows_and_learning_rate_monitor(tmp_path):
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": step_lr(opt)}

    logger = CSVLogger(tmp_path / "csv")
    module = WithOptimizers(make)
    trainer = make_trainer(tmp_path, [logger, LearningRateMonitor()], max_epochs=2, log_every_n_steps=4)
    trainer.fit(module, loader(regression_data()), loader(regression_data(seed=5)))
    rows = _csv_rows(logger.log_dir)
    assert list(rows[0]) == ["step", "lr-SGD", "train/loss", "val/loss"]
    loss_rows = [(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]]
    assert [s for s, _ in loss_rows] == [4, 8, 10, 12, 16, 20]
    assert [v for _, v in loss_rows] == pytest.approx([module.losses[s - 1] for s, _ in loss_rows], rel=1e-6)
    assert [int(r["step"]) for r in rows if r["val/loss"]] == [10, 20]
    lr_rows = [(int(r["step"]), float(r["lr-SGD"])) for r in rows if r["lr-SGD"]]
    assert lr_rows == [(0, pytest.approx(0.1)), (10, pytest.approx(0.05))]


def test_learning_rate_monitor_per_step(tmp_path):
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr(opt, 0.9), "interval": "step"}}

    rec = Recorder()
    make_trainer(tmp_path, [rec, LearningRateMonitor("step")], max_steps=6, log_every_n_steps=2).fit(
        WithOptimizers(make), loader(regression_data()))
    assert rec.steps_of("lr-SGD") == [2, 4, 6]
    assert rec.values_of("lr-SGD") == pytest.approx([0.1 * 0.9 ** 2, 0.1 * 0.9 ** 4, 0.1 * 0.9 ** 6])


def test_step_logging_with_accumulation_logs_once_per_optimizer_step(tmp_path):
    # With accumulation the optimizer steps every 2nd batch; a row per *step* (1..5), never one at step 0
    # written before any step, nor the same step twice.
    logger = CSVLogger(tmp_path / "csv")
    trainer = make_trainer(tmp_path, [logger], max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=1)
    trainer.fit(Regressor(), loader(regression_data()))
    steps = [int(r["step"]) for r in _csv_rows(logger.log_dir) if r["train/loss"]]
    assert steps == [1, 2, 3, 4, 5], steps


# -- checkpoints, resume, early stopping -----------------------------------------------------------

def _dirs(path):
    return sorted(os.path.basename(p) for p in glob.glob(str(path / "*")) if os.path.isdir(p))


def _trainer_state(ckpt_dir):
    for state in torch.load(os.path.join(ckpt_dir, "training_state.pt"), weights_only=True)["custom"]:
        if isinstance(state, dict) and "hyper_parameters" in state:
            return state
    raise AssertionError(f"no trainer state in {ckpt_dir}")


def test_model_checkpoint_keeps_the_best_two_and_last(tmp_path):
    values = [5.0, 3.0, 4.0, 1.0, 2.0]       # best two (min): epoch 3 (1.0), epoch 4 (2.0)
    ckpt = ModelCheckpoint(monitor="val/metric", mode="min", save_top_k=2, save_last=True,
                           filename="{epoch}-{val/metric:.1f}")
    trainer = make_trainer(tmp_path, [ckpt], max_epochs=5, enable_checkpointing=True)
    trainer.fit(Scripted(values), loader(regression_data(n=8)), loader(regression_data(n=8, seed=5)))
    root = tmp_path / "checkpoints"
    assert _dirs(root) == ["epoch=3-val_metric=1.0", "epoch=4-val_metric=2.0", "last"]
    assert ckpt.best_model_path == str(root / "epoch=3-val_metric=1.0")
    assert sorted(ckpt.best_k_models.values()) == [1.0, 2.0]
    assert _trainer_state(root / "last")["epoch"] == 4
    assert _trainer_state(root / "epoch=3-val_metric=1.0")["global_step"] == 8


def test_model_checkpoint_mode_max(tmp_path):
    ckpt = ModelCheckpoint(monitor="val/metric", mode="max", save_top_k=1)
    trainer = make_trainer(tmp_path, [ckpt], max_epochs=4, enable_checkpointing=True)
    trainer.fit(Scripted([1.0, 3.0, 2.0, 0.0]), loader(regression_data(n=8)), loader(regression_data(n=8, seed=5)))
    assert _dirs(tmp_path / "checkpoints") == ["epoch=1-step=4"]


def test_model_checkpoint_every_n_train_steps(tmp_path):
    ckpt = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1, save_last=True)
    trainer = make_trainer(tmp_path, [ckpt], max_epochs=2, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(regression_data(n=20)))          # 5 batches per epoch, 10 steps
    assert _dirs(tmp_path / "checkpoints") == ["epoch=0-step=3", "epoch=1-step=6", "epoch=1-step=9", "last"]
    assert _trainer_state(tmp_path / "checkpoints" / "epoch=1-step=6")["global_step"] == 6


def test_model_checkpoint_default_keeps_only_the_latest_epoch(tmp_path):
    # ModelCheckpoint() has save_top_k=1: without a monitor, the newest checkpoint stays (as in Lightning),
    # and `last` is written only when asked.
    trainer = make_trainer(tmp_path, max_epochs=3, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(regression_data(n=8)))
    assert _dirs(tmp_path / "checkpoints") == ["epoch=2-step=6"]
    assert trainer.checkpoint_callback.best_model_path == str(tmp_path / "checkpoints" / "epoch=2-step=6")
    # without a monitor, save_top_k=2 keeps the two newest
    trainer = make_trainer(tmp_path / "two", [ModelCheckpoint(save_top_k=2)], max_epochs=3, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(regression_data(n=8)))
    assert _dirs(tmp_path / "two" / "checkpoints") == ["epoch=1-step=4", "epoch=2-step=6"]


class Dropout(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": step_lr(opt, 0.7)}


def _resume_run(root, max_epochs, ckpt_path=None, rec=None, save_last=None, async_save=False):
    set_seed(0)
    module = Dropout()
    callbacks = [ModelCheckpoint(save_last=save_last, async_save=async_save)] + ([rec] if rec else [])
    trainer = make_trainer(root, callbacks, max_epochs=max_epochs, enable_checkpointing=True)
    trainer.fit(module, loader(regression_data(n=30), batch_size=4, shuffle=True, seed=3),
                loader(regression_data(n=12, seed=5)), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("save_last,async_save", [(True, False), (None, False), (True, True), (None, True)],
                         ids=["last-dir", "newest-checkpoint", "last-dir-async", "newest-checkpoint-async"])
def test_fit_ckpt_path_last_resumes_bit_for_bit(tmp_path, save_last, async_save):
    # shuffled data and dropout: the loader order and every RNG must continue exactly
    first, _ = _resume_run(tmp_path / "a", 2, ckpt_path="last", save_last=save_last,
                           async_save=async_save)   # nothing saved: fresh start
    assert first.global_step == 16 and first.current_epoch == 2
    expected = ["epoch=1-step=16", "last"] if save_last else ["epoch=1-step=16"]
    assert _dirs(tmp_path / "a" / "checkpoints") == expected
    rec = Recorder()
    resumed, resumed_module = _resume_run(tmp_path / "a", 4, ckpt_path="last", rec=rec, save_last=save_last,
                                          async_save=async_save)
    assert rec.epoch_starts == [2, 3]
    assert rec.train_batches[0] == (2, 0, 17)
    _, straight_module = _resume_run(tmp_path / "b", 4)
    assert resumed.global_step == 32 and resumed.current_epoch == 4
    assert torch.equal(weights(resumed_module), weights(straight_module))
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.7 ** 4)


def test_resume_from_a_mid_epoch_step_checkpoint_with_accumulation_is_bit_for_bit(tmp_path):
    # 30 samples in batches of 4: 8 batches, 4 optimizer steps per epoch; step 6 is mid-epoch 1
    straight_trainer, straight = _resume_run_acc(tmp_path / "a", [ModelCheckpoint(every_n_train_steps=3,
                                                                                  save_top_k=-1)])
    assert _dirs(tmp_path / "a" / "checkpoints") == ["epoch=0-step=3", "epoch=1-step=6", "epoch=2-step=12",
                                                     "epoch=2-step=9"]
    rec = Recorder()
    resumed_trainer, resumed = _resume_run_acc(tmp_path / "b", [rec],
                                               ckpt_path=str(tmp_path / "a" / "checkpoints" / "epoch=1-step=6"))
    assert rec.train_batches[0] == (1, 4, 6)        # continues at batch 4 of epoch 1
    assert resumed_trainer.global_step == straight_trainer.global_step == 12
    assert torch.equal(weights(resumed), weights(straight))


class EpochLogged(Dropout):
    """Logs an epoch mean, an epoch max and a torchmetrics metric from training_step."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.train_err = torchmetrics.MeanAbsoluteError()
        self.epoch_values = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        loss = F.mse_loss(pred, y)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        self.log("train/max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.train_err(pred.detach(), y)
        self.log("train/mae", self.train_err, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.epoch_values.append(None)  # filled in by the callback below, after the epoch's reduction


class EpochValues(Callback):
    def __init__(self):
        self.rows = []

    def on_train_epoch_end(self, trainer, module):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def test_mid_epoch_resume_keeps_the_epoch_aggregates_logged_before_the_checkpoint(tmp_path):
    # 30 samples in batches of 4: 8 steps an epoch; the checkpoint at step 11 is in the middle of epoch 1
    def run(root, ckpt_path=None, save=False):
        set_seed(0)
        module, values = EpochLogged(), EpochValues()
        callbacks = [values] + ([ModelCheckpoint(every_n_train_steps=11, save_top_k=-1)] if save else [])
        trainer = make_trainer(root, callbacks, max_epochs=2, enable_checkpointing=save)
        trainer.fit(module, loader(regression_data(n=30), batch_size=4, shuffle=True, seed=3), ckpt_path=ckpt_path)
        return values.rows, module

    straight, straight_module = run(tmp_path / "a", save=True)
    resumed, resumed_module = run(tmp_path / "b", ckpt_path=str(tmp_path / "a" / "checkpoints" / "epoch=1-step=11"))
    assert set(straight[1]) == {"train/loss", "train/max", "train/mae"}
    assert resumed == [straight[1]]  # the whole epoch 1, not just the part after the checkpoint
    assert torch.equal(weights(resumed_module), weights(straight_module))


def _resume_run_acc(root, callbacks, ckpt_path=None):
    set_seed(0)
    module = Dropout()
    trainer = make_trainer(root, callbacks, max_epochs=3, accumulate_grad_batches=2,
                           enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    trainer.fit(module, loader(regression_data(n=30), batch_size=4, shuffle=True, seed=3), ckpt_path=ckpt_path)
    return trainer, module


def test_resuming_into_another_directory_leaves_the_old_checkpoints_alone(tmp_path):
    # The restored ModelCheckpoint state names checkpoints of the *old* run; pruning in the new run must not
    # delete them (Lightning restores best_k_models only when dirpath is unchanged).
    make_trainer(tmp_path / "a", [ModelCheckpoint(save_top_k=-1)], max_epochs=3, enable_checkpointing=True).fit(
        Regressor(), loader(regression_data(n=8)))
    before = _dirs(tmp_path / "a" / "checkpoints")
    assert before == ["epoch=0-step=2", "epoch=1-step=4", "epoch=2-step=6"]
    trainer = make_trainer(tmp_path / "b", max_epochs=4, enable_checkpointing=True)
    old = tmp_path / "a" / "checkpoints" / "epoch=1-step=4"
    trainer.fit(Regressor(), loader(regression_data(n=8)), ckpt_path=str(old))
    assert _dirs(tmp_path / "b" / "checkpoints") == ["epoch=3-step=8"]
    assert _dirs(tmp_path / "a" / "checkpoints") == before


def test_bf16_mixed_trains_and_keeps_fp32_weights(tmp_path):
    module = Regressor()
    make_trainer(tmp_path, max_epochs=3, precision="bf16-mixed").fit(module, loader(regression_data()))
    assert module.net.weight.dtype == torch.float32
    assert sum(module.losses[-10:]) < 0.2 * sum(module.losses[:10])


def test_early_stopping_stops_at_the_right_epoch(tmp_path):
    values = [5.0, 4.0, 4.5, 4.2, 4.1, 1.0, 1.0, 1.0]   # best 4.0 at epoch 1; no improvement in 2, 3 -> stop at 3
    stopper, rec = EarlyStopping(monitor="val/metric", patience=2), Recorder()
    trainer = make_trainer(tmp_path, [stopper, rec], max_epochs=8)
    trainer.fit(Scripted(values), loader(regression_data(n=8)), loader(regression_data(n=8, seed=5)))
    assert stopper.stopped_epoch == 3
    assert rec.epoch_starts == [0, 1, 2, 3]
    assert trainer.global_step == 8
    assert stopper.best == 4.0


def test_early_stopping_min_delta_and_mode_max(tmp_path):
    values = [1.0, 1.05, 1.08, 2.0]                  # +0.05, +0.03 are below min_delta=0.1 -> stop at 2
    stopper = EarlyStopping(monitor="val/metric", patience=2, mode="max", min_delta=0.1)
    trainer = make_trainer(tmp_path, [stopper], max_epochs=4)
    trainer.fit(Scripted(values), loader(regression_data(n=8)), loader(regression_data(n=8, seed=5)))
    assert stopper.stopped_epoch == 2 and trainer.global_step == 6


# -- validate / test / predict, DataModule ---------------------------------------------------------

def _weighted_mse(net, ds):
    with torch.no_grad():
        x, y = ds.tensors
        return F.mse_loss(net(x), y).item()


def test_validate_test_predict_return_values(tmp_path):
    module = Regressor()
    trainer = make_trainer(tmp_path, max_epochs=1)
    train, val, test = regression_data(), regression_data(n=10, seed=5), regression_data(n=14, seed=6)
    trainer.fit(module, loader(train))
    results = trainer.validate(module, loader(val))
    assert list(results[0]) == ["val/loss"] and len(results) == 1
    assert results[0]["val/loss"] == pytest.approx(_weighted_mse(module.net, val), rel=1e-5)
    results = trainer.test(dataloaders=loader(test))                     # the fitted module by default
    assert results[0]["test/loss"] == pytest.approx(_weighted_mse(module.net, test), rel=1e-5)
    two = trainer.validate(module, [loader(val), loader(test)])
    # several loaders: keys carry Lightning's "/dataloader_idx_N" suffix
    assert len(two) == 2 and two[1]["val/loss/dataloader_idx_1"] == pytest.approx(_weighted_mse(module.net, test),
                                                                                   rel=1e-5)
    preds = trainer.predict(module, loader(test, batch_size=4))
    assert [p.shape[0] for p in preds] == [4, 4, 4, 2]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(preds), module.net(test.tensors[0]))


def test_validate_without_fit(tmp_path):
    module = Regressor()
    val = regression_data(n=10, seed=5)
    results = make_trainer(tmp_path).validate(module, loader(val))
    assert results[0]["val/loss"] == pytest.approx(_weighted_mse(module.net, val), rel=1e-5)


class DigitsLike(DataModule):
    def __init__(self):
        super().__init__()
        self.stages, self.prepared = [], 0

    def prepare_data(self):
        self.prepared += 1

    def setup(self, stage):
        self.stages.append(stage)
        self.train, self.val = regression_data(n=24), regression_data(n=8, seed=5)

    def teardown(self, stage):
        self.stages.append(f"teardown {stage}")

    def train_dataloader(self):
        return loader(self.train, batch_size=4)

    def val_dataloader(self):
        return loader(self.val, batch_size=4)

    def test_dataloader(self):
        return loader(self.val, batch_size=2)

    def predict_dataloader(self):
        return loader(self.val, batch_size=8)


def test_datamodule_setup_stages_and_loaders(tmp_path):
    dm, rec = DigitsLike(), Recorder()
    module = Regressor()
    trainer = make_trainer(tmp_path, [rec], max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    assert dm.stages == ["fit", "teardown fit"] and dm.prepared == 1
    assert trainer.global_step == 12 and rec.val_batches == 4
    assert trainer.validate(datamodule=dm)[0]["val/loss"] == pytest.approx(_weighted_mse(module.net, dm.val), rel=1e-5)
    trainer.test(datamodule=dm)
    preds = trainer.predict(datamodule=dm)
    assert len(preds) == 1 and preds[0].shape == (8, 1)
    assert dm.stages == ["fit", "teardown fit", "validate", "teardown validate", "test", "teardown test", "predict",
                         "teardown predict"]
    with pytest.raises(ValueError, match="not both"):
        trainer.validate(module, loader(dm.val), datamodule=dm)


# -- manual optimization, hyperparameters ----------------------------------------------------------

class Manual(Regressor):
    automatic_optimization = False

    def __init__(self, every=1):
        super().__init__(lr=0.1)
        self.every, self.opt_steps = every, 0

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()
            self.opt_steps += 1
        self.losses.append(loss.item())
        self.log("train/loss", loss)


def test_manual_optimization_trains_like_the_raw_loop(tmp_path):
    module = Manual()
    raw = copy.deepcopy(module.net)
    trainer = make_trainer(tmp_path, max_epochs=3)
    trainer.fit(module, loader(regression_data()))
    raw_sgd_loop(raw, loader(regression_data()), epochs=3, lr=0.1)
    assert sum(module.losses[-10:]) < 0.2 * sum(module.losses[:10])
    torch.testing.assert_close(weights(module.net), weights(raw), atol=1e-6, rtol=0)
    assert trainer.callback_metrics["train/loss"] == pytest.approx(module.losses[-1])


def test_manual_optimization_global_step_counts_optimizer_steps(tmp_path):
    # Lightning: global_step is the number of optimizer steps, also under manual optimization.
    module = Manual(every=2)
    trainer = make_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, loader(regression_data()))
    assert module.opt_steps == 5
    assert trainer.global_step == 5


class WithHparams(Regressor):
    def __init__(self, hidden=8, lr=0.1, name="mlp"):
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_save_hyperparameters_stored_and_checkpointed(tmp_path):
    module = WithHparams(hidden=7, lr=0.2)
    assert module.hparams == {"hidden": 7, "lr": 0.2, "name": "mlp"}
    trainer = make_trainer(tmp_path, [ModelCheckpoint(save_last=True)], max_epochs=1, enable_checkpointing=True)
    trainer.fit(module, loader(regression_data(n=8)))
    assert _trainer_state(tmp_path / "checkpoints" / "last")["hyper_parameters"] == {"hidden": 7, "lr": 0.2,
                                                                                    "name": "mlp"}


def test_hparams_read_and_write_as_attributes():
    module = WithHparams(hidden=7, lr=0.2)
    assert module.hparams.lr == 0.2 and module.hparams["hidden"] == 7
    module.hparams.dropout = 0.1
    assert module.hparams["dropout"] == 0.1
    with pytest.raises(AttributeError, match=r"hparams has no 'momentum'; it holds: \['dropout', 'hidden', 'lr', 'name'\]"):
        module.hparams.momentum


def test_save_hyperparameters_records_only_init_arguments(tmp_path):
    class LocalsToo(Regressor):
        def __init__(self, hidden=8):
            super().__init__()
            width = hidden * 2                     # a local variable, not an __init__ argument
            self.save_hyperparameters()
            self.width = width

    assert LocalsToo(hidden=3).hparams == {"hidden": 3}


# -- hooks -------------------------------------------------------------------------------------------

def test_validation_start_and_end_callback_hooks_are_called(tmp_path):
    class Hooks(Callback):
        def __init__(self):
            self.calls = []

        def on_validation_start(self, trainer, module):
            self.calls.append("start")

        def on_validation_end(self, trainer, module):
            self.calls.append("end")

    hooks = Hooks()
    make_trainer(tmp_path, [hooks], max_epochs=2, num_sanity_val_steps=0).fit(
        Regressor(), loader(regression_data()), loader(regression_data(seed=5)))
    assert hooks.calls == ["start", "end", "start", "end"]


def test_progress_bar_shows_prog_bar_metrics(tmp_path, capsys):
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(LogDefaults(), loader(regression_data()), loader(regression_data(seed=5)))
    err = capsys.readouterr().err
    assert "Epoch 0" in err and "b_step=" in err and "10/10" in err


def test_hparams_json_for_loggers(tmp_path):
    class Params(Callback):
        got = None

        def on_hyperparameters(self, trainer, params):
            Params.got = json.loads(json.dumps(params))

    make_trainer(tmp_path, [Params()], max_epochs=1).fit(WithHparams(hidden=5), loader(regression_data(n=8)))
    assert Params.got == {"hidden": 5, "lr": 0.1, "name": "mlp"}


def test_fit_twice_on_one_trainer_keeps_one_set_of_checkpoint_entries(tmp_path):
    trainer = make_trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    module = Regressor()
    trainer.fit(module, loader(regression_data()))
    trainer.fit(module, loader(regression_data()))
    trainer.save_checkpoint(str(tmp_path / "ck"))
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert [f for f in files if f.startswith("model_")] == ["model_0.pt"]
    from fabric_lite.checkpoint.state import TRAINING_STATE

    assert len(torch.load(tmp_path / "ck" / TRAINING_STATE, weights_only=True)["custom"]) == 1


def test_throughput_monitor_reports_rates_at_each_log_step(tmp_path):
    from fabric_lite.callbacks import ThroughputMonitor

    rec = Recorder()
    trainer = make_trainer(tmp_path, [ThroughputMonitor(flops_per_batch=1000.0), rec], max_epochs=1,
                           log_every_n_steps=5)
    trainer.fit(Regressor(), loader(regression_data(n=40)))  # 10 steps of batch 4
    reports = [(step, m) for step, m in rec.logs if "throughput/samples_per_sec" in m]
    assert [step for step, _ in reports] == [5, 10]
    for _, m in reports:
        assert m["throughput/samples_per_sec"] == pytest.approx(4 * m["throughput/batches_per_sec"])
        assert m["throughput/flops_per_sec"] == pytest.approx(1000.0 * m["throughput/batches_per_sec"])
        assert "throughput/mfu" not in m  # no known peak for a CPU


def test_resume_after_a_batch_limited_epoch_starts_the_next_epoch(tmp_path):
    def run(root, epochs, ckpt_path=None):
        set_seed(0)
        module = Dropout()
        trainer = make_trainer(root, max_epochs=epochs, limit_train_batches=3, enable_checkpointing=True)
        trainer.fit(module, loader(regression_data(n=40), batch_size=4, shuffle=True, seed=3), ckpt_path=ckpt_path)
        return module

    straight = run(tmp_path / "a", 3)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 3, ckpt_path="last")
    assert torch.equal(weights(resumed), weights(straight))


def test_a_resumed_run_prunes_the_checkpoint_it_resumed_from(tmp_path):
    # the checkpoint's own ModelCheckpoint state must list that checkpoint, or a resumed run never prunes it
    for epochs in (1, 3):
        make_trainer(tmp_path, [ModelCheckpoint(save_top_k=1)], max_epochs=epochs, enable_checkpointing=True).fit(
            Regressor(), loader(regression_data(n=8)), ckpt_path="last")
    assert _dirs(tmp_path / "checkpoints") == ["epoch=2-step=6"]
    assert json.loads((tmp_path / "checkpoints" / "latest").read_text()) == {"name": "epoch=2-step=6"}


def test_a_failed_save_leaves_the_top_k_bookkeeping_and_the_old_checkpoint(tmp_path, monkeypatch):
    callback = ModelCheckpoint(save_top_k=1)
    trainer = make_trainer(tmp_path, [callback], max_epochs=1, enable_checkpointing=True)
    trainer.fit(Regressor(), loader(regression_data(n=8)))
    before = dict(callback.best_k_models)

    def broken(path, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trainer, "save_checkpoint", broken)
    trainer.global_step += 1
    with pytest.raises(OSError, match="disk full"):
        callback._save(trainer)
    assert callback.best_k_models == before
    assert _dirs(tmp_path / "checkpoints") == ["epoch=0-step=2"]


class NoisyData(torch.utils.data.Dataset):
    """A random transform drawn from the global RNG in __getitem__ (loaded in the main process)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


def test_resume_is_exact_with_random_transforms_drawn_in_the_main_process(tmp_path):
    # num_workers=0: the loader must not fetch batch k+1 (drawing from the global RNG) before step k
    # has run, or the checkpoint's RNG state is ahead of its position and the resumed run differs
    def run(root, ckpt_path=None, save=False):
        set_seed(0)
        module = Dropout()
        callbacks = [ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)] if save else []
        trainer = make_trainer(root, callbacks, max_epochs=2, enable_checkpointing=save)
        data = NoisyData(regression_data(n=30))
        trainer.fit(module, loader(data, batch_size=4, shuffle=True, seed=3), ckpt_path=ckpt_path)
        return module

    straight = run(tmp_path / "a", save=True)
    resumed = run(tmp_path / "b", ckpt_path=str(tmp_path / "a" / "checkpoints" / "epoch=0-step=5"))
    assert torch.equal(weights(resumed), weights(straight))


@pytest.mark.parametrize("out_name", ["weights.safetensors", "weights.pt"])
def test_consolidate_writes_weights_a_plain_module_loads(tmp_path, out_name, capsys):
    from fabric_lite.cli.main import main

    module = Regressor()
    make_trainer(tmp_path, max_epochs=1, enable_checkpointing=True).fit(module, loader(regression_data(n=8)))
    (ckpt,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    out = tmp_path / out_name
    assert main(["consolidate", str(ckpt), str(out)]) == 0
    if out_name.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)
    plain = Regressor(seed=123)  # other initial weights: everything must come from the file
    plain.load_state_dict(state)  # the module's own keys, no wrapper prefix
    assert torch.equal(weights(plain), weights(module))


def test_consolidate_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    from fabric_lite.cli.main import main

    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "w.pt")]) == 2
    assert "No checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "w.pt").exists()


def test_consolidate_output_in_a_directory_and_bad_input_in_one_line(tmp_path, capsys):
    from fabric_lite.cli.main import main

    module = Regressor()
    make_trainer(tmp_path, max_epochs=1, enable_checkpointing=True).fit(module, loader(regression_data(n=8)))
    (ckpt,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    existing = tmp_path / "exported"
    existing.mkdir()
    assert main(["consolidate", str(ckpt), str(existing)]) == 0  # an existing directory: a named file inside
    assert os.listdir(existing) == ["model_0.pt"]
    assert f"to {existing}/model_0.pt" in capsys.readouterr().out
    plain = Regressor(seed=123)
    plain.load_state_dict(torch.load(existing / "model_0.pt", weights_only=True))
    assert torch.equal(weights(plain), weights(module))
    nested = tmp_path / "new" / "dir" / "w.safetensors"  # missing directories are made
    assert main(["consolidate", str(ckpt), str(nested)]) == 0 and os.listdir(nested.parent) == ["w.safetensors"]
    capsys.readouterr()

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    (damaged / "manifest.json").write_text("{'not': json")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for source, out, expected in [(damaged, tmp_path / "w.pt", "manifest.json is not readable JSON"),
                                  (ckpt, blocked / "w.pt", f"(writing {blocked}/w.pt)")]:
        assert main(["consolidate", str(source), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fabric-lite consolidate: ") and expected in err and err.count("\n") == 1, err
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["a-file", "checkpoints", "damaged", "exported", "new"]), \
        os.listdir(tmp_path)  # nothing temporary left behind


def test_step_monitors_report_once_per_optimizer_step_under_accumulation(tmp_path):
    from fabric_lite.callbacks import LearningRateMonitor, ThroughputMonitor

    class Steps(Callback):
        def __init__(self):
            self.steps = []

        def on_log(self, trainer, metrics, step):
            if any(k.startswith(("lr-", "throughput/")) for k in metrics):
                self.steps.append((step, sorted(k for k in metrics if k.startswith(("lr-", "throughput/")))[0]))

    rec = Steps()
    trainer = make_trainer(tmp_path, [LearningRateMonitor("step"), ThroughputMonitor(), rec], max_epochs=1,
                           accumulate_grad_batches=2, log_every_n_steps=1)
    trainer.fit(Regressor(), loader(regression_data(n=32)))  # 8 batches, 4 optimizer steps
    assert [s for s, k in rec.steps if k.startswith("lr-")] == [1, 2, 3, 4]
    assert [s for s, k in rec.steps if k.startswith("throughput/")] == [1, 2, 3, 4]
