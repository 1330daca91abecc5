"""Accelerate's ``accelerate.optimizer`` module path, so ``from fabric_lite.optimizer import ...`` works as the script's
``from accelerate.optimizer import ...`` did: AcceleratedOptimizer, from `fabric_lite.accelerator.wrappers` (imported on first use)."""

from fabric_lite.module_alias import forward_names

__getattr__, __dir__ = forward_names("fabric_lite.accelerator.wrappers", globals())
