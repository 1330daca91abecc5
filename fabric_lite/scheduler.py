"""Accelerate's ``accelerate.scheduler`` module path, so ``from fabric_lite.scheduler import ...`` works as the script's
``from accelerate.scheduler import ...`` did: AcceleratedScheduler, from `fabric_lite.accelerator.wrappers` (imported on first use)."""

from fabric_lite.module_alias import forward_names

__getattr__, __dir__ = forward_names("fabric_lite.accelerator.wrappers", globals())
