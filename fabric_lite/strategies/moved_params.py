"""Parameters a strategy replaced while preparing a model, so optimizers built on the old ones follow.

`fully_shard` turns parameters into DTensors, and a move to a lazy device makes new Parameter objects
(torch cannot swap a lazy tensor into a CPU parameter in place). An optimizer the user built before
`prepare` still holds the old objects: it would step tensors that no longer train. The strategy records
each replacement by parameter name, and points such optimizers at the new parameters.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

__all__ = ["MovedParameters"]


class MovedParameters:
    """The replacements one strategy made: old parameter -> new one (weakly held: nothing is kept alive)."""

    def __init__(self) -> None:
        self._moved: Dict[int, Tuple[Any, nn.Parameter]] = {}

    def record(self, before: Dict[str, nn.Parameter], after: Dict[str, nn.Parameter]) -> None:
        """`before`/`after`: the model's `dict(named_parameters())` before and after the strategy set it up."""
        for name, p in before.items():
            new = after.get(name)
            if new is not None and new is not p:
                self._moved[id(p)] = (weakref.ref(p), new)

    def repoint(self, optimizer: torch.optim.Optimizer, before: str, is_current: Callable[[torch.Tensor], bool],
                strategy: str) -> None:
        """Point `optimizer` at the replacements. `before`: what the old parameters were ("the unsharded model");
        `is_current`: whether a parameter is already of the prepared kind. Refuses, leaving the optimizer as it
        was, one that already stepped on old parameters or holds parameters of no prepared model."""
        moves, stale = [], []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                entry = self._moved.get(id(p))
                if entry is not None and entry[0]() is p:
                    if p in optimizer.state:
                        raise ValueError(
                            f"This optimizer has already stepped on {before}, so its state does not fit the prepared "
                            f"parameters. Create it before the first step and prepare it with the model (or load its "
                            f"state after prepare with load_state).")
                    moves.append((group["params"], i, entry[1]))
                elif not is_current(p) and p.requires_grad:
                    stale.append(tuple(p.shape))
        if stale:
            raise ValueError(
                f"The optimizer holds {len(stale)} parameter(s) (shapes {stale[:4]}) of no model prepared with "
                f"strategy={strategy!r}. Prepare the model first (or in the same prepare() call), then the optimizer.")
        for params, i, new in moves:
            params[i] = new
