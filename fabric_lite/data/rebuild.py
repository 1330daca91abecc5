"""How a user's DataLoader is rebuilt as one rank's shard: the parts `shard_dataloader` builds a
`DataLoaderShard` from (data/loader.py).

From the user's loader it takes its settings (workers, collate_fn, ...), its batch sampler or sampler (replaced
by a `SeedableRandomSampler` under `use_seedable_sampler`, copied where it draws from a generator), the dataset
(wrapped in an `IterableDatasetShard` when iterable), who reads under `dispatch_batches`, the padding of the last
global step (`remainder`), and the randomness the epochs' orders are drawn from, agreed on by every rank.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import (
    BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler,
)

from fabric_lite.data.dispatch import Dispatch
from fabric_lite.data.order import EpochRandomness
from fabric_lite.data.seedable import SeedableRandomSampler, seedable_from
from fabric_lite.data.sharding import IterableDatasetShard, ShardedBatchSampler
from fabric_lite.data.stateful import ShardedStream

__all__ = ["sharded_loader_arguments"]


def _loader_kwargs(loader: DataLoader) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return kwargs



def sharded_loader_arguments(
    loader: DataLoader, *, num_replicas: int, rank: int, split_batches: bool = False, even_batches: bool = True,
    broadcast_seed: Callable[[Any], Any] = lambda obj: obj, dispatch_batches: Optional[bool] = False,
    use_seedable_sampler: bool = False, data_seed: Optional[int] = None,
) -> Dict[str, Any]:
    """The keywords a `DataLoaderShard` over this rank's shard of `loader` is built with, less those about where
    its batches go (device, conversion) and its position: `dataset`, `sharded_sampler`, `randomness`,
    `remainder`, `total_batch_size`, `dispatch` and the DataLoader's own keywords. The arguments mean what
    `shard_dataloader`'s do. Raises for a loader that cannot be sharded, naming what to change.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"prepare() shards torch.utils.data.DataLoader objects, got {type(loader).__name__}.")
    if getattr(loader, "next_iter_state", None) is not None:  # a torchdata StatefulDataLoader, state loaded
        raise ValueError(
            f"This {type(loader).__name__} was given a state (load_state_dict) before prepare(); the prepared "
            f"loader reads its own kind of state. Call load_state_dict on the loader prepare() returns (or "
            f"accelerator.load_state after prepare) instead.")
    kwargs = _loader_kwargs(loader)
    dataset = loader.dataset
    batch_size = loader.batch_size
    drop_last = loader.drop_last
    iterable = isinstance(dataset, IterableDataset)
    # A ShardedStream is split by the processes themselves (each reads its own shards): not dispatched by default.
    stream = isinstance(dataset, ShardedStream)
    dispatch = None
    if num_replicas > 1 and (iterable and not stream if dispatch_batches is None else dispatch_batches):
        per = (batch_size or 0) // num_replicas if split_batches else (batch_size or 0)
        dispatch = Dispatch(rank, num_replicas, per,
                            even_chunks=split_batches and not iterable, broadcast=broadcast_seed)
    # With dispatch_batches the main process reads every rank's part of each step, and alone draws the order.
    reader, drawers = (None, 1) if dispatch is not None else (rank, num_replicas)
    if iterable:
        if batch_size is None:
            raise ValueError("prepare() of an IterableDataset loader needs batch_size set on the DataLoader.")
        if isinstance(dataset, ShardedStream):
            own = copy.copy(dataset)  # (this loader's: told its rank)
            dataset = own
            if dispatch is None:  # every process reads its own shards, in batches of its own
                own.assign(rank, num_replicas)
                per_rank = batch_size // num_replicas if split_batches else batch_size
                return dict(
                    dataset=IterableDatasetShard(own, per_rank, 1, 0, False, even_batches, drop_last),
                    batch_size=per_rank, drop_last=drop_last, sharded_sampler=None, remainder=-1,
                    total_batch_size=per_rank * num_replicas,
                    randomness=_randomness(loader.generator, None, drawers, broadcast_seed), dispatch=None, **kwargs)
            own.assign(0, 1)  # the main process reads every shard
        shard = IterableDatasetShard(dataset, batch_size, num_replicas, reader, split_batches, even_batches,
                                     drop_last)
        per_rank = batch_size // num_replicas if split_batches else batch_size
        # Several processes: the shard drops or pads the tail itself. One process: the loader does.
        total = batch_size if split_batches else batch_size * num_replicas
        remainder = -1
        if num_replicas > 1 and not drop_last and hasattr(dataset, "__len__"):
            remainder = len(dataset) % total
        return dict(
            dataset=shard, batch_size=total if dispatch is not None else per_rank,
            drop_last=drop_last and num_replicas == 1, sharded_sampler=None, remainder=remainder,
            total_batch_size=total, randomness=_randomness(loader.generator, None, drawers, broadcast_seed),
            dispatch=dispatch, **kwargs,
        )

    # The batches: the loader's batch sampler, or, with batch_size=None, a BatchSampler given as the
    # sampler (each item it yields is a batch of indices, as Accelerate shards it); else single samples.
    batches = loader.batch_sampler
    if batches is None and isinstance(loader.sampler, BatchSampler):
        batches = loader.sampler
    if batches is None and num_replicas > 1:
        raise ValueError(
            "prepare() shards batches, but this DataLoader has batch_size=None (no automatic batching). "
            "Give it a batch_size (or sampler=BatchSampler(...)), or batch inside the dataset and shard it "
            "yourself with split_between_processes."
        )
    sampler: Any = loader.sampler if batches is None else getattr(batches, "sampler", None)
    replaced = use_seedable_sampler and isinstance(sampler, RandomSampler)
    if replaced:  # (the same on every rank: so is the broadcast)
        seed = data_seed
        if seed is None:
            seed = torch.initial_seed()
            if num_replicas > 1:
                seed = broadcast_seed(seed)
        sampler = seedable_from(sampler, seed)
    shuffled = None  # the loader's copy of a sampler that draws from a generator (the user's object, or its own)
    if not replaced and sampler is not None and hasattr(sampler, "generator"):
        sampler = shuffled = copy.copy(sampler)
    # A sampler (or batch sampler) without a generator of its own may draw its order from the global RNGs
    # (a custom shuffle with torch.randperm): a resumed epoch replays that draw (see data/order.py).
    drawer = sampler if sampler is not None else batches
    global_order = None
    # (a DistributedSampler draws from a generator it seeds itself from its seed and epoch)
    if shuffled is None and drawer is not None and type(drawer) not in (SequentialSampler, DistributedSampler,
                                                                        SeedableRandomSampler):
        global_order = type(drawer).__name__
    randomness = _randomness(loader.generator, shuffled, drawers, broadcast_seed, global_order)
    if batches is None:
        sharded = ShardedBatchSampler(sampler, 1, 0, None)  # one process: passes samples through, can skip
        kwargs.update(sampler=sharded, batch_size=None)
    else:
        batch_sampler = copy.copy(batches)
        if (shuffled is not None or replaced) and hasattr(batch_sampler, "sampler"):
            batch_sampler.sampler = sampler
        sharded = ShardedBatchSampler(batch_sampler, num_replicas, reader, batch_size, split_batches, even_batches,
                                      drop_last)
        if loader.batch_sampler is None:  # (sampler=BatchSampler(...), batch_size=None)
            kwargs.update(sampler=sharded, batch_size=None)
        else:
            kwargs.update(batch_sampler=sharded)
    global_batch = None if batch_size is None else (batch_size if split_batches else batch_size * num_replicas)
    remainder = -1
    if num_replicas > 1 and global_batch is not None and not drop_last and sampler is not None \
            and hasattr(sampler, "__len__"):
        remainder = len(sampler) % global_batch
    return dict(dataset=dataset, sharded_sampler=sharded, randomness=randomness, remainder=remainder,
                total_batch_size=global_batch, dispatch=dispatch, **kwargs)



def _randomness(loader_generator: Optional[torch.Generator], sampler: Any, num_replicas: int,
                broadcast: Callable[[Any], Any], global_order: Optional[str] = None) -> EpochRandomness:
    randomness = EpochRandomness(loader_generator, sampler, num_replicas, broadcast, global_order)
    if num_replicas > 1:
        randomness.agree()
    return randomness

