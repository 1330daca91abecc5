"""Every random number generator a training step touches: seeding them, capturing and restoring their state,
and the device runtimes' own streams (added once a runtime started in this process)."""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

__all__ = ["seed_generators", "capture_rng_state", "restore_rng_state", "add_runtime_rng", "runtime_rng"]

# A device runtime's random stream, by name: (get_state, set_state), added by the runtime once it started in this
# process (before that, asking for it could start the runtime itself, too early). A seed set before (set_seed, then
# the Accelerator) is applied when the stream is added: set_seed's place in a script does not matter.
_RUNTIME_RNGS: Dict[str, Tuple[Callable[[], int], Callable[[int], None]]] = {}
_seed_pending: Optional[int] = None


def seed_generators(seed: int) -> None:
    """Seed python, numpy, torch (CPU and every CUDA device) and every runtime stream added; a stream added
    later gets this seed when it is added."""
    global _seed_pending
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    for _, set_state in _RUNTIME_RNGS.values():
        set_state(seed)
    _seed_pending = None if _RUNTIME_RNGS else seed


def capture_rng_state() -> Dict[str, Any]:
    """Every RNG state of this process, in types `torch.load(weights_only=True)` accepts."""
    np_state: Any = np.random.get_state()  # the legacy tuple: (name, keys, pos, has_gauss, cached_gaussian)
    state: Dict[str, Any] = {
        "python": _python_state_to_tensor(random.getstate()),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    for name, (get_state, _) in _RUNTIME_RNGS.items():
        state[name] = int(get_state())
    return state


def add_runtime_rng(name: str, get_state: Callable[[], int], set_state: Callable[[int], None]) -> None:
    """Called by a device runtime once it started: from now on its random stream `name` is seeded, saved and
    restored with the others; the seed `set_seed` was given before, if any, is applied now."""
    global _seed_pending
    _RUNTIME_RNGS[name] = (get_state, set_state)
    if _seed_pending is not None:
        set_state(_seed_pending)
        _seed_pending = None


def runtime_rng(name: str) -> Optional[Tuple[Callable[[], int], Callable[[int], None]]]:
    """The (get_state, set_state) of the runtime's random stream `name` started in this process, or None."""
    return _RUNTIME_RNGS.get(name)


def _python_state_to_tensor(state: tuple) -> Dict[str, Any]:
    # 625 Python ints pickle one by one (about a millisecond per checkpoint); one tensor does not.
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Put back every RNG state `capture_rng_state` returned (runtime streams present in both)."""
    python = state["python"]
    if isinstance(python, dict):
        python = (python["version"], python["internal"].tolist(), python["gauss"])
    version, internal, gauss = python
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda: Optional[list] = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    for name, (_, set_state) in _RUNTIME_RNGS.items():
        if state.get(name) is not None:
            set_state(int(state[name]))
