"""Dataloaders for several processes: sharding of the user's batch order, a resumable position,
and batches moved to the device (on a side stream on CUDA)."""

from fabric_lite.data.loader import DataLoaderShard, shard_dataloader, skip_first_batches
from fabric_lite.data.sharding import IterableDatasetShard, ShardedBatchSampler
from fabric_lite.data.stateful import ShardedStream

__all__ = ["DataLoaderShard", "IterableDatasetShard", "ShardedBatchSampler", "ShardedStream", "shard_dataloader",
           "skip_first_batches"]
