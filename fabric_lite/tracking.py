"""Accelerate's ``accelerate.tracking`` module path, so ``from fabric_lite.tracking import ...`` works as the script's
``from accelerate.tracking import ...`` did: experiment trackers (GeneralTracker, TensorBoardTracker, ...), from `fabric_lite.accelerator.tracking` (imported on first use)."""

from fabric_lite.module_alias import forward_names

__getattr__, __dir__ = forward_names("fabric_lite.accelerator.tracking", globals())
