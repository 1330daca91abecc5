"""Accelerate's shard classes (`accelerate.data_loader.BatchSamplerShard`, `IterableDatasetShard`) with Accelerate's
constructor arguments, over fabric_lite's own (`data/sharding.py`), and the metaclass that lets a class answer
`isinstance` for the objects fabric_lite builds in its place.

A prepared loader's batch sampler is a `ShardedBatchSampler` and its iterable dataset an `IterableDatasetShard` of
`data/sharding.py`: both count as instances of the classes here, so a script's ``isinstance(loader.batch_sampler,
BatchSamplerShard)`` reads as it did under Accelerate.
"""

from __future__ import annotations

import itertools
from abc import ABCMeta
from typing import Any, Iterator, List

from torch.utils.data import BatchSampler

from fabric_lite.data import sharding

__all__ = ["AcceptingType", "BatchSamplerShard", "IterableDatasetShard", "check_processes"]


def check_processes(caller: str, num_processes: Any, process_index: Any, default: str = "") -> None:
    """Refuse, naming `caller`'s argument, a process count that is not an int >= 1 or an index outside it.
    `default` says what None would have meant, where the caller takes None."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"{caller}(num_processes={num_processes!r}): give the number of processes, an int >= 1"
                         f"{f' ({default})' if default else ''}.")
    if not isinstance(process_index, int) or not 0 <= process_index < num_processes:
        raise ValueError(f"{caller}(process_index={process_index!r}): give this process's index, an int from 0 to "
                         f"num_processes - 1 = {num_processes - 1}{f' ({default})' if default else ''}.")


class AcceptingType(ABCMeta):
    """The metaclass of a class that also counts, in `isinstance`, the objects its `accepts` (a function of one
    object, set on the class) says yes to."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if super().__instancecheck__(obj):
            return True
        accepts = cls.__dict__.get("accepts")
        return accepts is not None and bool(accepts(obj))


# (a BatchSampler for isinstance checks, whose batch_size may be None: batches of varying size)
class BatchSamplerShard(sharding.ShardedBatchSampler, BatchSampler, metaclass=AcceptingType):  # type: ignore[misc]
    """One process's batches of `batch_sampler` (Accelerate's `BatchSamplerShard`), exactly as Accelerate deals them.

    Without `split_batches`, process p takes batches p, p + W, p + 2W, ... of the sampler (W = `num_processes`);
    with it, piece p of every batch (``batch_size // W`` indices). The batch sampler's `drop_last` drops the last
    global step if it is incomplete; otherwise, with `even_batches`, it is completed with indices from the start
    of the epoch (the first W batches, cycled), so every process gets the same number of full batches; without,
    the processes take what is there (some one batch fewer, or a shorter piece, or none). So on one process too,
    with `even_batches`, a short last batch is completed from the epoch's first indices.

    Over ``BatchSampler(SequentialSampler(range(22)), 3, drop_last=False)`` on 2 processes, process 0 gets
    ``[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]`` and process 1 ``[3, 4, 5], ..., [15, 16, 17], [21, 0, 1]``.

    A batch sampler without a `batch_size` (batches of varying size) is sharded whole batch by batch; with
    `even_batches` the missing batches of the last step are the epoch's first ones.
    """

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        check_processes("BatchSamplerShard", num_processes, process_index)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches and batch_size is None:
            raise ValueError(f"BatchSamplerShard(split_batches=True) cuts each batch by the batch sampler's "
                             f"batch_size, and this {type(batch_sampler).__name__} has none. Use "
                             f"split_batches=False, or a batch sampler with a batch_size.")
        piece = batch_size // num_processes if split_batches and batch_size is not None else None
        super().__init__(batch_sampler, num_processes, process_index, batch_size, split_batches=split_batches,
                         even_batches=even_batches, drop_last=bool(getattr(batch_sampler, "drop_last", False)),
                         split_piece=piece)

    def __iter__(self) -> Iterator[List[int]]:
        batches = super().__iter__()
        if self.num_replicas > 1 or self.drop_last or not self.even_batches or self.batch_size is None:
            return batches
        return self._completed(batches, self.batch_size)

    @staticmethod
    def _completed(batches: Iterator[List[int]], size: int) -> Iterator[List[int]]:
        """One process, `even_batches`: the batches, a short last one completed with the epoch's first indices."""
        head: List[int] = []
        for batch in batches:
            head = head or list(batch)
            if len(batch) < size:
                batch = list(batch) + list(itertools.islice(itertools.cycle(head), size - len(batch)))
            yield batch

    @property
    def total_length(self) -> int:
        """How many batches the wrapped batch sampler makes in an epoch."""
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Tell the wrapped batch sampler (or its sampler) the epoch, where it listens."""
        for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                return

    @staticmethod
    def accepts(obj: Any) -> bool:
        """A prepared loader's own sharded batch sampler counts as a BatchSamplerShard."""
        return isinstance(obj, sharding.ShardedBatchSampler)


class IterableDatasetShard(sharding.IterableDatasetShard, metaclass=AcceptingType):
    """One process's samples of an IterableDataset (Accelerate's `IterableDatasetShard`).

    The dataset is read in chunks of ``batch_size * num_processes`` samples (with `split_batches`: `batch_size`),
    and process p takes slice p of each chunk, in order. A short last chunk is dropped with `drop_last`, else
    completed with the samples the epoch started with. Over ``range(8)`` with ``batch_size=4`` on 2 processes:
    process 0 reads ``0, 1, 2, 3`` and process 1 ``4, 5, 6, 7``; with `split_batches`, ``0, 1, 4, 5`` and
    ``2, 3, 6, 7``. Its length (for a dataset with one) is the number of samples this process reads.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"IterableDatasetShard(batch_size={batch_size!r}): give the batch size, an int >= 1.")
        check_processes("IterableDatasetShard", num_processes, process_index)
        if split_batches and batch_size % num_processes != 0:
            raise ValueError(f"IterableDatasetShard(split_batches=True) cuts each batch of {batch_size} in "
                             f"{num_processes} equal pieces: use a batch_size that is a multiple of {num_processes}, "
                             f"or split_batches=False.")
        super().__init__(dataset, batch_size, num_processes, process_index, split_batches=split_batches,
                         even_batches=True, drop_last=drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.num_replicas > 1:
            return super().__iter__()
        return self._whole_batches()

    def _whole_batches(self) -> Iterator[Any]:
        """One process: the samples in batches of `batch_size`, the short last one dropped or completed."""
        b = self.batch_size
        batch: List[Any] = []
        head: List[Any] = []
        for item in self.dataset:
            batch.append(item)
            if len(batch) == b:
                head = head or batch
                yield from batch
                batch = []
        if batch and not self.drop_last:
            yield from batch + list(itertools.islice(itertools.cycle(head or batch), b - len(batch)))

    def __len__(self) -> int:
        if self.num_replicas > 1:
            return super().__len__()
        whole, tail = divmod(len(self.dataset), self.batch_size)
        return (whole + (1 if tail and not self.drop_last else 0)) * self.batch_size

    @staticmethod
    def accepts(obj: Any) -> bool:
        """A prepared loader's own dataset shard counts as an IterableDatasetShard."""
        return isinstance(obj, sharding.IterableDatasetShard)
