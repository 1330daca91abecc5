"""Apply a function to every tensor inside a nested batch (dicts, lists, namedtuples, dataclasses)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch


def tree_map(fn: Callable[[torch.Tensor], Any], data: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """Return `data` with `fn` applied to each tensor; `other` (if given) to every other leaf.

    Containers keep their type: a namedtuple stays that namedtuple, a dataclass is rebuilt with
    `dataclasses.replace`, a Mapping subclass is rebuilt from its items.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(tree_map(fn, d, other) for d in data))
        return tuple(tree_map(fn, d, other) for d in data)
    if isinstance(data, list):
        return [tree_map(fn, d, other) for d in data]
    if isinstance(data, Mapping):
        items = [(k, tree_map(fn, v, other)) for k, v in data.items()]
        kind: Callable[..., Any] = type(data)  # the concrete mapping class, called with its items
        try:
            return kind(items)
        except TypeError:  # a Mapping whose constructor takes something else (e.g. BatchEncoding)
            return dict(items)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {f.name: tree_map(fn, getattr(data, f.name), other) for f in dataclasses.fields(data) if f.init}
        return dataclasses.replace(data, **changes)
    return other(data) if other is not None else data


def first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor found in a nested structure (used to read a batch's size)."""
    found: list[torch.Tensor] = []

    def grab(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    tree_map(grab, data)
    return found[0] if found else None


def batch_size_of(batch: Any) -> Optional[int]:
    """The first dimension of a batch's first tensor, or None (no tensor, or a 0-dim one)."""
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):  # the common case
        return int(batch[0].shape[0]) if batch[0].dim() > 0 else None
    t = batch if isinstance(batch, torch.Tensor) else first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else None
