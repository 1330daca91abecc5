"""`Trainer(devices=2)` in a script started with plain `python`: it starts itself again on 2 processes.

Each process prints `RANK r OF w STEPS s PORT p ARGS <its own arguments>` (its lines may interleave with the
other's: the tests look for both anywhere in the output)."""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule


class M(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


if __name__ == "__main__":
    trainer = Trainer(max_epochs=1, devices=2, accelerator="cpu", strategy="ddp", enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=os.getcwd())
    trainer.fit(M(), DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4))
    print(f"RANK {trainer.strategy.global_rank} OF {trainer.world_size} STEPS {trainer.global_step} "
          f"PORT {os.environ['MASTER_PORT']} ARGS {' '.join(sys.argv[1:])}")
