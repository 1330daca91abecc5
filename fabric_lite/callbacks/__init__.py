"""Hooks into the Trainer: checkpoints, early stopping, loggers, progress, monitors, timing, finetuning, pruning,
accumulation schedules, prediction writers, weight averaging, spike detection, the tuner's finders.

Weight averaging, spike detection and the finders load on first use (`from fabric_lite.callbacks import
SpikeDetection`): a Trainer that uses none of them does not import them.
"""

from typing import TYPE_CHECKING, Any

from fabric_lite.callbacks.base import Callback
from fabric_lite.callbacks.checkpoint import ModelCheckpoint
from fabric_lite.callbacks.device_stats import DeviceStatsMonitor
from fabric_lite.callbacks.early_stopping import EarlyStopping
from fabric_lite.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from fabric_lite.callbacks.gradient_accumulation import GradientAccumulationScheduler
from fabric_lite.callbacks.lambda_callback import LambdaCallback
from fabric_lite.callbacks.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from fabric_lite.callbacks.on_exception import OnExceptionCheckpoint
from fabric_lite.callbacks.prediction_writer import BasePredictionWriter
from fabric_lite.callbacks.lr_monitor import LearningRateMonitor
from fabric_lite.callbacks.pruning import ModelPruning
from fabric_lite.callbacks.progress import (
    ProgressBar, ProgressBarBase, RichProgressBar, RichProgressBarTheme, TQDMProgressBar,
)
from fabric_lite.callbacks.summary import ModelSummary
from fabric_lite.callbacks.throughput import ThroughputMonitor
from fabric_lite.callbacks.timer import Timer

__all__ = ["Callback", "ModelCheckpoint", "EarlyStopping", "Logger", "TensorBoardLogger", "CSVLogger", "MLFlowLogger",
           "WandbLogger", "LearningRateMonitor", "ProgressBar", "ProgressBarBase", "RichProgressBar",
           "ThroughputMonitor", "ModelSummary", "GradientAccumulationScheduler",
           "Timer", "OnExceptionCheckpoint", "BaseFinetuning", "BackboneFinetuning",
           "DeviceStatsMonitor", "ModelPruning", "TQDMProgressBar", "RichProgressBarTheme", "BasePredictionWriter",
           "LambdaCallback", "WeightAveraging", "EMAWeightAveraging", "StochasticWeightAveraging", "SpikeDetection",
           "TrainingSpikeException", "BatchSizeFinder", "LearningRateFinder"]

# Lightning's callbacks that fabric_lite refuses (they import; building one raises NotSupportedError)
from fabric_lite.callbacks.lightning_refused import Checkpoint, RichModelSummary  # noqa: E402

__all__ += ["RichModelSummary", "Checkpoint"]

# loaded on first use (module __getattr__): name -> module
_ON_FIRST_USE = {
    "BatchSizeFinder": "finders", "LearningRateFinder": "finders",
    "SpikeDetection": "spike", "TrainingSpikeException": "spike",
    "WeightAveraging": "weight_averaging", "EMAWeightAveraging": "weight_averaging",
    "StochasticWeightAveraging": "weight_averaging",
}

if TYPE_CHECKING:
    from fabric_lite.callbacks.finders import BatchSizeFinder, LearningRateFinder
    from fabric_lite.callbacks.spike import SpikeDetection, TrainingSpikeException
    from fabric_lite.callbacks.weight_averaging import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging


def __getattr__(name: str) -> Any:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_lite.callbacks' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"fabric_lite.callbacks.{module}"), name)
    globals()[name] = value
    return value
