"""Moving batches to the device: `move_to_device`, and on CUDA a feed that copies on a stream of its own."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional

import torch

from fabric_lite._tree import tree_map

__all__ = ["move_to_device", "CudaFeed"]


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor (and anything with a ``.to``) in a nested batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if type(batch) in (list, tuple) and all(isinstance(t, torch.Tensor) for t in batch):  # the common case
        return type(batch)(t.to(device, non_blocking=non_blocking) for t in batch)

    def other(obj: Any) -> Any:
        to = getattr(obj, "to", None)
        return to(device) if callable(to) and not isinstance(obj, (str, bytes, type)) else obj

    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch, other)


class CudaFeed:
    """Copies batches to a GPU on a side stream, so batch k+1 travels while step k's kernels run.

    The copy is `non_blocking` (asynchronous from pinned memory), so the host does not wait for the
    kernels queued before it, as a plain `.to(device)` does. The step's stream waits for the copy on
    the GPU (an event), and each moved tensor is marked as used by that stream, so the allocator does
    not hand its memory to the next copy too early. The host waits for copy k only before the loader
    builds batch k+1 (`wait_host`): a loader may refill the host memory that copy k reads from.
    Batches holding CUDA tensors already, or objects with their own `.to`, are moved on the step's
    stream as before.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.event = torch.cuda.Event()
        self.pending = False

    def wait_host(self) -> None:
        if self.pending:
            self.event.synchronize()
            self.pending = False

    def __call__(self, batch: Any, non_blocking: bool = False) -> Any:
        kind: Optional[type] = type(batch)
        leaves: Any = None
        if kind is torch.Tensor:
            leaves = (batch,)
        elif kind is tuple or kind is list:  # the common case: tensors side by side, no tree walk
            leaves = batch
            for t in batch:
                if type(t) is not torch.Tensor:
                    leaves = kind = None
                    break
        if leaves is None:
            leaves, kind = _leaves(batch), None
        for t in leaves:
            # None: an object with its own `.to`; sparse and nested tensors have no `record_stream`
            if t is None or t.is_cuda or t.layout is not torch.strided or t.is_nested:
                return move_to_device(batch, self.device, non_blocking)
        if not leaves:
            return batch
        device = self.device
        step_stream = torch.cuda.current_stream(device)
        torch.cuda.set_stream(self.stream)
        try:
            if kind is torch.Tensor:
                moved = batch.to(device, non_blocking=True)
                moved_leaves: Any = (moved,)
            elif kind is not None:
                moved = moved_leaves = kind(t.to(device, non_blocking=True) for t in batch)
            else:
                moved_leaves = []

                def move(t: torch.Tensor) -> torch.Tensor:
                    t = t.to(device, non_blocking=True)
                    moved_leaves.append(t)
                    return t

                moved = tree_map(move, batch)
        finally:
            torch.cuda.set_stream(step_stream)
        self.event.record(self.stream)
        step_stream.wait_event(self.event)
        self.pending = True
        for t in moved_leaves:
            t.record_stream(step_stream)
        return moved


def _leaves(batch: Any) -> List[Any]:
    """The tensors of a nested batch, and None for each object with its own `.to` (nothing rebuilt)."""
    found: List[Any] = []
    stack = [batch]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (tuple, list)):
            stack.extend(obj)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init)
        elif callable(getattr(obj, "to", None)) and not isinstance(obj, (str, bytes, type)):
            found.append(None)
    return found
