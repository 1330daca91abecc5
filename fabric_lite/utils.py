"""Accelerate's `accelerate.utils` names that scripts import, in one place.

The free functions (`gather`, `gather_object`, `reduce`, `broadcast`, `wait_for_everyone`, ...) work on the
current state, with no Accelerator object at hand: the latest `Accelerator`, or the process group a
`PartialState()` started (the first call starts it, from the launch environment, if nothing has).
"""

from __future__ import annotations

import gc
import importlib.util
from typing import Any, Iterable, List, Union

import torch

from fabric_lite.accelerator.configs import (  # noqa: F401
    DataLoaderConfiguration, DistributedDataParallelKwargs, GradientAccumulationPlugin, GradScalerKwargs,
    InitProcessGroupKwargs, KwargsHandler, ProjectConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin,
    TorchDynamoPlugin, DistributedType, LoggerType, PrecisionType, DynamoBackend,
)
from fabric_lite.accelerator.model_state import init_empty_weights, init_on_device  # noqa: F401
from fabric_lite.data.loader import skip_first_batches  # noqa: F401
from fabric_lite.data.transfer import move_to_device
from fabric_lite.seed import set_seed  # noqa: F401


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


# -- whether a package is installed (nothing is imported) ----------------------------------------------
def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_aim_available() -> bool:
    return _installed("aim")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_safetensors_available() -> bool:
    return _installed("safetensors")


def is_rich_available() -> bool:
    return _installed("rich")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available() -> bool:
    return torch.backends.mps.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this machine computes in bfloat16: on CUDA, a GPU that supports it; on Apple's MPS, no; on the
    CPU, yes."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return not torch.backends.mps.is_available()


# -- collectives on the current state --------------------------------------------------------------
def _state() -> Any:
    from fabric_lite.state import PartialState

    return PartialState()


def gather(tensor: Any) -> Any:
    """Concatenate tensors (or nested structures of tensors) from all processes along dim 0."""
    return _state().gather(tensor)


def gather_object(obj: Any) -> List[Any]:
    """Gather picklable objects from all processes: a list from each (concatenated, in rank order), or one
    object each (a list of them)."""
    return _state().gather_object(obj)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce tensors across processes: "mean" (the default here, as Accelerate's function), "sum" or
    "none"."""
    return _state().reduce(tensor, reduction=reduction, scale=scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process gets process `from_process`'s tensors (nested structures too)."""
    return _state().broadcast(tensor, from_process=from_process)


def broadcast_object_list(object_list: List[Any], from_process: int = 0) -> List[Any]:
    """Replace the list's items, on every process, with those of process `from_process` (in place)."""
    return _state().broadcast_object_list(object_list, from_process=from_process)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` to the largest size any process has, so it can be gathered."""
    return _state().pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def wait_for_everyone() -> None:
    """Wait until every process reaches this point."""
    _state().wait_for_everyone()


def send_to_device(tensor: Any, device: Union[str, torch.device], non_blocking: bool = False,
                   skip_keys: Union[None, str, Iterable[str]] = None) -> Any:
    """Move every tensor of a nested structure to `device`; in a mapping, `skip_keys` stay where they are."""
    if skip_keys is not None and isinstance(tensor, dict):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(tensor)({k: v if k in skip else send_to_device(v, device, non_blocking) for k, v in tensor.items()})
    return move_to_device(tensor, torch.device(device), non_blocking=non_blocking)


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True) -> torch.nn.Module:
    """The user's model inside DDP (and, with ``keep_torch_compile=False``, torch.compile) wrappers: what
    `Accelerator.unwrap_model` gives."""
    from fabric_lite.state import current_accelerator

    accelerator = current_accelerator()
    if accelerator is not None:
        return accelerator.unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                        keep_torch_compile=keep_torch_compile)
    while True:  # no run: peel the wrappers of torch's own classes
        inner = None if keep_torch_compile else getattr(model, "_orig_mod", None)
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


def release_memory(*objects: Any) -> List[None]:
    """Drop the references given, collect garbage and empty the device cache; returns Nones to assign back
    (``model, optimizer = release_memory(model, optimizer)``)."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return objects


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm`, shown on the local main process only (`main_process_only=False`: on every process)."""
    from tqdm.auto import tqdm as progress_bar

    if args and isinstance(args[0], bool):  # the older signature: tqdm(main_process_only, iterable, ...)
        main_process_only, args = args[0], args[1:]
    if main_process_only and not kwargs.get("disable", False):
        from fabric_lite.state import process_facts

        kwargs["disable"] = process_facts()["local_process_index"] != 0
    return progress_bar(*args, **kwargs)


__all__ = [
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "KwargsHandler", "ProjectConfiguration", "skip_first_batches", "set_seed",
    "DistributedType", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "LoggerType",
    "PrecisionType", "DynamoBackend", "init_empty_weights", "init_on_device",
    "gather", "gather_object", "reduce", "broadcast", "broadcast_object_list", "pad_across_processes",
    "wait_for_everyone", "send_to_device", "extract_model_from_parallel", "release_memory", "tqdm",
    "is_torch_xla_available", "is_tensorboard_available", "is_wandb_available", "is_comet_ml_available",
    "is_mlflow_available", "is_aim_available", "is_clearml_available", "is_dvclive_available",
    "is_swanlab_available", "is_deepspeed_available", "is_safetensors_available", "is_rich_available",
    "is_datasets_available", "is_transformers_available", "is_cuda_available", "is_mps_available",
    "is_bf16_available",
]
