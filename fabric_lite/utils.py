"""Accelerate's `accelerate.utils` names that scripts import, in one place."""

from fabric_lite.accelerator.configs import (  # noqa: F401
    DataLoaderConfiguration, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
    InitProcessGroupKwargs, KwargsHandler, ProjectConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin,
)
from fabric_lite.data.loader import skip_first_batches  # noqa: F401
from fabric_lite.seed import set_seed  # noqa: F401
from fabric_lite.accelerator.configs import DistributedType  # noqa: F401

__all__ = [
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "KwargsHandler", "ProjectConfiguration", "skip_first_batches", "set_seed",
    "DistributedType", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin",
]
