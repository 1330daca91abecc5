"""Accelerate's enums that `fabric_lite.accelerator.enums` does not define: `ComputeEnvironment`, `RNGType`,
`SageMakerDistributedType`. Like the others they are string enums: ``RNGType.TORCH == "torch"``."""

from __future__ import annotations

from fabric_lite.accelerator.enums import StrEnum

__all__ = ["ComputeEnvironment", "RNGType", "SageMakerDistributedType"]


class ComputeEnvironment(StrEnum):
    """Where a run's machines are: this or your own cluster (`LOCAL_MACHINE`), or Amazon SageMaker (which
    `fabric-lite launch` refuses)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


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


class SageMakerDistributedType(StrEnum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"
