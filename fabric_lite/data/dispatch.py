"""`dispatch_batches`: the main process alone reads the data; every process gets its part of each global batch.

The main process's prepared loader reads each global step whole: its sampler (or dataset shard) yields every
rank's part of the step one after the other, exactly the samples the ranks would read themselves, padding of
the last step included (see `ShardedBatchSampler` and `IterableDatasetShard` with ``rank=None``). The loaded
batch is handed to every process (one broadcast a step, with the loader's position), and each keeps its rows.
So the samples of every step, the loader's position in a checkpoint and its resume are those of the loader
without dispatching, while the dataset is read (and its random transforms drawn) on the main process only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

__all__ = ["Dispatch", "rows_of", "slice_rows"]

_END = object()


class _Unobserved:
    """The gradient state the main process's own reading reports to: the dispatch reports for every process."""

    def enter(self, loader: Any) -> None:
        pass

    def leave(self, loader: Any) -> None:
        pass

    def mark_last(self) -> None:
        pass


_UNOBSERVED = _Unobserved()


def _is_structure(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, Mapping)) or isinstance(obj, (list, tuple)) and \
        any(_is_structure(o) for o in obj)


def rows_of(batch: Any) -> Optional[int]:
    """How many samples a collated batch holds: the first tensor's first dimension (or a list of plain values'
    length); None when it has neither."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return len(batch)  # a column of plain values (strings, numbers): one per sample
        values = list(batch)
    else:
        return None
    for value in values:
        rows = rows_of(value)
        if rows is not None:
            return rows
    return None


def slice_rows(batch: Any, lo: int, hi: int, rows: int) -> Any:
    """Samples lo..hi of a collated batch of `rows` samples: tensors cut along their first dimension, columns of
    plain values cut, mappings and sequences of those cut member by member, anything else kept whole."""
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi] if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        items = {k: slice_rows(v, lo, hi, rows) for k, v in batch.items()}
        kind: Callable[..., Any] = type(batch)  # the concrete mapping class, called with its items
        try:
            return kind(items)
        except TypeError:
            return items
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return batch[lo:hi] if len(batch) == rows else batch
        parts = [slice_rows(v, lo, hi, rows) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    return batch


class Dispatch:
    """How a prepared loader shares its global batches: this process's `rank` among `num_replicas`, each with
    `per_rank` samples of a full step; `even_chunks`: a short last step is cut in ceil(n/W) pieces (a map-style
    loader's `split_batches`), else in pieces of `per_rank`. `broadcast` hands rank 0's object to every rank.
    `slice_fn`: cuts this rank's part instead of `slice_rows`, called as Accelerate's `slice_fn_for_dispatch`
    is: ``slice_fn(batch, slice(lo, hi), process_index=rank, num_processes=num_replicas)``."""

    def __init__(self, rank: int, num_replicas: int, per_rank: int, even_chunks: bool,
                 broadcast: Callable[[Any], Any], slice_fn: Optional[Callable[..., Any]] = None) -> None:
        self.rank = rank
        self.num_replicas = num_replicas
        self.per_rank = per_rank
        self.even_chunks = even_chunks
        self.broadcast = broadcast
        self.slice_fn = slice_fn

    def bounds(self, rows: int) -> Tuple[int, int]:
        """This rank's samples of a global batch of `rows` samples."""
        W, per = self.num_replicas, self.per_rank
        if rows != W * per and self.even_chunks:
            per = math.ceil(rows / W)
        return min(rows, self.rank * per), min(rows, (self.rank + 1) * per)

    def part(self, batch: Any) -> Optional[Any]:
        rows = rows_of(batch)
        if rows is None:
            raise TypeError(
                f"dispatch_batches=True cuts each global batch in the processes' parts along its first dimension, "
                f"but this loader's batches ({type(batch).__name__}) hold no tensor or list of samples. Collate "
                f"batches into tensors (or lists), or use DataLoaderConfiguration(dispatch_batches=False).")
        lo, hi = self.bounds(rows)
        if hi <= lo:
            return None
        if self.slice_fn is not None:
            return self.slice_fn(batch, slice(lo, hi), process_index=self.rank, num_processes=self.num_replicas)
        return slice_rows(batch, lo, hi, rows)

    def iterate(self, loader: Any) -> Iterator[Any]:
        """`loader`'s epoch: read on rank 0 (its own batches, unplaced, not reported), handed out every step
        with rank 0's position, which the other ranks' loaders follow; this rank's part, placed."""
        state = loader.gradient_state
        state.enter(loader)
        source = loader.load_batches(_UNOBSERVED, placed=False) if self.rank == 0 else None
        try:
            while True:
                message = None
                if source is not None:
                    batch = next(source, _END)
                    step = None if batch is _END else (batch, loader.end_of_dataloader)
                    message = (step, loader.epoch, loader.batches_seen)
                step, epoch, seen = self.broadcast(message)
                last = step is not None and step[1]
                if source is None:
                    loader.follow(epoch, seen, last)
                if step is None:
                    return
                if last:
                    state.mark_last()
                mine = self.part(step[0])
                if mine is not None:
                    yield loader.place(mine)
        finally:
            if source is not None:
                source.close()
            state.leave(loader)
