"""The string enums of Accelerate's names (`DistributedType`, `LoggerType`, `PrecisionType`, `DynamoBackend`,
`DDPCommunicationHookType`, `RNGType`) and their base `StrEnum`: plain values, importable without the configuration
objects. Accelerate's device names (XLA, TPU, ...) live here as members, whatever fabric_lite runs."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["StrEnum", "DDPCommunicationHookType", "DistributedType", "LoggerType", "PrecisionType", "DynamoBackend",
           "RNGType"]


class StrEnum(str, enum.Enum):
    """An enum whose members are their string values: ``LoggerType.WANDB == "wandb"``, and ``str()`` and
    f-strings give the value, so a member goes wherever the plain string is accepted (and into JSON)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)

    @classmethod
    def list(cls) -> list:
        """The members' values."""
        return [member.value for member in cls]


class _ValuesContained(enum.EnumMeta):
    """`"fp16" in DDPCommunicationHookType` is True: a value counts as contained (as in Accelerate)."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class DDPCommunicationHookType(StrEnum, metaclass=_ValuesContained):
    """How DDP reduces gradients, for `DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)`: NO (plain
    all-reduce), FP16 / BF16 (compressed to half precision), POWER_SGD / BATCHED_POWER_SGD (low-rank PowerSGD).
    ``DDPCommunicationHookType("power_sgd")`` (any case) gives the member."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        text = str(value).strip().lower() if isinstance(value, str) else None
        for member in cls:
            if member.value == text:
                return member
        return None


class DistributedType(StrEnum):
    """The kind of run, with Accelerate's names; each member equals its name as a string
    (``accelerator.distributed_type == "MULTI_GPU"`` and ``== DistributedType.MULTI_GPU`` both work)."""

    NO = "NO"  # one process
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"  # a name only: fabric_lite has no Megatron-LM
    TPU = "XLA"  # the older name of XLA (an alias: DistributedType.TPU is DistributedType.XLA)


class LoggerType(StrEnum):
    """Experiment tracker names for `Accelerator(log_with=...)`; each member is the tracker's plain name."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class PrecisionType(StrEnum):
    """`mixed_precision` values."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class DynamoBackend(StrEnum):
    """Common `torch.compile` backend names for `dynamo_backend` / `TorchDynamoPlugin(backend=...)` (any name
    torch knows is accepted as a plain string too); NO turns compilation off."""

    NO = "no"
    EAGER = "eager"
    AOT_EAGER = "aot_eager"
    INDUCTOR = "inductor"
    CUDAGRAPHS = "cudagraphs"
    ONNXRT = "onnxrt"
    TENSORRT = "tensorrt"
    OPENXLA = "openxla"
    TVM = "tvm"


class RNGType(StrEnum):
    """A random number generator that Accelerate's `rng_types` names. fabric_lite seeds and saves every one of
    them itself (the data order is seeded and the same on every process), so `rng_types` is accepted and not
    needed; `synchronize_rng_state` takes these names."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    GENERATOR = "generator"
