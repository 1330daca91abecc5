"""fabric_lite: PyTorch training with two front doors over one engine.

Names are imported on first use, so `import fabric_lite` costs almost nothing beyond torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

if "FABRIC_LITE_LAUNCHER_PID" in os.environ:  # a worker of `fabric-lite launch`: it dies with the launcher
    from fabric_lite.launch.lifeline import follow_launcher

    follow_launcher()

_EXPORTS = {
    "Accelerator": "fabric_lite.accelerator.accelerator",
    "DistributedType": "fabric_lite.accelerator.enums",
    "notebook_launcher": "fabric_lite.launch.launcher",
    "set_seed": "fabric_lite.seed",
    "seed_everything": "fabric_lite.seed",
    "skip_first_batches": "fabric_lite.data.loader",
    "DistributedDataParallelKwargs": "fabric_lite.accelerator.configs",
    "GradScalerKwargs": "fabric_lite.accelerator.configs",
    "InitProcessGroupKwargs": "fabric_lite.accelerator.configs",
    "DataLoaderConfiguration": "fabric_lite.accelerator.configs",
    "ProjectConfiguration": "fabric_lite.accelerator.configs",
    "GradientAccumulationPlugin": "fabric_lite.accelerator.configs",
    "DeepSpeedPlugin": "fabric_lite.accelerator.configs",
    "FullyShardedDataParallelPlugin": "fabric_lite.accelerator.configs",
    "TorchDynamoPlugin": "fabric_lite.accelerator.configs",
    "ParallelismConfig": "fabric_lite.accelerator.parallelism",
    "LoggerType": "fabric_lite.accelerator.enums",
    "PartialState": "fabric_lite.state",
    "AcceleratorState": "fabric_lite.state",
    "init_empty_weights": "fabric_lite.accelerator.model_state",
    "init_on_device": "fabric_lite.accelerator.model_state",
    "Strategy": "fabric_lite.strategies",
    "SingleDeviceStrategy": "fabric_lite.strategies",
    "DDPStrategy": "fabric_lite.strategies",
    "DeepSpeedStrategy": "fabric_lite.strategies.deepspeed",
    "FSDPStrategy": "fabric_lite.strategies.fsdp",
    "Trainer": "fabric_lite.trainer.trainer",
    "TrainModule": "fabric_lite.trainer.module",
    "DataModule": "fabric_lite.trainer.module",
    "EXIT_PREEMPTED": "fabric_lite.launch.preemption",
    "Callback": "fabric_lite.callbacks.base",
    # Accelerate's other top-level names (each imported on first use, from where it is defined)
    "debug_launcher": "fabric_lite.launch.debug",
    "GradientState": "fabric_lite.state",
    "DDPCommunicationHookType": "fabric_lite.accelerator.enums",
    "AutocastKwargs": "fabric_lite.accelerator.precision_handlers",
    "ProfileKwargs": "fabric_lite.accelerator.profiling",
    "find_executable_batch_size": "fabric_lite.accelerator.memory",
    "is_rich_available": "fabric_lite.utils.imports",
    "synchronize_rng_states": "fabric_lite.utils.rng",
    "load_checkpoint_in_model": "fabric_lite.utils.modeling",
    "cpu_offload": "fabric_lite.big_modeling",
    "cpu_offload_with_hook": "fabric_lite.big_modeling",
    "disk_offload": "fabric_lite.big_modeling",
    "dispatch_model": "fabric_lite.big_modeling",
    "infer_auto_device_map": "fabric_lite.big_modeling",
    "load_checkpoint_and_dispatch": "fabric_lite.big_modeling",
    "prepare_pippy": "fabric_lite.inference",
}

# Lightning's spellings of the trainer door's names, for code written `import lightning as L` (`L.LightningModule`)
_ALIASES = {
    "LightningModule": ("fabric_lite.trainer.module", "TrainModule"),
    "LightningDataModule": ("fabric_lite.trainer.module", "DataModule"),
}

#: the subpackages `L.callbacks.EarlyStopping`-style code reaches through the package (imported on first use)
_SUBPACKAGES = ("callbacks", "loggers", "strategies", "trainer", "accelerator", "utils", "cli", "data")

__all__ = ["__version__", *_EXPORTS, *_ALIASES]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _ALIASES:
        module, target = _ALIASES[name]
        value = getattr(importlib.import_module(module), target)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'fabric_lite' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(__all__)
