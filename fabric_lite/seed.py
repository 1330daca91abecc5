"""Seeding and capturing every random number generator a training step touches."""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch

__all__ = ["set_seed", "seed_everything", "capture_rng_state", "restore_rng_state", "xla_runtime_started"]

# The XLA random stream is touched only once an XLA strategy started the runtime in this process: before that,
# asking torch_xla for it would start the runtime itself (too early for SPMD, and for torch_xla's launcher), and
# a process that merely imported torch_xla does not train on XLA. A seed set before (set_seed, then
# Accelerator(accelerator="tpu")) is applied when the runtime starts: set_seed's place in a script does not matter.
_xla_started = False
_xla_seed_pending: Optional[int] = None


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
            from fabric_lite.strategies.environments import detect_process

            process_index = detect_process().global_rank
        seed += process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    global _xla_seed_pending
    xm = _xla_model()
    if xm is not None:
        xm.set_rng_state(seed)
    _xla_seed_pending = None if xm is not None else seed
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return seed


seed_everything = set_seed


def capture_rng_state() -> Dict[str, Any]:
    """Every RNG state of this process, in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "python": _python_state_to_tensor(random.getstate()),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    xm = _xla_model()
    if xm is not None:
        state["xla"] = int(xm.get_rng_state())
    return state


def xla_runtime_started() -> None:
    """Called by the XLA strategy once it started the runtime: from now on the XLA random stream is seeded,
    saved and restored with the others; the seed `set_seed` was given before, if any, is applied now."""
    global _xla_started, _xla_seed_pending
    _xla_started = True
    xm = _xla_model()
    if xm is not None and _xla_seed_pending is not None:
        xm.set_rng_state(_xla_seed_pending)
        _xla_seed_pending = None


def _xla_model() -> Any:
    """torch_xla's xla_model where an XLA strategy started the runtime in this process, else None."""
    if not _xla_started:
        return None
    import torch_xla.core.xla_model as xm

    return xm


def _python_state_to_tensor(state: tuple) -> Dict[str, Any]:
    # 625 Python ints pickle one by one (about a millisecond per checkpoint); one tensor does not.
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def restore_rng_state(state: Dict[str, Any]) -> None:
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
    xla = state.get("xla")
    xm = _xla_model() if xla is not None else None
    if xm is not None:
        xm.set_rng_state(int(xla))
