"""Runs shared by the spike guard's 2-process worker and the tests' 1-process references: a small regression
whose loss is made NaN on one process at one batch (`bad_rank`, `bad_batch` of epoch `bad_epoch`)."""

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import ModelCheckpoint, SpikeDetection

N, BATCH = 32, 4  # 8 batches on one process, 4 per process on two


def data():
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(5))
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


class Regression(TrainModule):
    def __init__(self, bad_rank=None, bad_epoch=0, bad_batch=None, skip=(), kill_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.bad = (bad_rank, bad_epoch, bad_batch)
        self.skip = set(skip)  # (epoch, batch_idx) a plain loop leaves out: the reference
        self.kill_at = kill_at  # (epoch, batch_idx): raise there, as a killed run stops
        self.seen = []  # (epoch, batch_idx, rank) trained on

    def training_step(self, batch, batch_idx):
        epoch, rank = self.trainer.current_epoch, self.trainer.global_rank
        if (epoch, batch_idx) == self.kill_at:
            raise KeyboardInterrupt("killed")
        self.seen.append([epoch, batch_idx])
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if (epoch, batch_idx) in self.skip:
            return loss * 0.0  # (a plain loop's skipped step: no update, zero gradients -- SGD without momentum)
        if self.bad == (rank, epoch, batch_idx):
            loss = loss + float("nan")  # (finite gradients: only the loss says something went wrong)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def fit(root, module, callbacks, strategy="auto", epochs=2, ckpt_path=None, every_n_train_steps=None, **more):
    checkpointing = every_n_train_steps is not None
    if checkpointing:
        callbacks = callbacks + [ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1,
                                                 every_n_train_steps=every_n_train_steps, async_save=False)]
    trainer = Trainer(max_epochs=epochs, strategy=strategy, callbacks=callbacks, default_root_dir=root,
                      enable_progress_bar=False, enable_checkpointing=checkpointing, enable_model_summary=False,
                      logger=False, num_sanity_val_steps=0, **more)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer


def spike(mode, **kwargs):
    return SpikeDetection(mode=mode, rtol=None, **kwargs)


def raw_loop(bad_rank=None, bad_step=None, skip_step=None, steps=6, check=True):
    """The raw door: watch_losses() and step_is_finite() around a plain loop; returns (flat weights, skipped steps).
    `skip_step`: the plain loop that leaves that step out by hand (the reference)."""
    from fabric_lite import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched, loader = acc.prepare(model, opt, sched, DataLoader(data(), batch_size=BATCH))
    if check:
        acc.watch_losses()
    skipped = []
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        loss = F.mse_loss(model(x), y)
        if (acc.process_index, step) == (bad_rank, bad_step):
            loss = loss + float("nan")
        acc.backward(loss)
        if step == skip_step or (check and not acc.step_is_finite()):
            skipped.append(step)
        else:
            opt.step()
            sched.step()
        opt.zero_grad()
    return flat(acc.unwrap_model(model)), skipped
