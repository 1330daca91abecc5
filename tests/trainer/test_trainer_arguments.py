"""Lightning's Trainer arguments beyond the loop limits: min_epochs/min_steps, overfit_batches, detect_anomaly,
inference_mode, reload_dataloaders_every_n_epochs, use_distributed_sampler, benchmark, barebones and plugins,
each checked for what it does with known values (how many epochs and steps ran, which samples each batch held)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, EarlyStopping
from fabric_lite.strategies.precision import Precision
from fabric_lite.utils.refusals import NotSupportedError


def indexed_data(n=16):
    """Sample i is (x = i as a float, y = 2 i): a batch tells which samples it holds."""
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, 2 * x)


class Line(TrainModule):
    """y = w x + b; records the samples of every training and validation batch, and the grad mode of evaluation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(1, 1)
        self.train_batches, self.val_batches, self.modes = [], [], []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.train_batches.append(x.flatten().tolist())
        return F.mse_loss(self(x), y) * 1e-3

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_batches.append(x.flatten().tolist())
        self.modes.append(("validate", torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        self.log("val_loss", torch.tensor(1.0))  # never improves: EarlyStopping asks to stop

    def test_step(self, batch, batch_idx):
        self.modes.append(("test", torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def predict_step(self, batch, batch_idx):
        self.modes.append(("predict", torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def make_trainer(tmp_path, **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return Trainer(default_root_dir=str(tmp_path), **kwargs)


def loader(n=16, batch_size=4, shuffle=False):
    return DataLoader(indexed_data(n), batch_size=batch_size, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0) if shuffle else None)


class StopAt(Callback):
    """Asks the Trainer to stop after training batch `batch` of every epoch."""

    def __init__(self, batch=0):
        self.batch = batch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.batch:
            trainer.should_stop = True


# -- min_epochs / min_steps --------------------------------------------------------------------------

def test_early_stopping_waits_for_min_epochs(tmp_path):
    # val_loss never improves: with patience=1, EarlyStopping stops after the second epoch
    alone = make_trainer(tmp_path, max_epochs=10, callbacks=[EarlyStopping("val_loss", patience=1)])
    alone.fit(Line(), loader(), loader())
    assert alone.current_epoch == 2
    held = make_trainer(tmp_path, max_epochs=10, min_epochs=5, callbacks=[EarlyStopping("val_loss", patience=1)])
    module = Line()
    held.fit(module, loader(), loader())
    assert held.current_epoch == 5 and held.global_step == 5 * 4
    assert len(module.train_batches) == 20


def test_a_stop_mid_epoch_waits_for_min_steps_then_stops_there(tmp_path):
    alone = make_trainer(tmp_path, max_epochs=10, callbacks=[StopAt(batch=0)])
    alone.fit(Line(), loader())
    assert alone.global_step == 1
    held = make_trainer(tmp_path, max_epochs=10, min_steps=7, callbacks=[StopAt(batch=0)])
    held.fit(Line(), loader())
    assert held.global_step == 7  # the stop holds until step 7, in the second epoch (4 steps each)
    assert held.current_epoch == 2  # (the second epoch, cut short, counts as done)


def test_max_epochs_and_max_steps_still_end_training_before_the_minimums(tmp_path):
    trainer = make_trainer(tmp_path, max_epochs=2, min_epochs=5)
    trainer.fit(Line(), loader())
    assert trainer.current_epoch == 2
    trainer = make_trainer(tmp_path, max_steps=3, min_steps=10)
    trainer.fit(Line(), loader())
    assert trainer.global_step == 3


# -- overfit_batches ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overfit", [2, 0.5])
def test_overfit_batches_trains_and_validates_on_the_same_first_batches_in_order(tmp_path, overfit):
    module = Line()
    trainer = make_trainer(tmp_path, max_epochs=3, overfit_batches=overfit)
    with pytest.warns(UserWarning, match="overfit_batches.*shuffles"):
        trainer.fit(module, loader(n=16, batch_size=4, shuffle=True), loader(n=16, batch_size=4, shuffle=True))
    first_two = [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert module.train_batches == first_two * 3
    assert module.val_batches == first_two * 3
    assert trainer.global_step == 6


def test_overfit_batches_refuses_a_batch_sampler_it_cannot_order(tmp_path):
    class Shuffled(Sampler):
        def __iter__(self):
            return iter([[3, 2], [1, 0]])

        def __len__(self):
            return 2

    with pytest.raises(ValueError, match="overfit_batches=1.*Shuffled"):
        make_trainer(tmp_path, max_epochs=1, overfit_batches=1).fit(
            Line(), DataLoader(indexed_data(4), batch_sampler=Shuffled()))


# -- detect_anomaly ----------------------------------------------------------------------------------

class NaNGradient(Line):
    def training_step(self, batch, batch_idx):
        return torch.sqrt(self.net.weight - 10.0).sum()  # sqrt of a negative: NaN, and a NaN gradient


def test_detect_anomaly_names_the_op_that_made_a_nan(tmp_path):
    make_trainer(tmp_path, max_steps=1).fit(NaNGradient(), loader())  # without it: trains on, silently
    assert not torch.is_anomaly_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that anomaly mode is slow, and prints the forward trace)
        with pytest.raises(RuntimeError, match="SqrtBackward0"):
            make_trainer(tmp_path, max_steps=1, detect_anomaly=True).fit(NaNGradient(), loader())
    assert not torch.is_anomaly_enabled()  # switched off again after fit


# -- inference_mode ----------------------------------------------------------------------------------

@pytest.mark.parametrize("inference", [True, False])
def test_evaluation_runs_under_inference_mode_or_no_grad(tmp_path, inference):
    module = Line()
    trainer = make_trainer(tmp_path, max_epochs=1, limit_val_batches=1, inference_mode=inference)
    trainer.fit(module, loader(), loader())
    trainer.validate(module, loader(n=4))
    trainer.test(module, loader(n=4))
    trainer.predict(module, loader(n=4))
    assert module.modes == [("validate", inference, False), ("validate", inference, False),
                            ("test", inference, False), ("predict", inference, False)]


# -- reload_dataloaders_every_n_epochs ---------------------------------------------------------------

class Reloading(Line):
    """Its own loaders: the k-th call of train_dataloader() yields the single sample 10 k (and val 100 k)."""

    def __init__(self):
        super().__init__()
        self.calls = {"train": 0, "val": 0}

    def train_dataloader(self):
        k = self.calls["train"]
        self.calls["train"] += 1
        x = torch.tensor([[10.0 * k]])
        return DataLoader(TensorDataset(x, x), batch_size=1)

    def val_dataloader(self):
        k = self.calls["val"]
        self.calls["val"] += 1
        x = torch.tensor([[100.0 * k]])
        return DataLoader(TensorDataset(x, x), batch_size=1)


@pytest.mark.parametrize("every,expected", [(0, [0, 0, 0, 0, 0]), (1, [0, 10, 20, 30, 40]), (2, [0, 0, 10, 10, 20])])
def test_reload_dataloaders_every_n_epochs_asks_the_module_again(tmp_path, every, expected):
    module = Reloading()
    make_trainer(tmp_path, max_epochs=5, reload_dataloaders_every_n_epochs=every).fit(module)
    assert [b[0] for b in module.train_batches] == expected
    assert [b[0] for b in module.val_batches] == [10 * v for v in expected]
    assert module.calls == {"train": expected[-1] // 10 + 1, "val": expected[-1] // 10 + 1}


def test_a_resumed_fit_counts_reloads_from_the_epoch_it_resumed_at(tmp_path):
    first = Reloading()
    make_trainer(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=2, enable_checkpointing=True).fit(first)
    assert first.calls["train"] == 2  # epochs 0 and 2
    resumed = Reloading()
    trainer = make_trainer(tmp_path, max_epochs=6, reload_dataloaders_every_n_epochs=2, enable_checkpointing=True)
    trainer.fit(resumed, ckpt_path="last")
    # asked once when fit starts (epoch 3), again at epoch 5: not again at epoch 3 right after the resume
    assert resumed.calls["train"] == 2 and [b[0] for b in resumed.train_batches] == [0.0, 0.0, 10.0]


# -- use_distributed_sampler (one process here; tests/trainer/test_trainer_arguments_ddp.py runs two) ------------

def test_use_distributed_sampler_false_keeps_the_users_order(tmp_path):
    class Backwards(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    module = Line()
    make_trainer(tmp_path, max_epochs=1, use_distributed_sampler=False).fit(
        module, DataLoader(indexed_data(8), batch_size=4, sampler=Backwards(8)))
    assert module.train_batches == [[7.0, 6.0, 5.0, 4.0], [3.0, 2.0, 1.0, 0.0]]


# -- benchmark ---------------------------------------------------------------------------------------

@pytest.fixture
def torch_switches():
    saved = torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.use_deterministic_algorithms(saved[1])


def test_benchmark_sets_cudnn_benchmark_and_defaults_off_with_deterministic(tmp_path, torch_switches):
    torch.backends.cudnn.benchmark = True
    make_trainer(tmp_path)  # None: the session's setting stays
    assert torch.backends.cudnn.benchmark is True
    make_trainer(tmp_path, benchmark=False)
    assert torch.backends.cudnn.benchmark is False
    make_trainer(tmp_path, benchmark=True)
    assert torch.backends.cudnn.benchmark is True
    make_trainer(tmp_path, deterministic=True)  # deterministic: benchmark defaults to False
    assert torch.backends.cudnn.benchmark is False
    with pytest.warns(UserWarning, match="deterministic=True, benchmark=True"):
        make_trainer(tmp_path, deterministic=True, benchmark=True)
    assert torch.backends.cudnn.benchmark is True


# -- barebones ---------------------------------------------------------------------------------------

def test_barebones_turns_off_the_extras_and_still_trains(tmp_path):
    trainer = Trainer(barebones=True, max_epochs=2, default_root_dir=str(tmp_path))
    assert trainer.callbacks == [] and trainer.loggers == [] and trainer.checkpoint_callback is None
    assert trainer.num_sanity_val_steps == 0 and trainer.enable_model_summary is False
    module = Line()
    with pytest.warns(UserWarning, match=r"self.log\('val_loss', ...\) under Trainer\(barebones=True\)") as seen:
        trainer.fit(module, loader(), loader())
    assert len([w for w in seen if "barebones" in str(w.message)]) == 1  # said once
    assert trainer.global_step == 8 and trainer.callbacks == []
    assert len(module.val_batches) == 8  # validation still runs (no sanity batches)
    assert dict(trainer.callback_metrics) == {}  # what self.log was given is dropped
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("extra", [
    {"enable_checkpointing": True}, {"logger": True}, {"enable_progress_bar": True}, {"log_every_n_steps": 10},
    {"enable_model_summary": True}, {"num_sanity_val_steps": 2}, {"fast_dev_run": True}, {"detect_anomaly": True},
    {"profiler": "simple"},
])
def test_barebones_refuses_what_it_turns_off(tmp_path, extra):
    (name, value), = extra.items()
    with pytest.raises(ValueError, match=rf"Trainer\({name}=.*not available with barebones=True"):
        Trainer(barebones=True, default_root_dir=str(tmp_path), **extra)


def test_barebones_accepts_those_features_turned_off(tmp_path):
    trainer = Trainer(barebones=True, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                      log_every_n_steps=0, enable_model_summary=False, num_sanity_val_steps=0, fast_dev_run=False,
                      default_root_dir=str(tmp_path))
    assert trainer.callbacks == []


# -- plugins -----------------------------------------------------------------------------------------

def test_a_precision_plugin_sets_the_precision(tmp_path):
    trainer = make_trainer(tmp_path, plugins=[Precision("bf16-mixed")])
    assert trainer.strategy.precision.name == "bf16-mixed"
    assert make_trainer(tmp_path, plugins=Precision("bf16-mixed"), precision="bf16-mixed") \
        .strategy.precision.name == "bf16-mixed"
    with pytest.raises(ValueError, match=r"Trainer\(precision='16-mixed'\).*both set the precision"):
        make_trainer(tmp_path, plugins=[Precision("bf16-mixed")], precision="16-mixed")


def test_a_plugin_without_a_counterpart_is_refused_by_name(tmp_path):
    class SLURMEnvironment:
        pass

    with pytest.raises(NotSupportedError, match="'SLURMEnvironment' plugin has no counterpart"):
        make_trainer(tmp_path, plugins=[SLURMEnvironment()])
    with pytest.raises(NotSupportedError, match="'torch_checkpoint_io' plugin"):
        make_trainer(tmp_path, plugins="torch_checkpoint_io")


def test_an_unknown_argument_is_still_refused(tmp_path):
    with pytest.raises(TypeError, match="'min_epoch' \\(did you mean 'min_epochs'\\?\\)"):
        Trainer(min_epoch=3)


# -- on 2 processes ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_arguments_on_two_processes(tmp_path, launch):
    r0, r1 = launch("trainer_arguments_ddp", 2, "--root", tmp_path / "root", timeout=240)
    # default: the Trainer shards the 8 samples (4 batches of 2) over the 2 processes, each sample once
    assert r0["sharded"]["world"] == 2
    assert sorted(r0["sharded"]["seen"] + r1["sharded"]["seen"]) == list(range(8))
    assert len(r0["sharded"]["seen"]) == 4
    # evaluation over a gloo process group runs under no_grad (inference tensors cannot go through gloo)
    assert r0["sharded"]["modes"] == [[False, False]]
    # use_distributed_sampler=False: each process reads the loader whole, in its order ...
    assert r0["whole"]["seen"] == r1["whole"]["seen"] == list(range(8))
    # ... or the shard of the user's own DistributedSampler
    assert r0["own"]["seen"] == [0, 2, 4, 6] and r1["own"]["seen"] == [1, 3, 5, 7]
    # a stop asked for on one rank stops every rank at the same epoch; min_epochs holds it on every rank
    assert r0["stop"] == r1["stop"] == {"epochs": 1, "steps": 2}
    assert r0["held"] == r1["held"] == {"epochs": 3, "steps": 6}
