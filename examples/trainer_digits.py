"""A Lightning-style Trainer run on scikit-learn's handwritten digits: TensorBoard logs, checkpoints, early stopping.

    python examples/trainer_digits.py                                  # one process
    fabric-lite launch --nproc-per-node 2 examples/trainer_digits.py   # DDP on 2 processes
"""

import argparse

import torch
import torch.nn.functional as F
import torchmetrics
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.callbacks import CSVLogger, EarlyStopping, LearningRateMonitor, ModelCheckpoint, TensorBoardLogger


class DigitClassifier(TrainModule):
    def __init__(self, hidden: int = 128, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(hidden, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def loaders(batch_size):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, valid = order[:1500], order[1500:]
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[valid], y[valid]), batch_size=64))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--root", default="runs/trainer_digits")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    set_seed(0)
    train_loader, val_loader = loaders(args.batch_size)
    trainer = Trainer(
        max_epochs=args.epochs, precision=args.precision, default_root_dir=args.root, log_every_n_steps=10,
        callbacks=[TensorBoardLogger(args.root, name="logs"), CSVLogger(args.root, name="csv"),
                   ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=2, save_last=True),
                   EarlyStopping(monitor="val/loss", patience=3), LearningRateMonitor()],
    )
    trainer.fit(DigitClassifier(), train_loader, val_loader, ckpt_path="last")
    if trainer.is_global_zero:
        print(f"val/acc {float(trainer.callback_metrics['val/acc']):.3f} after {trainer.global_step} steps; "
              f"best checkpoint: {trainer.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main()
