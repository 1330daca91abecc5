"""Python's, NumPy's and torch's CPU random states, taken cheaply where they are taken often (every batch)
and turned into checkpoint form only when a checkpoint asks for them."""

from __future__ import annotations

import random
from typing import Any, Dict, Union

import numpy as np
import torch

from fabric_lite.rng_state import restore_rng_state

__all__ = ["HostRngStates", "checkpointable", "restore"]


class HostRngStates:
    """The three global host generators' states, in picklable plain types (a tensor would cross a worker's
    queue through shared memory, which costs more than these few KB of bytes)."""

    __slots__ = ("python", "numpy", "torch")

    def __init__(self) -> None:
        self.python = random.getstate()
        self.numpy = np.random.get_state(legacy=True)  # the global MT19937's: always the tuple form
        self.torch = torch.get_rng_state().numpy().tobytes()

    def checkpointable(self) -> Dict[str, Any]:
        """In `fabric_lite.seed.capture_rng_state`'s format (what `torch.load(weights_only=True)` reads)."""
        version, internal, gauss = self.python
        numpy_state = self.numpy
        assert isinstance(numpy_state, tuple)
        _, keys, pos, has_gauss, cached = numpy_state
        return {"python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
                "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "torch": torch.frombuffer(bytearray(self.torch), dtype=torch.uint8)}

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(torch.frombuffer(bytearray(self.torch), dtype=torch.uint8))


def checkpointable(states: Any) -> Any:
    """States taken here, or already in checkpoint form (loaded), as a checkpoint stores them."""
    return states.checkpointable() if isinstance(states, HostRngStates) else states


def restore(states: Union[HostRngStates, Dict[str, Any]]) -> None:
    if isinstance(states, HostRngStates):
        states.restore()
    else:
        restore_rng_state(states)
