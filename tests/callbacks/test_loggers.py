"""The Trainer's MLflow and wandb loggers, for real: a fit logs to an MLflow tracking server on 127.0.0.1 (SQLite
store, tests/tracker_servers.py) and to an offline wandb run; both are read back with the tool's own reader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from tracker_servers import read_wandb_run, wandb_run_dir


def loader(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]])), batch_size=4)


class Regressor(TrainModule):
    def __init__(self, lr=0.05, schedule=None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class Fails(Regressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def fit(tmp_path, module, loggers, **kwargs):
    trainer = Trainer(default_root_dir=tmp_path, callbacks=list(loggers), max_epochs=2, log_every_n_steps=2,
                      enable_progress_bar=False, enable_checkpointing=False, **kwargs)
    trainer.fit(module, loader(), loader(8, seed=5))
    return trainer


def test_a_fit_logs_to_mlflow_and_wandb(mlflow_server, offline_wandb, tmp_path):
    import mlflow

    mlf = MLFlowLogger(experiment_name="trainer-door", run_name="fit", tracking_uri=mlflow_server, tags={"k": "v"})
    wb = WandbLogger(project="trainer-door", name="fit", save_dir=tmp_path / "wb", offline=True)
    assert all(isinstance(logger, Logger) for logger in (mlf, wb, CSVLogger(), TensorBoardLogger()))
    module = Regressor(lr=0.05, schedule={"kind": "step", "gamma": 0.5})
    fit(tmp_path, module, [mlf, wb])
    train_steps = [2, 4, 6, 8, 10, 12]  # every 2 steps; 6 batches an epoch

    client = mlflow.MlflowClient(mlflow_server)
    assert mlf.experiment is not None and mlf.name == client.get_experiment_by_name("trainer-door").experiment_id
    run = client.get_run(mlf.version)
    assert run.info.status == "FINISHED" and run.info.run_name == "fit" and run.data.tags["k"] == "v"
    assert run.data.params == {"lr": "0.05", "schedule/kind": "step", "schedule/gamma": "0.5"}
    history = client.get_metric_history(mlf.run_id, "train/loss")
    assert [m.step for m in history] == train_steps
    assert [m.value for m in history] == pytest.approx([module.losses[s - 1] for s in train_steps], rel=1e-6)
    assert [m.step for m in client.get_metric_history(mlf.run_id, "val/loss")] == [6, 12]

    recorded = read_wandb_run(wandb_run_dir(tmp_path / "wb", wb.version))
    assert recorded["project"] == "trainer-door" and recorded["name"] == "fit" and recorded["exit_code"] == 0
    assert recorded["config"] == {"lr": 0.05, "schedule": {"kind": "step", "gamma": 0.5}}
    rows = [row for row in recorded["history"] if "train/loss" in row]
    assert [row["trainer/global_step"] for row in rows] == train_steps
    assert [row["train/loss"] for row in rows] == pytest.approx([module.losses[s - 1] for s in train_steps], rel=1e-6)
    assert [row["trainer/global_step"] for row in recorded["history"] if "val/loss" in row] == [6, 12]


def test_a_failed_fit_marks_the_runs_failed(mlflow_server, offline_wandb, tmp_path):
    import mlflow

    mlf = MLFlowLogger(experiment_name="trainer-door", tracking_uri=mlflow_server)
    wb = WandbLogger(save_dir=tmp_path / "wb", offline=True)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, Fails(), [mlf, wb])
    assert mlflow.MlflowClient(mlflow_server).get_run(mlf.run_id).info.status == "FAILED"
    recorded = read_wandb_run(wandb_run_dir(tmp_path / "wb", wb.version))
    assert recorded["project"] == "lightning_logs" and recorded["exit_code"] == 1
    assert [row["trainer/global_step"] for row in recorded["history"]] == [2]


def test_mlflow_logger_without_a_uri_keeps_its_store_in_save_dir(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlf = MLFlowLogger(save_dir=tmp_path / "mlruns")
    mlf.log_hyperparams({"a": {"b": 1}})
    mlf.log_metrics({"x": 1.5}, step=3)
    mlf.finalize("success")
    assert mlf.save_dir == str(tmp_path / "mlruns")
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").get_run(mlf.version)
    assert run.data.params == {"a/b": "1"} and run.data.metrics == {"x": 1.5} and run.info.status == "FINISHED"


def test_loggers_do_nothing_on_other_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    mlf, wb = MLFlowLogger(save_dir=tmp_path / "mlruns"), WandbLogger(save_dir=tmp_path / "wb")
    for logger in (mlf, wb):
        logger.experiment.anything(1, key=2).nested["x"]  # a stand-in that accepts every call
        logger.log_metrics({"x": 1.0}, step=1)
        logger.log_hyperparams({"a": 1})
        logger.finalize("success")
    assert list(tmp_path.iterdir()) == []
