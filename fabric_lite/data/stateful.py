"""Iterable datasets that keep their own position: saved and restored instead of re-read.

A *source with state* is an IterableDataset with ``state_dict()`` and ``load_state_dict(state)`` (a torchdata
``Stateful``, an HF ``datasets.IterableDataset``, a dataset of the user's own): ``state_dict()``, called while it
is being iterated, says where its iteration is; ``load_state_dict(state)`` makes its next iteration go on from
there. A prepared loader over such a dataset takes a snapshot of the dataset's state with every batch, in the
process that reads it (the main process, or the worker that collated the batch: each worker holds its own copy
of the dataset), and carries it with the batch; the loader keeps, for every worker, the snapshot of the last
batch it handed out, and which worker hands out the next one. A checkpoint holds those; a resumed run starts
each worker with its saved state, and the workers whose turn had already passed in the round robin first hand
out one placeholder batch each, which the loader drops: the batches then come in the uninterrupted run's order,
and no item before the saved position is read again.

On another number of processes: a dataset every rank reads whole (the prepared loader takes each rank's slice
of it, see `IterableDatasetShard`) is at the same state on every rank, and that state goes on over the new
ranks. A `ShardedStream` (a list of shards split over the ranks and their workers) re-deals the shards and
offsets it has left over the new readers, so that each remaining item is read exactly once. Any other source
whose saved states differ between ranks, or that changes its number of workers, cannot say what is left, and is
refused with the reason.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from fabric_lite.data.sharding import IterableDatasetShard

__all__ = ["ShardedStream", "has_state", "SourceSnapshots", "SnapshotCollate", "Placeholder", "StartPlan"]


def has_state(obj: Any) -> bool:
    """Whether `obj` keeps a position of its own (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class ShardedStream(IterableDataset):
    """A stream made of a list of shards (files, URLs, ...) split over the processes and their workers.

    ``read_shard(shard, start)`` yields the items of `shard` from its item number `start` on (a file reader
    seeks or skips lines without building the items before `start`). Reader ``k`` of ``R`` (``R`` = processes x
    workers, ``k = rank * num_workers + worker``) reads shards ``k, k + R, ...`` in turn. A prepared loader tells
    the stream its rank and number of processes (`assign`) and does not slice its items further: every process
    reads its own shards. ``state_dict()`` is the reader's shards still to read, each with the items already
    read; a resumed run deals what every reader had left over its own readers (any number of processes or
    workers): each remaining item is read once. With the same readers, each goes on with its own shards.

    Ranks should hold the same number of items (shards of equal size, a multiple of the readers): a rank that
    runs out first ends its epoch first, as with any stream split by rank. `shard_sizes` (each shard's number of
    items, where known) lets a resume on other readers balance what is left between the processes (then between
    each one's workers); without it the shards left are dealt in turn, which a resumed epoch may leave uneven.
    """

    def __init__(self, shards: Sequence[Any], read_shard: Callable[[Any, int], Iterable[Any]],
                 shard_sizes: Optional[Sequence[int]] = None) -> None:
        self.shards = list(shards)
        self.read_shard = read_shard
        if shard_sizes is not None and len(shard_sizes) != len(self.shards):
            raise ValueError(f"ShardedStream got {len(shard_sizes)} shard_sizes for {len(self.shards)} shards.")
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        self.rank = 0
        self.num_replicas = 1
        self._start: Optional[List[Tuple[int, int]]] = None  # loaded: the shards (and offsets) the next pass reads
        self._left: List[List[int]] = []  # the current pass: [shard, items read] still to finish, in order

    def assign(self, rank: int, num_replicas: int) -> None:
        """Read as process `rank` of `num_replicas` (what a prepared loader calls)."""
        self.rank, self.num_replicas = rank, num_replicas

    def reader(self) -> Tuple[int, int]:
        """(this reader's number, the number of readers): over the processes and the current process's workers."""
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * nw + w, self.num_replicas * nw

    def initial_state(self, reader: int, readers: int) -> Dict[str, Any]:
        """The state of reader `reader` of `readers` at the start of a pass: its shards, none read."""
        return {"num_shards": len(self.shards), "left": [(i, 0) for i in range(reader, len(self.shards), readers)]}

    def state_dict(self) -> Dict[str, Any]:
        return {"num_shards": len(self.shards), "left": [(i, n) for i, n in self._left]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("num_shards")
        if saved != len(self.shards):
            raise ValueError(f"This ShardedStream has {len(self.shards)} shards; the state loaded was saved by one "
                             f"with {saved}. Resume with the same shard list.")
        self._start = [(int(i), int(n)) for i, n in state["left"]]

    def deal(self, states: List[Dict[str, Any]], ranks: int, workers: int = 1) -> List[Dict[str, Any]]:
        """What `states` (every reader's, in reader order) have left, dealt over `ranks` x `workers` readers (rank
        major): as they are when their number is the same; else, with `shard_sizes`, balanced between the ranks
        then between each rank's workers (the most items left first, to the reader with the fewest); without, the
        shards in order, in turn."""
        if len(states) == ranks * workers:
            return [dict(s) for s in states]
        count = len(self.shards)
        if any(s["num_shards"] != count for s in states):
            raise ValueError(f"The saved ShardedStream states are for another number of shards than this stream's "
                             f"{count}. Resume with the same shard list.")
        left = sorted((int(i), int(n)) for s in states for i, n in s["left"])
        sizes = self.shard_sizes
        if sizes is not None:
            left = [(i, n) for i, n in left if n < sizes[i]]
        readers: List[List[Tuple[int, int]]] = []
        for part in self._split(left, ranks):
            readers += [sorted(p) for p in self._split(part, workers)]
        return [{"num_shards": count, "left": r} for r in readers]

    def _split(self, left: List[Tuple[int, int]], parts: int) -> List[List[Tuple[int, int]]]:
        sizes = self.shard_sizes
        if sizes is None:
            return [left[k::parts] for k in range(parts)]
        bins: List[List[Tuple[int, int]]] = [[] for _ in range(parts)]
        load = [0] * parts
        for i, n in sorted(left, key=lambda e: (-(sizes[e[0]] - e[1]), e[0])):
            k = load.index(min(load))
            bins[k].append((i, n))
            load[k] += sizes[i] - n
        return bins

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, None  # (one pass: the next one starts afresh)
        if start is None:
            reader, readers = self.reader()
            start = self.initial_state(reader, readers)["left"]
        self._left = [[i, n] for i, n in start]
        return self._items()

    def _items(self) -> Iterator[Any]:
        while self._left:
            entry = self._left[0]
            for item in self.read_shard(self.shards[entry[0]], entry[1]):
                entry[1] += 1
                yield item
            self._left.pop(0)


class Placeholder:
    """An item of a placeholder batch (a resumed worker whose turn has passed): collated to a batch that the
    loader drops."""


class StartPlan:
    """How the next iteration of a source starts: each worker's state to load (None: as it is), and how many
    workers first hand out a placeholder batch of `lead_items` items."""

    def __init__(self, states: List[Any], lead_workers: int, lead_items: int) -> None:
        self.states = states
        self.lead_workers = lead_workers
        self.lead_items = lead_items

    def begin(self, dataset: Any) -> int:
        """In the reading process, before its pass: load this worker's state; the placeholder items it yields first."""
        info = get_worker_info()
        w = info.id if info is not None else 0
        state = self.states[w] if w < len(self.states) else None
        if state is not None:
            dataset.load_state_dict(state)
        return self.lead_items if w < self.lead_workers else 0

    @staticmethod
    def placeholder() -> Placeholder:
        return Placeholder()


class SnapshotCollate:
    """The collate_fn, run where the batch is loaded: (batch, (worker, the dataset's state right after it, False));
    a placeholder batch collates to (None, (worker, None, True))."""

    def __init__(self, collate: Callable[[Any], Any], dataset: Any) -> None:
        self.collate = collate
        self.dataset = dataset  # the main process's (no workers); a worker reads its own copy

    def __call__(self, items: Any) -> Any:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if items and isinstance(items[0], Placeholder):
            return None, (worker, None, True)
        batch = self.collate(items)
        dataset = info.dataset if info is not None else self.dataset
        return batch, (worker, source_of(dataset).state_dict(), False)


def source_of(dataset: Any) -> Any:
    """The user's dataset inside a prepared loader's dataset (an `IterableDatasetShard`'s)."""
    return dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset


class SourceSnapshots:
    """What a prepared loader knows of its source's position (see the module docstring): each worker's state
    after the last batch it handed out (None: as at the epoch's start), and whose turn is next."""

    def __init__(self, source: Any, num_workers: int, what: str) -> None:
        self.source = source
        self.slots = max(1, num_workers)
        self.what = what
        self.sharded = isinstance(source, ShardedStream)
        self.reads = True  # False: a process that reads nothing itself (dispatch_batches, not the main process)
        self.states: List[Any] = [None] * self.slots
        self.next_worker = 0
        self.start: Optional[StartPlan] = None  # loaded, for the next iteration
        self.fifo: List[Any] = []  # snapshots of batches loaded and not yet handed out

    def end_epoch(self) -> None:
        self.states, self.next_worker, self.start, self.fifo = [None] * self.slots, 0, None, []

    def batches(self, loaded: Iterator[Any]) -> Iterator[Any]:
        """The batches of a loader whose collate is a `SnapshotCollate`, placeholders dropped; the snapshots kept
        until `handed_out`."""
        for batch, (worker, state, placeholder) in loaded:
            if not placeholder:
                self.fifo.append((worker, state))
                yield batch

    def handed_out(self) -> None:
        """The oldest batch loaded is handed out: its worker's state is now the one to resume from."""
        if self.fifo:
            worker, state = self.fifo.pop(0)
            self.states[worker] = state
            self.next_worker = (worker + 1) % self.slots

    def state(self) -> Dict[str, Any]:
        states = list(self.states)
        if self.sharded and self.reads:
            reader, readers = self.source.rank * self.slots, self.source.num_replicas * self.slots
            states = [s if s is not None else self.source.initial_state(reader + w, readers)
                      for w, s in enumerate(states)]
        return {"kind": "sharded" if self.sharded else "state", "num_workers": self.slots, "reads": self.reads,
                "states": states, "next_worker": self.next_worker}

    def load(self, own: Optional[Dict[str, Any]], ranks: Optional[List[Any]], lead_items: int) -> None:
        """Plan the next iteration from this process's saved state (`own`, the same number of processes) or every
        saved process's (`ranks`, another number); refuses (ValueError, saying why) what cannot go on."""
        self.fifo = []
        self.start = None
        if not self.reads:
            return
        if ranks is not None:
            readers = [s for s in ranks if isinstance(s, dict) and s.get("reads")]
            if not readers:
                return
            if self.sharded:
                every = [s for r in readers for s in r["states"]]
                dealt = self.source.deal(every, self.source.num_replicas, self.slots)
                first = self.source.rank * self.slots
                self._plan(dealt[first:first + self.slots], 0, lead_items)
                return
            first = readers[0]
            if any(not _same(r["states"], first["states"]) or r.get("next_worker") != first.get("next_worker")
                   for r in readers[1:]):
                raise ValueError(
                    f"{self.what} reads a dataset ({type(self.source).__name__}) whose saved state differs between "
                    f"the {len(readers)} processes that saved it: each process read a part of its own, and the "
                    f"dataset cannot say what is left of the others' parts for another number of processes. Resume "
                    f"with {len(ranks)} process(es), or give the data as a fabric_lite.data.ShardedStream (its "
                    f"shards are dealt anew over any number of processes).")
            own = first
        if own is None:
            return
        states, saved_workers = list(own["states"]), int(own["num_workers"])
        if self.sharded:
            if saved_workers == self.slots:
                self._plan(states, int(own.get("next_worker", 0)), lead_items)
            else:
                self._plan(self.source.deal(states, 1, self.slots), 0, lead_items)
            return
        if saved_workers != self.slots:
            if any(s is not None for s in states):
                raise ValueError(
                    f"{self.what} reads a dataset ({type(self.source).__name__}) with a state of its own in each "
                    f"worker, saved with {saved_workers} worker(s); this run has {self.slots}, and the dataset cannot "
                    f"say how its saved workers' positions map to other workers. Resume with "
                    f"num_workers={saved_workers if saved_workers > 1 else 0}, or use a fabric_lite.data.ShardedStream.")
            return
        self._plan(states, int(own.get("next_worker", 0)), lead_items)

    def _plan(self, states: List[Any], next_worker: int, lead_items: int) -> None:
        self.states = list(states)
        self.next_worker = next_worker % self.slots
        self.start = StartPlan(list(states), self.next_worker if self.slots > 1 else 0, lead_items)


def _same(a: Any, b: Any) -> bool:
    """Whether two saved states are equal (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)
