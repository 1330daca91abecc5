"""How a loader is shared between W processes (rank 0's share), computed as the real run shards it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional


# -- how data is sharded ---------------------------------------------------------------------------

@dataclass
class Share:
    """Rank 0's part of one prepared loader for a world of `world` processes."""

    world: int
    dataset_len: Optional[int] = None
    batch: Optional[int] = None  # per-process batch size (None: the loader's batch_sampler decides)
    batches: Optional[int] = None  # rank 0's batches per epoch
    samples: Optional[int] = None  # rank 0's samples per epoch
    padded: int = 0  # samples repeated (all ranks together) so the last global step is whole
    dropped: int = 0  # samples no rank sees in an epoch
    uneven: bool = False  # ranks get different numbers of batches/samples
    split: bool = False
    even: bool = True
    drop_last: bool = False
    unbatched: bool = False
    iterable: bool = False
    error: Optional[str] = None


def _len(obj: Any) -> Optional[int]:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def loader_share(loader: Any, world: int) -> Share:
    """Rank 0's share of a prepared loader (`DataLoaderShard`) when `world` processes run.

    Batches come from the same `ShardedBatchSampler` the real run builds for rank 0 of `world`;
    samples, padding and dropped samples are counted from the dataset length and batch size.
    """
    from fabric_lite.data.sharding import IterableDatasetShard, ShardedBatchSampler

    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        return _iterable_share(dataset, world)
    sharded = getattr(loader, "_batch_sampler", None)
    if not isinstance(sharded, ShardedBatchSampler):  # not prepared by fabric_lite: report what it is
        return Share(world, _len(dataset), getattr(loader, "batch_size", None), _len(loader))
    inner = sharded.batch_sampler
    from torch.utils.data import BatchSampler

    # DataLoader(batch_size=None) over single samples (not over a BatchSampler given as its sampler)
    if getattr(loader, "batch_sampler", None) is None and not isinstance(inner, BatchSampler):
        n = _len(inner)
        share = Share(world, _len(dataset), None, n, n, unbatched=True)
        if world > 1:
            share.error = ("this DataLoader has batch_size=None (no automatic batching); prepare() refuses to shard "
                           "it over several processes. Give it a batch_size.")
        return share
    b, split, even, drop = sharded.batch_size, sharded.split_batches, sharded.even_batches, sharded.drop_last
    share = Share(world, split=split, even=even, drop_last=drop)
    share.dataset_len = _len(getattr(inner, "sampler", None))
    if share.dataset_len is None:
        share.dataset_len = _len(dataset)
    try:
        mine = ShardedBatchSampler(inner, world, 0, b, split, even, drop)
    except ValueError as err:
        share.error = str(err)
        return share
    share.batches = _len(mine)
    share.batch = None if b is None else (b // world if split else b)
    N, n = share.dataset_len, _len(inner)
    if b is None or N is None or n is None:
        return share
    W, per = world, (b // world if split else b)  # (share.batch, known here: b is set)
    if W == 1:
        share.samples = min(N, n * b)
        share.dropped = N - share.samples
    elif split:
        tail = N % b
        if drop:
            share.samples, share.dropped = n * per, N - n * b
        elif even:
            share.samples, share.padded = n * per, n * b - N
        else:
            share.samples = (n - 1) * per + math.ceil(tail / W) if tail else n * per
            share.uneven = bool(tail)
    else:
        if drop:
            k = n // W
            share.samples, share.dropped = k * b, N - W * k * b
        elif even:
            k = math.ceil(n / W)
            share.samples, share.padded = k * b, W * k * b - N
        else:
            k = n // W + (1 if n % W else 0)
            share.samples = k * b - ((b - N % b) if (n % W == 1 and N % b) else 0)
            share.uneven = bool(n % W) or bool(N % b)
    return share


def _iterable_share(shard: Any, world: int) -> Share:
    b, split, even, drop = shard.batch_size, shard.split_batches, shard.even_batches, shard.drop_last
    share = Share(world, _len(shard.dataset), split=split, even=even, drop_last=drop, iterable=True)
    if split and world > 1 and b % world:
        share.error = (f"split_batches=True needs a batch size divisible by the number of processes; got "
                       f"batch_size={b} for {world} processes.")
        return share
    per = b // world if split and world > 1 else b
    share.batch = per
    N = share.dataset_len
    if N is None:
        return share
    chunk = per * world
    full, tail = divmod(N, chunk)
    even = even and world > 1
    if not tail:
        share.samples = full * per
    elif drop:
        share.samples, share.dropped = full * per, tail
    elif even:
        share.samples, share.padded = (full + 1) * per, chunk - tail
    else:
        share.samples, share.uneven = full * per + min(per, tail), world > 1
    share.batches = share.samples // per if drop and world == 1 else math.ceil(share.samples / per)
    return share
