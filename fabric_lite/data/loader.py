"""Dataloaders that shard by rank, reshuffle every epoch, resume mid-epoch and move batches to the device.

The user's batch order is kept: their sampler draws the order, every epoch, from the generator a
plain loop would draw it from (the user's own generator object, or the global RNG: see
`data/order.py`), the same order on every rank; global step k is made of the W consecutive batches
kW ... kW+W-1, one per rank. So on one process the batches are the plain loader's, and W processes
with batch b see in step k exactly the samples of a plain loader's batch k of W*b, every epoch.
Padding that makes every rank get the same number of full batches sits only in the final global
step, where `remainder` says how many of its samples are real.

This module is the prepared loader (`DataLoaderShard`) and its doors (`shard_dataloader`, `skip_first_batches`);
what a user's DataLoader is rebuilt from (its settings, samplers, dataset, randomness) is worked out in
`data/rebuild.py`, and how its position is saved and restored in `data/position.py`.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from fabric_lite.data.dispatch import Dispatch
from fabric_lite.data.order import EpochRandomness
from fabric_lite.data.position import Position, ResumablePosition
from fabric_lite.data.rebuild import sharded_loader_arguments
from fabric_lite.data.sharding import IterableDatasetShard, ShardedBatchSampler
from fabric_lite.data.stateful import ShardedStream, SnapshotCollate, SourceSnapshots, has_state, source_of
from fabric_lite.data.transfer import CudaFeed, move_to_device
from fabric_lite.data.workers import WorkerRandomness

__all__ = [
    "DataLoaderShard", "ShardedBatchSampler", "IterableDatasetShard", "ShardedStream",
    "shard_dataloader", "skip_first_batches", "move_to_device",
]


class DataLoaderShard(DataLoader, ResumablePosition):
    """A prepared dataloader: this rank's batches, on the device, with a resumable position.

    It is a real DataLoader (built over the sharded sampler), so code that checks the type or
    reads `dataset`, `batch_size`, `num_workers` keeps working.
    """

    def __init__(
        self, dataset: Any, *, device: Optional[torch.device], gradient_state: Any,
        randomness: EpochRandomness, sharded_sampler: Optional[ShardedBatchSampler],
        position: Position, remainder: int, total_batch_size: Optional[int],
        convert_batch: Optional[Callable[[Any], Any]] = None, non_blocking: bool = False,
        device_feed: Optional[Callable[[Any], Any]] = None, dispatch: Optional[Dispatch] = None,
        **loader_kwargs: Any,
    ) -> None:
        # The DataLoader draws its workers' seed from the user's generator (or the global RNG) when it
        # builds an iterator, as the plain loader does (see data/order.py).
        super().__init__(dataset, generator=randomness.loader_generator, **loader_kwargs)
        batch_sampler = sharded_sampler
        self.device = device
        self.gradient_state = gradient_state
        self._randomness = randomness
        if batch_sampler is not None:
            batch_sampler.before_draw = randomness.before_order
            batch_sampler.after_skip = randomness.end_replay
        self._batch_sampler = batch_sampler
        # Workers' random streams (data/workers.py): followed batch by batch for a map-style dataset loaded in
        # order; an IterableDataset's workers draw their items themselves and are only seeded.
        self._workers = None
        if self.num_workers > 0:
            self._workers = WorkerRandomness(self.num_workers, self.persistent_workers, per_batch=(
                batch_sampler is not None and getattr(self, "in_order", True)))
        self._first_index = 0  # the index in its epoch of the first batch the next iterator loads
        self._position = position
        self._epoch_remainder = remainder  # of a whole epoch (a resumed one may end with another)
        self.total_batch_size = total_batch_size
        self._convert = convert_batch
        self._non_blocking = non_blocking
        self._device_feed = device_feed  # the strategy's own transfer (see Runtime.device_feed), or None
        self._skip_request = 0
        self._at_last = False
        #: `dispatch_batches`: how this loader's global batches are shared (read on rank 0 only), or None.
        self.dispatch = dispatch
        # The user's sampler, batch sampler and dataset hear the epoch, as under a plain DistributedSampler.
        inner = batch_sampler.batch_sampler if batch_sampler is not None else None
        candidates = [inner, getattr(inner, "sampler", None), dataset]
        self._epoch_listeners = [o for o in candidates if o is not None and callable(getattr(o, "set_epoch", None))]
        # An iterable dataset with a position of its own (data/stateful.py): saved with every batch, restored, not
        # re-read.
        self._source: Optional[SourceSnapshots] = None
        if isinstance(dataset, IterableDatasetShard) and has_state(source_of(dataset)):
            self._source = SourceSnapshots(source_of(dataset), self.num_workers, self._described())
            self._source.reads = dispatch is None or dispatch.rank == 0

    def __len__(self) -> int:
        return max(0, super().__len__() - self._skip_request)

    @property
    def remainder(self) -> int:
        """Real samples in the last global step of this epoch when it is padded (-1: unknown)."""
        whole, skipped, total = self._epoch_remainder, self._position.samples_skipped, self.total_batch_size
        return whole if whole < 0 or not skipped or not total else (whole - skipped) % total

    @property
    def end_of_dataloader(self) -> bool:
        return self._at_last

    @property
    def epoch(self) -> int:
        return self._position.epoch

    @property
    def batches_seen(self) -> int:
        """Batches yielded in the current epoch (with `dispatch_batches`: global steps)."""
        return self._position.batches_seen

    def follow(self, epoch: int, batches_seen: int, last: bool) -> None:
        """Take the main process's position (`dispatch_batches`: the other processes read nothing themselves)."""
        pos = self._position
        pos.epoch, pos.batches_seen, pos.restored, pos.converted_from = epoch, batches_seen, False, None
        self._skip_samples(0)
        self._at_last = last

    def set_epoch(self, epoch: int) -> None:
        """Number the epoch the next iteration starts (done automatically each epoch): the number the
        sampler's and dataset's own `set_epoch` hear and checkpoints keep. The shuffled order does not
        come from it but from the generator, as in a plain loop: to replay an epoch, reseed the
        generator (or load a checkpoint)."""
        if epoch != self._position.epoch:
            self._position.epoch = epoch
            self._position.batches_seen = 0
            self._skip_samples(0)
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._randomness.end_epoch()
        if self._workers is not None:
            self._workers.end_epoch()
        if self._source is not None:
            self._source.end_epoch()

    def _start_epoch(self) -> int:
        pos = self._position
        if pos.batches_seen and not pos.restored:
            # The last iteration was abandoned part-way (a `break`): like a plain DataLoader, a new
            # iteration is a new epoch. Only a restored position is continued.
            pos.epoch += 1
            pos.batches_seen = 0
            self._skip_samples(0)
            if self._workers is not None:
                self._workers.end_epoch()
            if self._source is not None:
                self._source.end_epoch()
        self._randomness.start_epoch(resumed=pos.restored)
        pos.restored = False
        for obj in self._epoch_listeners:
            obj.set_epoch(pos.epoch)
        request = self._skip_request
        if pos.converted_from is not None and request:
            if request != pos.converted_from:
                warnings.warn(
                    f"skip_first_batches({request}) after resuming from a run with another global batch: the loader "
                    f"already goes on after the {pos.converted_from} batch(es) of that run, in samples; the request "
                    f"is ignored.", stacklevel=3)
            request = 0
        skip = max(request, pos.batches_seen)
        if self._batch_sampler is not None:
            # With workers the dispatch starts at a multiple of their number; the rest is loaded and dropped
            # (data/workers.py: it keeps each batch on the worker whose random stream it belongs to).
            start = self._workers.aligned(skip) if self._workers is not None else skip
            self._batch_sampler.skip = self._first_index = start
            return skip - start
        self._first_index = 0
        if self._source is not None and self._source.start is not None:
            return max(0, request - pos.batches_seen)  # the source goes on from its saved state by itself
        return skip  # no sampler to skip in: skip after loading

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not DataLoader's iterator class
        if self.dispatch is not None:
            return self.dispatch.iterate(self)
        return self.load_batches(self.gradient_state)

    def place(self, batch: Any) -> Any:
        """A batch on the device, converted as this loader converts its own."""
        if self._device_feed is not None:
            batch = self._device_feed(batch)
        elif self.device is not None:
            batch = move_to_device(batch, self.device, self._non_blocking)
        if self._convert is not None:
            batch = self._convert(batch)
        return batch

    def load_batches(self, state: Any, placed: bool = True) -> Iterator[Any]:
        """This loader's next epoch as it reads it, reported to `state` (a GradientState); `placed=False` leaves
        the batches where they were loaded (`dispatch_batches` places each process's part after cutting)."""
        skip_loaded = self._start_epoch()
        resumes_source = self._source is not None and self._source.start is not None
        pos = self._position
        if pos.converted_from is None:
            pos.batches_seen = max(self._skip_request, pos.batches_seen)
        pos.converted_from = None
        self._at_last = False
        state.enter(self)
        device, convert, non_blocking, custom = self.device, self._convert, self._non_blocking, self._device_feed
        if not placed:
            device = convert = custom = None
        feed = self._cuda_feed() if custom is None and device is not None and device.type == "cuda" else None
        if custom is not None:
            device = None  # the strategy's feed moves the batch
        try:
            iterator = self._new_iterator()
            if self._batch_sampler is not None:
                self._batch_sampler.skip = 0
            if self._workers is not None and self._workers.per_batch:
                iterator = self._reported(iterator, self._first_index)
            source = self._source if self._source is not None and self._source.reads else None
            if source is not None:
                iterator = source.batches(iterator)
            # An IterableDataset loaded here draws its items' randomness from the global RNGs, and a resumed
            # epoch loads the items it skips again: they are drawn under the states the epoch started from,
            # and the batch held ahead under the states it was first loaded with (see data/order.py).
            replay_items = isinstance(self.dataset, IterableDataset) and self.num_workers == 0
            if resumes_source and (self._randomness.record or {}).get("pending") is None:
                replay_items = False  # (nothing is loaded again; saved with workers: no states to replay)
            randomness, what = self._randomness, ""
            if replay_items:
                what = f"{self._described()} (an IterableDataset loaded in this process)"
                randomness.replay_global(what)
                for _ in range(skip_loaded):
                    if next(iterator, None) is None:
                        break
                    if source is not None:
                        source.handed_out()
                skip_loaded = 0
            if skip_loaded and source is not None:
                for _ in range(skip_loaded):
                    if next(iterator, None) is None:
                        break
                    source.handed_out()
            elif skip_loaded:
                iterator = itertools.islice(iterator, skip_loaded, None)
            remaining = self._batches_left_without_look_ahead()
            if remaining is not None:
                # Counted, not looked ahead: fetching batch k+1 before step k runs would draw from
                # the global RNG (random transforms in __getitem__) out of order, and a resumed run
                # would not repeat it.
                for current in iterator:
                    if custom is not None:
                        current = custom(current)
                    elif feed is not None:
                        current = feed(current, non_blocking)
                    elif device is not None:
                        current = move_to_device(current, device, non_blocking)
                    if convert is not None:
                        current = convert(current)
                    remaining -= 1
                    if remaining <= 0:
                        self._at_last = True
                        state.mark_last()
                    pos.batches_seen += 1
                    yield current
                    if feed is not None:
                        feed.wait_host()  # before the loader builds the next batch
            else:
                sentinel = object()
                if replay_items:
                    randomness.replay_global(what, "pending")
                current = next(iterator, sentinel)
                if replay_items:
                    randomness.end_replay()
                while current is not sentinel:
                    if custom is not None:
                        current = custom(current)
                    elif feed is not None:
                        current = feed(current, non_blocking)
                        if self.num_workers == 0:  # (workers hand over fresh memory every batch)
                            feed.wait_host()
                    elif device is not None:
                        current = move_to_device(current, device, non_blocking)
                    if convert is not None:
                        current = convert(current)
                    if replay_items:  # (what a checkpoint saved during this step replays for that batch)
                        randomness.replay_global(what, "pending")
                    upcoming = next(iterator, sentinel)  # (workers: loaded in the background anyway)
                    if upcoming is sentinel:
                        self._at_last = True
                        state.mark_last()
                    pos.batches_seen += 1
                    if source is not None:
                        source.handed_out()
                    yield current
                    current = upcoming
            pos.epoch += 1
            pos.batches_seen = 0
            self._skip_samples(0)
            self._end_epoch()
        finally:
            if feed is not None:
                feed.wait_host()  # (also when the loop was left early: the next iteration may reuse memory)
            self._at_last = False
            state.leave(self)

    def _new_iterator(self) -> Iterator[Any]:
        randomness, workers = self._randomness, self._workers
        # New worker processes start unless persistent ones are running (`_iterator`: DataLoader's own).
        starts = workers is not None and not (self.persistent_workers and self._iterator is not None)
        self.generator = randomness.iterator_generator(workers.seed_replay() if workers is not None and starts else None)
        user = {"worker_init_fn": self.worker_init_fn, "collate_fn": self.collate_fn}
        if starts and workers is not None:
            base = (randomness.record or {}).get("base")
            for name, value in workers.start(self.worker_init_fn, self.collate_fn, base, self._position.epoch).items():
                setattr(self, name, value)  # read once, when the DataLoader starts its workers
        source = self._source
        shard: Any = self.dataset
        if source is not None and source.reads:
            # each batch comes with its reader's dataset state; a loaded plan goes with the dataset to the readers
            self.collate_fn = SnapshotCollate(user["collate_fn"], shard)  # type: ignore[arg-type]
            shard.start = source.start
        try:
            iterator = super().__iter__()
        finally:
            self.generator = randomness.loader_generator
            for name, value in user.items():
                setattr(self, name, value)
            if source is not None:
                shard.start = source.start = None
        randomness.iterator_built()
        return iterator

    def _reported(self, iterator: Iterator[Any], index: int) -> Iterator[Any]:
        """The batches of workers that report their random states with each (data/workers.py)."""
        workers = self._workers
        assert workers is not None  # (only loaders with workers report)
        for batch, states in iterator:
            workers.loaded(index, states)
            index += 1
            yield batch

    def _cuda_feed(self) -> CudaFeed:
        feed = self.__dict__.get("_feed")
        device = self.device
        assert device is not None  # (only a loader that places its batches on a CUDA device has a feed)
        if feed is None or feed.device != device:
            feed = self._feed = CudaFeed(device)
        return feed

    def _batches_left_without_look_ahead(self) -> Optional[int]:
        """Batches left in this epoch when that is known and loading happens in this process; else None
        (the last batch is then found by loading one batch ahead)."""
        if self.num_workers > 0 or isinstance(self.dataset, IterableDataset):
            return None
        try:
            return DataLoader.__len__(self) - self._position.batches_seen
        except TypeError:
            return None

    def record_batch_indices(self, record: bool = True) -> Optional[list]:
        """Start recording the dataset indices of each batch this loader hands this process, from its next
        iteration on: returns the list they are appended to (batch k's indices are item k), or None where there is
        no sampler of indices (an IterableDataset). `record=False` stops it. What a prediction writer is told."""
        if self._batch_sampler is None or isinstance(self.dataset, IterableDataset):
            return None
        seen: Optional[list] = [] if record else None
        self._batch_sampler.seen_indices = seen
        return seen

    def view_skipping(self, num_batches: int) -> "DataLoaderShard":
        """A view of this loader (sharing its position) whose next iteration skips `num_batches`."""
        view = copy.copy(self)
        view._skip_request = num_batches  # noqa: SLF001 (a copy of this very class)
        return view


def shard_dataloader(
    loader: DataLoader, *, num_replicas: int, rank: int, device: Optional[torch.device],
    gradient_state: Any, split_batches: bool = False, even_batches: bool = True,
    broadcast_seed: Callable[[Any], Any] = lambda obj: obj, convert_batch: Optional[Callable[[Any], Any]] = None,
    non_blocking: bool = False, device_feed: Optional[Callable[[Any], Any]] = None,
    dispatch_batches: Optional[bool] = False, use_seedable_sampler: bool = False, data_seed: Optional[int] = None,
) -> DataLoaderShard:
    """Rebuild `loader` so this rank reads its shard of the user's order, reshuffled every epoch.

    `broadcast_seed` hands rank 0's object to every rank (the strategy's `broadcast_object`): the ranks
    agree on their generators' states here, and each epoch on the global RNG's draw that seeds a sampler
    without a generator of its own (see data/order.py); with `dispatch_batches` it hands out each global batch
    (data/dispatch.py); `dispatch_batches` None: True for an IterableDataset. `use_seedable_sampler`: a
    `RandomSampler` is replaced by a `SeedableRandomSampler` seeded with `data_seed` (None: rank 0's
    `torch.initial_seed()`).
    """
    if isinstance(loader, DataLoaderShard):
        return loader
    arguments = sharded_loader_arguments(
        loader, num_replicas=num_replicas, rank=rank, split_batches=split_batches, even_batches=even_batches,
        broadcast_seed=broadcast_seed, dispatch_batches=dispatch_batches, use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed)
    return DataLoaderShard(device=device, gradient_state=gradient_state, convert_batch=convert_batch,
                           non_blocking=non_blocking, device_feed=device_feed, position=Position(), **arguments)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader whose next iteration starts after `num_batches` of this rank's batches.

    For a prepared loader the skipped batches are never loaded, and the epoch's order is the same
    one the original loader would draw. Counting is from the start of the epoch: after
    ``load_state``, ``skip_first_batches(loader, saved_step)`` does not skip twice.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches={num_batches} must be >= 0.")
    if isinstance(dataloader, DataLoaderShard):
        return dataloader.view_skipping(num_batches)
    return _SkipLoader(dataloader, num_batches)


class _SkipLoader:
    """Skip for a loader that was not prepared (its batches are loaded and dropped)."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.base_dataloader = loader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.base_dataloader), self.num_batches, None)

    def __len__(self) -> int:
        return max(0, len(self.base_dataloader) - self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "base_dataloader":
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)
