"""Seeding: `set_seed` (Accelerate's name) and `seed_everything` (Lightning's). The generators themselves, their
state capture and restore and the runtimes' streams are in `fabric_lite.rng_state` (re-exported here)."""

from __future__ import annotations

from typing import Optional

import torch

from fabric_lite.rng_state import add_runtime_rng, capture_rng_state, restore_rng_state, runtime_rng, seed_generators

__all__ = ["set_seed", "seed_everything", "capture_rng_state", "restore_rng_state", "add_runtime_rng", "runtime_rng"]


def set_seed(seed: int, deterministic: bool = False, device_specific: bool = False,
             process_index: Optional[int] = None) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device); returns the seed used.

    `device_specific=True` offsets the seed by `process_index` (default: this process's rank in the
    launch), so ranks draw different numbers. `deterministic=True` also asks torch for deterministic kernels.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}.")
    if device_specific:
        if process_index is None:
            from fabric_lite.strategies.environments import read_launch_environment

            process_index = read_launch_environment().process.global_rank
        seed += process_index
    seed_generators(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return seed


seed_everything = set_seed
