"""Lightning's `trainer.fit(model, dm)`: a DataModule passed where the loaders go is used as the datamodule, in
fit, validate, test and predict (the way Lightning's GAN and RL examples call it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import DataModule, Trainer, TrainModule


class Data(DataModule):
    def __init__(self):
        super().__init__()
        self.stages, self.torn_down = [], []

    def setup(self, stage):
        self.stages.append(stage)
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def teardown(self, stage):
        self.torn_down.append(stage)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_datamodule_in_place_of_the_loaders_is_the_datamodule(tmp_path):
    data, module = Data(), Net()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert trainer.global_step == 4 and trainer.datamodule is data
    assert len(trainer.validate(module, data)) == 1 and len(trainer.test(module, data)) == 1
    predictions = trainer.predict(module, data)
    assert [p.shape[0] for p in predictions] == [8, 8]
    assert data.stages == ["fit", "validate", "test", "predict"] == data.torn_down


def test_a_datamodule_given_twice_is_refused(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"fit\(\) got a Data in place of the dataloaders and datamodule=Data"):
        trainer.fit(Net(), Data(), datamodule=Data())


def test_the_modules_setup_and_loader_methods_see_their_trainer(tmp_path):
    """Lightning's ImageNet template reads self.trainer in setup() and in its dataloader methods."""

    class Reads(Net):
        def setup(self, stage):
            self.seen = (stage, self.trainer.world_size)

        def train_dataloader(self):
            x = torch.randn(8, 3)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4 * self.trainer.world_size)

    module = Reads()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False)
    trainer.fit(module)
    assert module.seen == ("fit", 1) and trainer.global_step == 2
