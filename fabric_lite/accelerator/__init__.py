"""The raw door: `Accelerator` and what it prepares (optimizer and scheduler wrappers), Accelerate-compatible
configuration objects, and experiment trackers."""

from fabric_lite.accelerator.accelerator import Accelerator
from fabric_lite.accelerator.enums import DistributedType

__all__ = ["Accelerator", "DistributedType"]
