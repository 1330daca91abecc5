"""The Trainer's loggers under the name Lightning users look for (``lightning.pytorch.loggers``):
`Trainer(logger=TensorBoardLogger("runs"))`. They live in `fabric_lite.callbacks.loggers`; MLflow and
Weights & Biases are imported only when their logger is used (extras: ``fabric-lite[mlflow]``, ``[wandb]``)."""

from fabric_lite.callbacks.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "MLFlowLogger", "WandbLogger"]
