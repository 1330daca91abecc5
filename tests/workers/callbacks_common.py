"""Runs shared by the callbacks' 2-process worker and the 1-process references its test builds."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import BackboneFinetuning, GradientAccumulationScheduler, ModelPruning


def data(n=32):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(5))
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


class WithBackbone(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def fit(root, batch_size, callbacks, strategy="auto", epochs=3):
    """Fit WithBackbone on `data()` in order with `callbacks`; returns (trainer, flat weights)."""
    module = WithBackbone()
    trainer = Trainer(max_epochs=epochs, strategy=strategy, callbacks=callbacks, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, logger=False)
    trainer.fit(module, DataLoader(data(), batch_size=batch_size))
    return trainer, flat(module)


def finetuning():
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)]


def accumulation():
    return [GradientAccumulationScheduler({0: 2, 2: 1})]


def pruning():
    return [ModelPruning("l1_unstructured", amount=0.3, parameter_names=["weight"])]
