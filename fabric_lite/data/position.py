"""Where a prepared loader is in its epochs (`Position`), and how that position is saved and restored
(`ResumablePosition`, which `DataLoaderShard` is made of): also by a run with another number of processes or
another global batch, which goes on after the samples the saved run saw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, cast

from torch.utils.data import DataLoader, IterableDataset

from fabric_lite.data.order import EpochRandomness
from fabric_lite.data.seedable import SeedableRandomSampler
from fabric_lite.data.sharding import IterableDatasetShard, ShardedBatchSampler
from fabric_lite.data.stateful import SourceSnapshots
from fabric_lite.data.workers import WorkerRandomness

__all__ = ["Position", "ResumablePosition"]


@dataclass
class Position:
    """Where a loader is: shared by a loader and its `skip_first_batches` views."""

    epoch: int = 0
    batches_seen: int = 0  # batches of this rank yielded in the current epoch
    samples_skipped: int = 0  # global samples of this epoch seen before a resume with another global batch
    # after a resume with another global batch: the saved run's batches_seen, which a `skip_first_batches`
    # asked for in the saved run's units (the usual resume code) means; the position already accounts for it
    converted_from: Optional[int] = None
    restored: bool = False  # set by load_state: the next iteration continues at batches_seen


class ResumablePosition:
    """The position part of a prepared loader: `state_dict` / `load_state_dict` and what they count with.
    The loader that inherits it holds the attributes declared here."""

    _position: Position
    _batch_sampler: Optional[ShardedBatchSampler]
    _randomness: EpochRandomness
    _workers: Optional[WorkerRandomness]
    _source: Optional[SourceSnapshots]
    _iterator: Any
    total_batch_size: Optional[int]
    persistent_workers: bool
    dataset: Any
    batch_size: Optional[int]

    def _described(self) -> str:
        dataset = getattr(self.dataset, "dataset", self.dataset) if isinstance(self.dataset, IterableDatasetShard) \
            else self.dataset
        return f"The prepared DataLoader over {type(dataset).__name__}"

    def batches_left(self) -> Optional[int]:
        """This process's batches still to come in the current epoch (after those yielded), if known."""
        if isinstance(self.dataset, IterableDataset):  # its length, where it has one, is a guess
            return None
        try:
            return max(0, DataLoader.__len__(cast(DataLoader, self)) - self._position.batches_seen)
        except TypeError:
            return None

    def _epoch_samples(self) -> Optional[int]:
        sampler = getattr(getattr(self._batch_sampler, "batch_sampler", None), "sampler", None)
        try:
            return len(sampler) if sampler is not None else None
        except TypeError:
            return None

    def _skip_samples(self, samples: int) -> None:
        """Start (or, with 0, stop) an epoch part-way, after `samples` global samples of its order."""
        self._position.samples_skipped = samples
        if self._batch_sampler is not None:
            self._batch_sampler.skip_samples = samples

    def state_dict(self) -> Dict[str, Any]:
        pos = self._position
        # The position also in global samples: a run with another number of processes resumes from it.
        seen = pos.samples_skipped + pos.batches_seen * self.total_batch_size if self.total_batch_size else None
        epoch_samples = self._epoch_samples()
        if seen is not None and epoch_samples is not None:
            seen = min(seen, epoch_samples)  # the last step's padding is not samples seen
        # generator_state: what the epoch's order and worker seed are drawn from (data/order.py)
        workers = self._workers
        pool_live = self.persistent_workers and self._iterator is not None
        state = {"epoch": pos.epoch, "batches_seen": pos.batches_seen, "generator_state": self._randomness.state(),
                 "samples_seen": seen, "total_batch_size": self.total_batch_size, "num_replicas": self._replicas(),
                 "workers": workers.state(pos.batches_seen, pool_live) if workers is not None else None}
        seedable = self._seedable()
        if seedable is not None:  # (use_seedable_sampler: its seed, which a resumed run may not be given again)
            state["sampler_seed"] = seedable.seed
        if self._source is not None:  # (each process's own: its dataset's state in each of its workers)
            state["source"] = self._source.state()
        return state

    def _load_source(self, state: Dict[str, Any], resized: bool) -> None:
        """Plan where the dataset's own state goes on (data/stateful.py); refuses what cannot go on before anything
        of the loader changes."""
        source = self._source
        assert source is not None
        own, ranks = state.get("source"), state.get("source_ranks")
        if not int(state["batches_seen"]) or (own is None and ranks is None):
            source.end_epoch()  # (an epoch's start: the dataset starts its pass afresh)
            return
        if resized and ranks is None and own is not None and own.get("kind") == "sharded":
            raise ValueError(
                f"{self._described()} was saved by a run with another global batch (another number of processes): "
                f"its ShardedStream needs every saved process's state to deal what is left, and this state holds one "
                f"process's. Load it with accelerator.load_state (or the Trainer's ckpt_path), which reads them all.")
        source.load(own if ranks is None else None, ranks, int(self.batch_size or 1))

    def _seedable(self) -> Optional[SeedableRandomSampler]:
        inner = getattr(self._batch_sampler, "batch_sampler", None)
        for candidate in (inner, getattr(inner, "sampler", None)):
            if isinstance(candidate, SeedableRandomSampler):
                return candidate
        return None

    def _replicas(self) -> Optional[int]:
        sampler = self._batch_sampler
        return sampler.num_replicas if sampler is not None else None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        batches, skipped = int(state["batches_seen"]), 0
        saved_total, seen, total = state.get("total_batch_size"), state.get("samples_seen"), self.total_batch_size
        saved_replicas = state.get("num_replicas")
        if batches and total is None and saved_replicas not in (None, self._replicas()):
            raise ValueError(
                f"This loader was saved {batches} batches into epoch {state['epoch']} by {saved_replicas} process(es); "
                f"this run has {self._replicas()}, and its batches have no fixed size (a custom batch sampler), so "
                f"the position cannot be carried over. Resume with {saved_replicas} processes, or from a checkpoint "
                f"saved at an epoch's end.")
        cut = bool(seen) and saved_total and seen != min(batches * saved_total, self._epoch_samples() or seen)
        if seen and saved_total and total and (saved_total != total or cut):
            # Saved by a run with another global batch (another number of processes): go on after the samples
            # it saw, at a step boundary of this run when there is one, else part-way into its order.
            batches, rest = divmod(int(seen), total)
            if rest and self._source is not None and state.get("source") is not None:
                rest = 0  # (the dataset goes on from its own saved state: the count is only the epoch's progress)
            if rest:
                sampler = self._batch_sampler
                if sampler is None or not sampler.can_skip_samples():
                    raise ValueError(
                        f"This loader was saved {seen} samples into epoch {state['epoch']} by a run with a global "
                        f"batch of {saved_total}; this run's is {total}, and its sampler cannot be cut part-way "
                        f"(a custom sampler or batch sampler). Resume with the same number of processes and batch "
                        f"size, or from a checkpoint saved at an epoch's end.")
                batches, skipped = 0, int(seen)
            self._position.converted_from = int(state["batches_seen"])
        if self._source is not None:
            self._load_source(state, saved_total not in (None, total))
        seedable = self._seedable()
        if seedable is not None and state.get("sampler_seed") is not None:
            seedable.seed = int(state["sampler_seed"])
        self._position.epoch = int(state["epoch"])
        self._position.batches_seen = batches
        self._position.restored = True
        self._skip_samples(skipped)
        if self._workers is not None:
            if self.persistent_workers and self._iterator is not None:
                # Running workers cannot take the saved random states: the next iteration starts new ones.
                self._iterator = None
                self._workers.stopped()
            self._workers.load(state.get("workers"), batches, int(state["epoch"]), self._described())
        if "generator_state" in state:
            self._randomness.load(state["generator_state"])
        else:  # saved by an older version, which seeded each epoch with base_seed + epoch
            self._randomness.load_legacy(int(state["base_seed"]), int(state["epoch"]),
                                         int(state.get("draws_before_sampler", 0)))
