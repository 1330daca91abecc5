"""A TrainModule that brings its own data (Lightning's basic docs): `train_dataloader()`/`val_dataloader()`/
`test_dataloader()`/`predict_dataloader()` and `prepare_data()`/`setup(stage)`/`teardown(stage)` on the module;
`trainer.datamodule`; `validate/test/predict(ckpt_path="best" | "last" | path)`; and the names Lightning code
reaches through the package (`import fabric_lite as L; L.LightningModule`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fabric_lite as L
from fabric_lite import Accelerator, DataModule, Trainer, TrainModule
from fabric_lite.callbacks import Callback, ModelCheckpoint


def line_data(n, slope, offset=0.0):
    x = torch.linspace(-1, 1, n).unsqueeze(1) + offset
    return TensorDataset(x, slope * x)


class SelfFed(L.LightningModule):
    """y = w x fit to slope 3; validation wants slope 0, so the validation loss grows as training goes on.
    Records the order in which the Trainer calls its data hooks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.net.weight)
        self.events = []
        self.test_losses = []

    def forward(self, x):
        return self.net(x)

    def prepare_data(self):
        self.events.append("prepare_data")

    def setup(self, stage):
        self.events.append(f"setup:{stage}")

    def teardown(self, stage):
        self.events.append(f"teardown:{stage}")

    def train_dataloader(self):
        self.events.append("train_dataloader")
        return DataLoader(line_data(8, slope=3.0), batch_size=4)

    def val_dataloader(self):
        self.events.append("val_dataloader")
        return DataLoader(line_data(8, slope=0.0), batch_size=4)

    def test_dataloader(self):
        self.events.append("test_dataloader")
        return DataLoader(line_data(4, slope=0.0), batch_size=4)

    def predict_dataloader(self):
        self.events.append("predict_dataloader")
        return DataLoader(torch.ones(2, 1), batch_size=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.test_losses.append(loss.item())
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx):
        return self(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WeightsAtValidation(Callback):
    """The module's weight after each validation (one per epoch here)."""

    def __init__(self):
        self.weights = []

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.weights.append(module.net.weight.item())


def trainer_for(tmp_path, **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return Trainer(default_root_dir=str(tmp_path), **kwargs)


def test_fit_validate_test_predict_take_the_modules_own_loaders(tmp_path):
    module = SelfFed()
    trainer = trainer_for(tmp_path, max_epochs=2, enable_checkpointing=False)
    trainer.fit(module)
    assert trainer.global_step == 4  # 2 epochs of 2 batches from train_dataloader()
    assert module.net.weight.item() > 0.5  # it learned towards slope 3 (from 0)
    assert module.events == ["prepare_data", "setup:fit", "train_dataloader", "val_dataloader", "teardown:fit"]
    w = module.net.weight.item()
    expected = w * w * (torch.linspace(-1, 1, 4) ** 2).mean().item()  # mse of w x against 0
    (validated,) = trainer.validate(module)
    assert validated["val_loss"] == pytest.approx(w * w * (torch.linspace(-1, 1, 8) ** 2).mean().item(), rel=1e-5)
    (tested,) = trainer.test(module)
    assert tested["test_loss"] == pytest.approx(expected, rel=1e-5)
    (predicted,) = trainer.predict(module)
    assert torch.allclose(predicted, torch.full((2, 1), w))
    assert module.events[5:] == ["prepare_data", "setup:validate", "val_dataloader", "teardown:validate",
                                 "prepare_data", "setup:test", "test_dataloader", "teardown:test",
                                 "prepare_data", "setup:predict", "predict_dataloader", "teardown:predict"]


def test_loaders_given_to_fit_win_over_the_modules_own(tmp_path):
    module = SelfFed()
    trainer = trainer_for(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(module, DataLoader(line_data(12, slope=3.0), batch_size=4))
    assert trainer.global_step == 3
    assert "train_dataloader" not in module.events and "val_dataloader" in module.events


class LineData(DataModule):
    def __init__(self):
        super().__init__()
        self.events = []

    def setup(self, stage):
        self.events.append(f"setup:{stage}")

    def teardown(self, stage):
        self.events.append(f"teardown:{stage}")

    def train_dataloader(self):
        return DataLoader(line_data(20, slope=3.0), batch_size=4)

    def test_dataloader(self):
        return DataLoader(line_data(4, slope=0.0), batch_size=4)


def test_a_datamodule_wins_over_the_modules_loaders_and_is_trainer_datamodule(tmp_path):
    module, data = SelfFed(), LineData()
    trainer = trainer_for(tmp_path, max_epochs=1, enable_checkpointing=False)
    assert trainer.datamodule is None
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 5 and trainer.datamodule is data and data.trainer is trainer
    assert "train_dataloader" not in module.events and "val_dataloader" not in module.events
    # the DataModule's hooks run before the module's
    assert data.events == ["setup:fit", "teardown:fit"]
    assert module.events == ["prepare_data", "setup:fit", "teardown:fit"]
    trainer.test(module)  # without a datamodule: the module's own test loader; trainer.datamodule stays
    assert trainer.datamodule is data and module.events[-2] == "test_dataloader"
    with pytest.raises(ValueError, match="dataloaders or a datamodule"):
        trainer.test(module, DataLoader(line_data(4, slope=0.0)), datamodule=data)


def test_a_module_without_loaders_says_what_fit_needs(tmp_path):
    class Bare(TrainModule):
        def training_step(self, batch, batch_idx):
            return batch.sum()

    with pytest.raises(ValueError, match="or a module that defines train_dataloader"):
        trainer_for(tmp_path, max_epochs=1).fit(Bare())
    with pytest.raises(ValueError, match="or a module that defines test_dataloader"):
        trainer_for(tmp_path, max_epochs=1).test(Bare())


# -- batch transfer hooks ------------------------------------------------------------------------------------

class Augmented(SelfFed):
    """Lightning's batch-transfer hooks: records what each receives; scales x by 10 once on the device."""

    def __init__(self):
        super().__init__()
        self.transfers = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.transfers.append(("before", dataloader_idx, batch[0].device.type))
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers.append(("transfer", dataloader_idx, str(device)))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return 10 * x, y

    def training_step(self, batch, batch_idx):
        self.events.append(("train_x", batch[0].abs().max().item()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.events.append(("val_x", batch[0].abs().max().item()))


def test_batches_go_through_the_transfer_hooks_with_their_loaders_index(tmp_path):
    module = Augmented()
    val = [DataLoader(line_data(2, slope=0.0), batch_size=2),
           DataLoader(line_data(2, slope=0.0, offset=1), batch_size=2)]
    trainer_for(tmp_path, max_epochs=1, enable_checkpointing=False).fit(module, val_dataloaders=val)
    # one epoch of 2 training batches (x in [-1, 1]), then both validation loaders (x in [-1, 1] and [0, 2])
    assert module.transfers == [("before", 0, "cpu"), ("transfer", 0, "cpu")] * 2 + [
        ("before", 0, "cpu"), ("transfer", 0, "cpu"), ("before", 1, "cpu"), ("transfer", 1, "cpu")]
    seen = [e for e in module.events if isinstance(e, tuple)]
    assert seen == [("train_x", 10.0), ("train_x", 10.0), ("val_x", 10.0), ("val_x", 20.0)]


def test_a_datamodules_transfer_hook_wins_over_the_modules(tmp_path):
    class Halving(LineData):
        def train_dataloader(self):
            return DataLoader(line_data(4, slope=3.0), batch_size=4)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            return x / 2, y

    module = Augmented()
    trainer_for(tmp_path, max_epochs=1, enable_checkpointing=False).fit(module, datamodule=Halving())
    assert [e for e in module.events if isinstance(e, tuple)] == [("train_x", 0.5)]
    assert module.transfers == [("before", 0, "cpu"), ("transfer", 0, "cpu")]  # the module's other two hooks ran


def test_without_transfer_hooks_the_loader_places_batches_itself(tmp_path):
    trainer = trainer_for(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(SelfFed())
    assert trainer.batch_transfer is None and type(trainer.train_dataloader).__name__ == "DataLoaderShard"


# -- ckpt_path for validate / test / predict -----------------------------------------------------------------

def fitted(tmp_path, **checkpoint):
    """Three epochs; the validation loss grows every epoch, so the best checkpoint is the first epoch's."""
    module, weights = SelfFed(), WeightsAtValidation()
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), **checkpoint)
    trainer = trainer_for(tmp_path, max_epochs=3, callbacks=[callback, weights])
    trainer.fit(module)
    return trainer, module, weights.weights


def test_test_with_ckpt_path_best_loads_the_best_models_weights(tmp_path):
    trainer, module, weights = fitted(tmp_path, monitor="val_loss", mode="min", save_top_k=1, save_last=True)
    assert len(weights) == 3 and weights[0] < weights[1] < weights[2]  # so epoch 0 is the best
    (result,) = trainer.test(ckpt_path="best")
    assert module.net.weight.item() == weights[0]
    x = torch.linspace(-1, 1, 4)
    assert result["test_loss"] == pytest.approx(weights[0] ** 2 * (x ** 2).mean().item(), rel=1e-5)
    trainer.validate(ckpt_path="last")
    assert module.net.weight.item() == weights[2]
    best = trainer.checkpoint_callback.best_model_path
    (predicted,) = trainer.predict(ckpt_path=best)
    assert module.net.weight.item() == weights[0] and torch.allclose(predicted, torch.full((2, 1), weights[0]))


def test_a_new_trainer_tests_a_new_module_with_the_weights_of_a_checkpoint_path(tmp_path):
    trainer, _, weights = fitted(tmp_path, monitor="val_loss", mode="min", save_top_k=1)
    module = SelfFed()  # weight 0
    (result,) = trainer_for(tmp_path / "other", enable_checkpointing=False).test(
        module, ckpt_path=trainer.checkpoint_callback.best_model_path)
    assert module.net.weight.item() == weights[0]
    assert result["test_loss"] == pytest.approx(weights[0] ** 2 * (torch.linspace(-1, 1, 4) ** 2).mean().item(),
                                                rel=1e-5)


def test_ckpt_path_best_without_a_best_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r'test\(ckpt_path="best"\) needs a ModelCheckpoint'):
        trainer_for(tmp_path, enable_checkpointing=False).test(SelfFed(), ckpt_path="best")
    with pytest.raises(ValueError, match=r'validate\(ckpt_path="best"\): the ModelCheckpoint has no best model'):
        trainer_for(tmp_path).validate(SelfFed(), ckpt_path="best")
    trainer = trainer_for(tmp_path, fast_dev_run=True)
    trainer.fit(SelfFed())
    with pytest.raises(ValueError, match="fast_dev_run saves no checkpoints"):
        trainer.test(ckpt_path="best")


# -- names Lightning code reaches through the package ---------------------------------------------------------

def test_lightning_spellings_reach_through_the_package():
    assert L.LightningModule is TrainModule and L.LightningDataModule is DataModule
    assert L.Trainer is Trainer and L.Callback is Callback
    assert L.callbacks.ModelCheckpoint is ModelCheckpoint
    assert L.loggers.CSVLogger.__name__ == "CSVLogger"
    L.seed_everything(7)
    assert torch.initial_seed() == 7
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        L.NoSuchThing


def test_import_fabric_lite_stays_lazy():
    code = ("import sys, fabric_lite as L; {reach}"
            "print(sorted(m for m in ('fabric_lite.trainer', 'fabric_lite.callbacks', 'fabric_lite.strategies.ddp') "
            "if m in sys.modules))")

    def loaded(reach):
        return subprocess.run([sys.executable, "-c", code.format(reach=reach)], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert loaded("") == "[]"  # the aliases and subpackages are imported on first use only
    assert "fabric_lite.trainer" in loaded("L.LightningModule; ")
    assert "fabric_lite.callbacks" in loaded("L.callbacks; ")


def test_parallel_strategy_is_the_base_of_the_multi_process_strategies():
    from fabric_lite.strategies import DDPStrategy, FSDPStrategy, ParallelStrategy, SingleDeviceStrategy, XLAStrategy
    from fabric_lite.strategies.deepspeed import DeepSpeedStrategy

    for cls in (DDPStrategy, FSDPStrategy, DeepSpeedStrategy, XLAStrategy):
        assert issubclass(cls, ParallelStrategy)
    assert not issubclass(SingleDeviceStrategy, ParallelStrategy)


def test_printed_accelerator_state_shows_the_mixed_precision():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    assert str(accelerator.state).endswith("device=cpu, mixed_precision=bf16)")
    assert "mixed_precision=no" in repr(Accelerator(cpu=True).state)
