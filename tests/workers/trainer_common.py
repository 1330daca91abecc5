"""Modules and data shared by the Trainer worker scripts and by the tests that build 1-process references."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import IndexDataset, flat_weights, make_model
from fabric_lite import Trainer, TrainModule, set_seed


class ParityModule(TrainModule):
    """The `train_parity` model and loss, as a TrainModule (SGD with momentum: every step counts)."""

    def __init__(self):
        super().__init__()
        self.net = make_model(seed=0)

    def training_step(self, batch, batch_idx):
        x, idx = batch
        loss = F.cross_entropy(self.net(x), idx % 3)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit_parity(root, batch_size, accumulate=1, epochs=2, n=64):
    """Fit ParityModule on IndexDataset(n), shuffled by a seeded generator; returns (trainer, flat weights)."""
    set_seed(7)
    module = ParityModule()
    loader = DataLoader(IndexDataset(n), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(11))
    trainer = Trainer(max_epochs=epochs, accumulate_grad_batches=accumulate, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(module, loader)
    return trainer, flat_weights(module.net).tolist()


def classification_set(n, seed):
    """(features, label, sample index): the index tells which samples a process saw."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g), torch.arange(n))


class Classifier(TrainModule):
    """Logs a torchmetrics accuracy, a synced mean and an unsynced mean in validation; records seen samples."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self.net(x), y)

    def on_validation_epoch_start(self):
        self.seen = []

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        self.val_acc(self.net(x), y)
        self.log("val/acc", self.val_acc)
        self.log("val/x0", x[:, 0].mean(), sync_dist=True)
        self.log("val/x0_local", x[:, 0].mean())
        self.log("val/x0_max", x[:, 0].max(), sync_dist=True, reduce_fx="max")
        self.seen.extend(idx.tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def accuracy(net, ds):
    with torch.no_grad():
        x, y, _ = ds.tensors
        return (net(x).argmax(-1) == y).float().mean().item()


class RankScripted(TrainModule):
    """Validation logs `values[rank][current_epoch]`, unsynced: each process sees its own sequence."""

    def __init__(self, values, name="val/metric"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.values, self.name = values, name

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        return F.mse_loss(self.net(x).squeeze(-1), y.float())

    def validation_step(self, batch, batch_idx):
        self.log(self.name, float(self.values[self.trainer.strategy.global_rank][self.current_epoch]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def small_loader(n=16, batch_size=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, generator=g)), batch_size=batch_size)
