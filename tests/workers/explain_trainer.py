"""A trainer-door script for `fabric-lite explain`: Trainer(devices=2) would start itself again on two
processes; a marker file after fit() tells a test whether training ran."""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, make_model
from fabric_lite import Trainer, TrainModule

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Classifier(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, idx = batch
        return F.cross_entropy(self.net(x), idx % 3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = Trainer(devices=2, accelerator="cpu", max_epochs=2, accumulate_grad_batches=3, limit_val_batches=5,
                  default_root_dir=str(Path(args.out, "root")), enable_progress_bar=False)
trainer.fit(Classifier(), DataLoader(IndexDataset(30), batch_size=5))
Path(args.out, "trained.marker").write_text("fit ran\n")
