"""A training script driven by TrainerCLI, run by tests/cli/test_trainer_cli.py as users run theirs
(`python trainer_cli_script.py fit --trainer.max_epochs 2 ...`); writes what ran into $RESULT_DIR."""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fabric_lite import DataModule, TrainModule
from fabric_lite.cli import TrainerCLI


class Regressor(TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr
        self.start_step = None

    def on_train_start(self):
        self.start_step = self.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Data(DataModule):
    def __init__(self, batch_size: int = 8, n: int = 64):
        super().__init__()
        self.batch_size = batch_size
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.dataset = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.dataset, batch_size=len(self.dataset))


class RecordingCLI(TrainerCLI):
    """Writes what ran into RESULT_DIR/<subcommand>_rank<r>.json."""

    def record(self):
        t, m = self.trainer, self.model
        opt = t.optimizers[0].optimizer if getattr(t, "optimizers", None) else None
        out = {
            "argv": sys.argv[1:], "seed": self.config[self.subcommand]["seed_everything"], "rank": t.global_rank, "world_size": t.world_size,
            "global_step": t.global_step, "current_epoch": t.current_epoch, "start_step": m.start_step,
            "max_epochs": t.max_epochs, "lr": m.lr, "hidden": m.hparams["hidden"],
            "batch_size": self.datamodule.batch_size, "log_dir": t.log_dir,
            "callbacks": [[type(c).__name__, getattr(c, "monitor", None), getattr(c, "patience", None)]
                          for c in t.callbacks],
            "optimizer": type(opt).__name__ if opt is not None else None,
            "optimizer_lr": opt.param_groups[0]["lr"] if opt is not None else None,
            "schedulers": [type(s.scheduler).__name__ for s in getattr(t, "lr_scheduler_configs", [])],
            "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
            "weights": [p.detach().double().sum().item() for p in m.parameters()],
        }
        path = os.path.join(os.environ["RESULT_DIR"], f"{self.subcommand}_rank{t.global_rank}.json")
        with open(path, "w") as f:
            json.dump(out, f)

    def after_fit(self):
        self.record()

    def after_test(self):
        self.record()


if __name__ == "__main__":
    RecordingCLI(Regressor, Data, trainer_defaults={"enable_progress_bar": False,
                                                     "enable_model_summary": False})
