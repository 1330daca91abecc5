"""The run the weight-averaging tests share: a small regression fitted with EMAWeightAveraging(decay=0.9), and the
plain loop with a hand-written EMA it must equal."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint

GLOBAL_BATCH, EPOCHS, DECAY, LR = 8, 2, 0.9, 0.1
VAL_WEIGHTS = []  # the weights validation ran with, in this process


def data(n=32):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(5))
    return TensorDataset(x, torch.stack([torch.sin(x.sum(1)), torch.cos(x[:, 0])], 1))


class Regression(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.body(x), y))

    def on_validation_epoch_start(self):  # (the module's hook runs after the callbacks')
        VAL_WEIGHTS.append(flat(self))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def flat(module):
    out = []
    for p in module.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out += p.detach().flatten().tolist()
    return out


class RecordTrained(Callback):
    """The weights trained, at the end of training (before the average is copied in: listed first)."""
    weights = None

    def on_train_end(self, trainer, module):
        RecordTrained.weights = flat(module)


def fit(root, batch_size=GLOBAL_BATCH, strategy="auto", checkpoint_every=None, extra=(), ckpt_path=None, ema=None):
    module = Regression()
    ema = ema or EMAWeightAveraging(decay=DECAY)
    # the checkpoint callback is listed before the average: a save at a step's end still holds that step's update
    checkpoints = [ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1)] \
        if checkpoint_every else []
    trainer = Trainer(max_epochs=EPOCHS, strategy=strategy, callbacks=[RecordTrained(), *checkpoints, ema, *extra],
                      default_root_dir=root, enable_progress_bar=False, enable_checkpointing=bool(checkpoint_every),
                      enable_model_summary=False, logger=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(), batch_size=batch_size), DataLoader(data(8), batch_size=4),
                ckpt_path=ckpt_path)
    return trainer, module, ema, RecordTrained.weights


def plain_loop_with_ema(steps_per_update=1):
    """The same training as a plain loop, with the EMA written out: (trained weights, EMA, EMA at each epoch end)."""
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ema, at_epoch_end, step = None, [], 0
    for _ in range(EPOCHS):
        for x, y in DataLoader(data(), batch_size=GLOBAL_BATCH):
            opt.zero_grad()
            F.mse_loss(model.body(x), y).backward()
            opt.step()
            w = [p.detach().clone() for p in model.parameters()]
            if step % steps_per_update == 0:
                ema = w if ema is None else [DECAY * e + (1 - DECAY) * c for e, c in zip(ema, w)]
            step += 1
        at_epoch_end.append(torch.cat([e.flatten() for e in ema]).tolist())
    return flat(model), torch.cat([e.flatten() for e in ema]).tolist(), at_epoch_end
