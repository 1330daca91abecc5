"""The Trainer's loggers under the name Lightning users look for (``lightning.pytorch.loggers``):
`Trainer(logger=TensorBoardLogger("runs"))`. They live in `fabric_lite.callbacks.loggers`; MLflow and
Weights & Biases are imported only when their logger is used (extras: ``fabric-lite[mlflow]``, ``[wandb]``)."""

from fabric_lite.callbacks.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "MLFlowLogger", "WandbLogger"]

from fabric_lite.utils.refusals import refused_class  # noqa: E402

_LOGGER_INSTEAD = ("log to TensorBoardLogger, CSVLogger, MLFlowLogger or WandbLogger, or write a Logger subclass "
                   "whose on_log sends the metrics")
CometLogger = refused_class("CometLogger", "logging to Comet", _LOGGER_INSTEAD, base=Logger)
NeptuneLogger = refused_class("NeptuneLogger", "logging to Neptune", _LOGGER_INSTEAD, base=Logger)
__all__ += ["CometLogger", "NeptuneLogger"]
