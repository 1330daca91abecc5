"""Accelerate's `accelerate.utils` names that scripts import, in one place."""

from fabric_lite.accelerator.configs import (  # noqa: F401
    DataLoaderConfiguration, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
    InitProcessGroupKwargs, KwargsHandler, ProjectConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin,
)
from fabric_lite.data.loader import skip_first_batches  # noqa: F401
from fabric_lite.seed import set_seed  # noqa: F401
from fabric_lite.accelerator.configs import DistributedType  # noqa: F401

def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla can run here (installed, and built for this torch), as Accelerate's function of the
    name; `check_is_tpu` / `check_is_gpu`: and PJRT_DEVICE names a TPU / a GPU (nothing is imported)."""
    from fabric_lite.strategies.xla import torch_xla_problem

    if torch_xla_problem() is not None:
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    from fabric_lite.strategies.environments import read_xla_settings

    kind = read_xla_settings().pjrt_device  # (asking torch_xla would start its runtime, and set PJRT_DEVICE)
    return (check_is_tpu and kind == "TPU") or (check_is_gpu and kind in ("GPU", "CUDA"))


__all__ = [
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "KwargsHandler", "ProjectConfiguration", "skip_first_batches", "set_seed",
    "DistributedType", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "is_torch_xla_available",
]
