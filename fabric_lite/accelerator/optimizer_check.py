"""Refusing an optimizer that trains none of the prepared models: the model would silently never change.

The easy mistake is an optimizer built on another copy of the model (a `copy.deepcopy`, a model created
again after the optimizer was built). Its parameters have the model's shapes but are other tensors. What
is legitimate and looks alike is kept: an optimizer over a standalone parameter (a temperature, a soft
prompt) beside a model that another optimizer trains or that is frozen, and a model kept outside
`prepare` altogether. So an optimizer is refused only when it holds no parameter of any model given to
`prepare` (in this call or before) while a prepared model with trainable parameters is trained by no
optimizer, and either the call is one model with one optimizer, or the optimizer's parameters have that
model's shapes (a copy of it, or of a part of it).

Strategies may replace parameters while preparing (FSDP's DTensors, a move to a lazy device) and then point
the optimizers at the new ones: both the parameters a model was given with and the prepared ones count as
the model's.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["PreparedParameters"]


def _params(optimizer: Any) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _Model:
    """One model given to prepare: its parameters (weakly held, as given and as prepared) and their shapes."""

    def __init__(self, name: str, given: Sequence[torch.Tensor], trained: bool) -> None:
        self.name, self.trained = name, trained
        self.refs: Dict[int, Any] = {}
        self.shapes = Counter(tuple(p.shape) for p in given)
        self.add(given)

    def add(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            self.refs[id(p)] = weakref.ref(p)

    def alive(self) -> List[torch.Tensor]:
        return [p for p in (ref() for ref in self.refs.values()) if p is not None]


class PreparedParameters:
    """The parameters of every model an Accelerator prepared, to check the optimizers it is given."""

    def __init__(self) -> None:
        self.models: List[_Model] = []

    def record(self, given: nn.Module, trained: bool = True) -> "_Model":
        """`given` as passed to prepare, before a strategy set it up; add what prepare made of it to the
        record returned (`.add(list(prepared.parameters()))`). `trained=False`: prepared for evaluation only."""
        entry = _Model(type(given).__name__, list(given.parameters()), trained)
        self.models.append(entry)
        return entry

    def check(self, optimizers: Sequence[Any], models: Sequence[nn.Module] = (), trained_by: Sequence[Any] = (),
              fix: Optional[str] = None) -> None:
        """Refuse (ValueError) an optimizer of `optimizers` that trains none of the models (see the module
        docstring). `models`: the models given with them and not recorded yet; `trained_by`: the optimizers
        prepared before; `fix`: what to do, said in the door's own terms."""
        if not optimizers:
            return
        given = [_Model(type(m).__name__, list(m.parameters()), True) for m in models]
        candidates = given + self.models
        owned = {id(p) for entry in candidates for p in entry.alive()}
        strays = [o for o in optimizers if not any(id(p) in owned for p in _params(o))]
        if not strays:
            return
        held = {id(p) for o in [*optimizers, *trained_by] for p in _params(o)}
        plain = len(given) == 1 and len(optimizers) == 1
        for optimizer in strays:
            shapes = Counter(tuple(p.shape) for p in _params(optimizer))
            for entry in candidates:
                params = entry.alive()
                if not entry.trained or not any(p.requires_grad for p in params) \
                        or any(id(p) in held for p in params):
                    continue  # frozen, for evaluation, or trained by another optimizer
                if (plain and entry is given[0]) or not shapes - entry.shapes:
                    raise ValueError(_refusal(type(optimizer).__name__, entry.name, fix))


def _refusal(optimizer: str, model: str, fix: Optional[str]) -> str:
    fix = fix or (f"build the optimizer on the parameters of the model you pass to prepare, after the model is "
                  f"created (or copied) for the last time: model = {model}(...); optimizer = {optimizer}("
                  f"model.parameters(), ...); model, optimizer = accelerator.prepare(model, optimizer)")
    return (f"The {optimizer} holds none of the parameters of {model}, the model prepared with it, so {model} would "
            f"never train (the optimizer steps other tensors, e.g. those of another copy of the model). Fix: {fix}. "
            f"If {model} is not meant to train, freeze it first with model.requires_grad_(False).")
