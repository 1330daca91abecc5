"""Accelerate's ``is_*_available()`` checks and `is_torch_version`. A package check answers whether the package
is installed (`importlib.util.find_spec`) and imports nothing; a device check asks torch. Accelerate's XLA names
(`is_torch_xla_available`, `is_tpu_available`, `install_xla`) are here too, answered by XLA's runtime file."""

from __future__ import annotations

import importlib.util
import operator
from typing import Any, Callable, Dict

import torch

__all__ = ["installed", "is_torch_version", "is_torch_xla_available", "is_tpu_available", "install_xla",
           "is_cuda_available",
           "is_mps_available", "is_bf16_available", "is_fp16_available", "is_fp8_available", "is_xpu_available",
           "is_npu_available", "is_mlu_available", "is_musa_available", "is_sdaa_available", "is_hpu_available",
           "is_ipex_available", "is_torchdata_stateful_dataloader_available", "PACKAGES", "REPORTED_PACKAGES"]


def installed(name: str) -> bool:
    """Whether the module `name` can be imported (found on the path); nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# is_<key>_available() -> whether any of these modules is installed
PACKAGES: Dict[str, tuple] = {
    "aim": ("aim",), "bitsandbytes": ("bitsandbytes",), "boto3": ("boto3",), "clearml": ("clearml",),
    "comet_ml": ("comet_ml",), "datasets": ("datasets",), "deepspeed": ("deepspeed",), "dvclive": ("dvclive",),
    "lomo": ("lomo_optim",), "matplotlib": ("matplotlib",), "megatron_lm": ("megatron",), "mlflow": ("mlflow",),
    "msamp": ("msamp",), "pandas": ("pandas",), "peft": ("peft",), "pippy": ("pippy",), "pynvml": ("pynvml",),
    "pytest": ("pytest",), "rich": ("rich",), "safetensors": ("safetensors",), "sagemaker": ("sagemaker",),
    "schedulefree": ("schedulefree",), "swanlab": ("swanlab",), "tensorboard": ("tensorboard", "tensorboardX"),
    "timm": ("timm",), "torchao": ("torchao",), "torchdata": ("torchdata",), "torchvision": ("torchvision",),
    "trackio": ("trackio",), "transformer_engine": ("transformer_engine",), "transformers": ("transformers",),
    "triton": ("triton",), "wandb": ("wandb",), "import_timer": ("import_timer",), "4bit_bnb": ("bitsandbytes",),
    "8bit_bnb": ("bitsandbytes",), "bnb": ("bitsandbytes",),
}


#: The optional packages `fabric-lite env` reports the versions of: the common ones, and the optional engines'
#: (DeepSpeed's, XLA's runtime).
REPORTED_PACKAGES = ("numpy", "fsspec", "tensorboard", "safetensors", "deepspeed", "torch_xla")


def _package_check(key: str, modules: tuple) -> Callable[[], bool]:
    def check() -> bool:
        return any(installed(m) for m in modules)

    check.__name__ = check.__qualname__ = f"is_{key}_available"
    check.__doc__ = f"Whether {' or '.join(modules)} is installed (nothing is imported)."
    return check


for _key, _modules in PACKAGES.items():
    globals()[f"is_{_key}_available"] = _package_check(_key, _modules)
    __all__.append(f"is_{_key}_available")

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's release (without a local suffix such as ``+cpu``) with `version`:
    ``is_torch_version(">=", "2.1")``."""
    from torch.torch_version import TorchVersion

    if operation not in _OPERATIONS:
        raise ValueError(f"is_torch_version: operation must be one of {list(_OPERATIONS)}, got {operation!r}.")
    return _OPERATIONS[operation](TorchVersion(str(torch.__version__).split("+")[0]), version)


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla can run here (installed, and built for this torch); `check_is_tpu` / `check_is_gpu`: and
    PJRT_DEVICE names a TPU / a GPU (torch_xla itself is not imported: that would start its runtime)."""
    from fabric_lite.strategies.xla_runtime import torch_xla_runs_here

    return torch_xla_runs_here(check_is_tpu, check_is_gpu)


def is_tpu_available(check_device: bool = True) -> bool:
    """Accelerate's older name: torch_xla on a TPU."""
    return is_torch_xla_available(check_is_tpu=True)


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this machine computes in bfloat16: on CUDA, a GPU that supports it; on Apple's MPS, no; on the
    CPU, yes."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return not torch.backends.mps.is_available()


def is_fp16_available() -> bool:
    """float16 mixed precision needs a GPU here (as in Accelerate, which refuses fp16 on the CPU)."""
    return torch.cuda.is_available() or is_xpu_available()


def is_fp8_available() -> bool:
    """Whether an FP8 backend Accelerate knows (torchao, Transformer Engine, MS-AMP) is installed."""
    return any(installed(m) for m in ("torchao", "transformer_engine", "msamp"))


def is_xpu_available(check_device: bool = False) -> bool:
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and bool(xpu.is_available())


def _backend(module: str, attribute: str, check_device: bool) -> bool:
    if not installed(module):
        return False
    if not check_device:
        return True
    device = getattr(torch, attribute, None)  # the backend registers torch.<attribute> once imported
    return bool(device is not None and device.is_available())


def is_npu_available(check_device: bool = False) -> bool:
    return _backend("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    return _backend("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    return _backend("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    return _backend("torch_sdaa", "sdaa", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    return installed("habana_frameworks")


def is_ipex_available() -> bool:
    return installed("intel_extension_for_pytorch")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata with its StatefulDataLoader is installed (looked up on disk; nothing is imported)."""
    import os

    try:
        spec = importlib.util.find_spec("torchdata")
    except (ImportError, ValueError):
        return False
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isdir(os.path.join(p, "stateful_dataloader")) for p in places)


def __getattr__(name: str) -> Any:
    """`install_xla`, Accelerate's torch_xla wheel installer: refused (NotSupportedError naming what to do instead);
    built on first use, so importing this module stays light."""
    if name != "install_xla":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from fabric_lite.utils.refusals import refused

    value = refused("install_xla", "installing torch_xla wheels from a script",
                    "pip install torch_xla matching your torch version (see requirements-xla.txt)")
    globals()[name] = value
    return value
