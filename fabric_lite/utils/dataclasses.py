"""Accelerate's enums of ``accelerate.utils.dataclasses``: `ComputeEnvironment`, `RNGType` (defined with the others in
`fabric_lite.accelerator.enums`), `SageMakerDistributedType`. Like the others they are string enums:
``RNGType.TORCH == "torch"``."""

from __future__ import annotations

from fabric_lite.accelerator.enums import RNGType, StrEnum

__all__ = ["ComputeEnvironment", "RNGType", "SageMakerDistributedType"]


class ComputeEnvironment(StrEnum):
    """Where a run's machines are: this or your own cluster (`LOCAL_MACHINE`), or Amazon SageMaker (which
    `fabric-lite launch` refuses)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(StrEnum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"
