"""Accelerate's ``accelerate.parallelism_config`` module path, so ``from fabric_lite.parallelism_config import
ParallelismConfig`` works as the script's ``from accelerate.parallelism_config import ...`` did: from
`fabric_lite.accelerator.parallelism` (imported on first use)."""

from fabric_lite.module_alias import forward_names

__getattr__, __dir__ = forward_names("fabric_lite.accelerator.parallelism", globals())
