"""This rank's share of the user's batch order: a batch sampler for map-style datasets, a dataset
wrapper for iterable ones (the layout is described in `data/loader.py`)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterator, List, Optional, Tuple

from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from fabric_lite.data.seedable import SeedableRandomSampler

__all__ = ["ShardedBatchSampler", "IterableDatasetShard"]


class ShardedBatchSampler:
    """This rank's share of the user's batch sampler (see the module docstring for the layout).

    `rank=None`: every rank's share of each global step, one after the other in one batch of indices (the
    main process reads them all and hands each process its part: `dispatch_batches`). `split_piece`: with
    `split_batches` and not `even_batches`, how many samples of a short last batch each rank takes, in rank
    order, until none are left (None: ``ceil(len / num_replicas)``, as a dispatched batch is cut; Accelerate's
    `BatchSamplerShard` takes ``batch_size // num_replicas``).
    """

    def __init__(
        self, batch_sampler: Any, num_replicas: int, rank: Optional[int], batch_size: Optional[int],
        split_batches: bool = False, even_batches: bool = True, drop_last: bool = False, *,
        split_piece: Optional[int] = None,
    ) -> None:
        if rank is None and num_replicas > 1 and batch_size is None:
            raise ValueError(
                "dispatch_batches=True needs the DataLoader's batch_size (the main process cuts each global batch "
                "in the processes' parts by it); this loader uses a batch_sampler of its own. Use "
                "DataLoaderConfiguration(dispatch_batches=False), or a DataLoader with batch_size.")
        if split_batches and num_replicas > 1 and batch_size is None:
            raise ValueError(
                "split_batches=True needs the DataLoader's batch_size to split each batch evenly; this loader "
                "uses a batch_sampler of its own. Use split_batches=False, or a DataLoader with batch_size."
            )
        if split_batches and batch_size is not None and batch_size % num_replicas != 0:
            raise ValueError(
                f"split_batches=True needs a batch size divisible by the number of processes; got "
                f"batch_size={batch_size} for {num_replicas} processes. Use a batch size that is a "
                f"multiple of {num_replicas}, or split_batches=False."
            )
        self.batch_sampler = batch_sampler
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last = drop_last
        self.split_piece = split_piece
        self.skip = 0  # batches of this rank to pass over at the start of the next iteration
        #: Samples at the start of this epoch's order already seen by a run with another global batch (a
        #: checkpoint resumed on another number of processes): the epoch goes on from the next one.
        self.skip_samples = 0
        #: Called once an iteration, right before the epoch's order is drawn (the prepared loader's
        #: generators get ready: see `data/order.py`).
        self.before_draw: Optional[Callable[[], None]] = None
        #: Called once an iteration, when the batches to skip have been pulled from the user's sampler and
        #: before the next one is (a resumed epoch replays the skipped draws under older RNG states).
        self.after_skip: Optional[Callable[[], None]] = None
        #: A list to append each batch of indices to as it is handed out (the dataset indices of this rank's
        #: batches, in order: what a prediction writer is told), or None: nothing recorded.
        self.seen_indices: Optional[List[Any]] = None

    @property
    def num_processes(self) -> int:
        """The number of processes the batches are shared by (Accelerate's name for `num_replicas`)."""
        return self.num_replicas

    @property
    def process_index(self) -> Optional[int]:
        """The process whose share this is (Accelerate's name for `rank`; None: every rank's, see above)."""
        return self.rank

    def _short_piece(self, rows: int) -> int:
        """Each rank's piece of a short last batch of `rows` samples under split_batches, not even_batches."""
        return self.split_piece or math.ceil(rows / self.num_replicas)

    def can_skip_samples(self) -> bool:
        """Whether the epoch's order can be cut at any sample (torch's BatchSampler over a plain
        RandomSampler or SequentialSampler: the order is drawn whole)."""
        bs = self.batch_sampler
        sampler = getattr(bs, "sampler", None)
        if type(bs) is not BatchSampler:
            return False
        if type(sampler) is SeedableRandomSampler:  # (a permutation drawn whole from its seed and epoch)
            return not sampler.replacement and sampler.num_samples == len(sampler.data_source)
        return type(sampler) is SequentialSampler or (
            type(sampler) is RandomSampler and not sampler.replacement and sampler.generator is not None
            and sampler.num_samples == len(sampler.data_source))

    def _draw_order(self) -> Optional[Tuple[List[int], Iterator[int]]]:
        """For torch's own BatchSampler over a RandomSampler or SequentialSampler: the epoch's order, pulled
        whole from the sampler, and the sampler's iterator, which `_finish` runs out where a BatchSampler
        would (a RandomSampler draws from its generator once more then, and the next epoch starts after
        that draw). None otherwise."""
        if not self.can_skip_samples():
            return None
        sampler = self.batch_sampler.sampler
        pulls = iter(sampler)
        order = list(itertools.islice(pulls, len(sampler)))
        return (order[self.skip_samples:] if self.skip_samples else order), pulls

    @staticmethod
    def _finish(pulls: Iterator[int]) -> None:
        for _ in pulls:
            pass

    def _ready(self) -> None:
        if self.before_draw is not None:
            self.before_draw()

    def _skipped(self) -> None:
        if self.after_skip is not None:
            self.after_skip()

    def _user_batch_count(self) -> int:
        """How many batches the user's batch sampler makes of this epoch's samples (those left, after a skip)."""
        if not self.skip_samples:
            return len(self.batch_sampler)
        left = len(self.batch_sampler.sampler) - self.skip_samples
        b = self.batch_sampler.batch_size
        return left // b if self.batch_sampler.drop_last else math.ceil(left / b)

    def _user_batches(self, drawn: Optional[Tuple[List[int], Iterator[int]]]) -> Iterator[List[int]]:
        """The user's batches for this epoch, cut from the order `_draw_order` drew where there is one
        instead of pulling the indices one by one."""
        bs = self.batch_sampler
        if drawn is None:
            yield from bs
            return
        order, pulls = drawn
        b, n = bs.batch_size, len(order)
        for i in range(0, n - n % b if bs.drop_last else n, b):
            if i + b > n:
                self._finish(pulls)  # a BatchSampler runs the sampler out while it fills a short last batch
            yield order[i:i + b]
        self._finish(pulls)

    def _groups(self, drawn: Optional[Tuple[List[int], Iterator[int]]]) -> Iterator[Tuple[List[List[int]], bool]]:
        """Yield (batches making one global step, whether that step is complete); only the last may not be."""
        W, b = self.num_replicas, self.batch_size
        if self.split_batches:
            for batch in self._user_batches(drawn):
                yield [batch], len(batch) == b
            return
        group: List[List[int]] = []
        for batch in self._user_batches(drawn):
            group.append(batch)
            if len(group) == W and (b is None or len(batch) == b):
                yield group, True
                group = []
        if group:
            yield group, False

    def _this_rank(self, group: List[List[int]], head: List[List[int]]) -> Optional[List[int]]:
        if self.rank is not None:
            return self._part(group, head, self.rank)
        parts = [self._part(group, head, r) for r in range(self.num_replicas)]  # every rank's, one after the other
        joined = [i for part in parts if part is not None for i in part]
        return joined or None

    def _part(self, group: List[List[int]], head: List[List[int]], r: int) -> Optional[List[int]]:
        W = self.num_replicas
        flat = [i for batch in group for i in batch]
        full: Optional[int]
        if self.split_batches:
            full = self.batch_size or len(flat)
        else:
            full = W * self.batch_size if self.batch_size is not None else None
        complete = (len(flat) == full) if full is not None else len(group) == W
        if complete:
            if self.split_batches:
                per = len(flat) // W  # (complete: len(flat) == full)
                return flat[r * per:(r + 1) * per]
            return group[r]
        if self.drop_last:
            return None
        if not self.even_batches:
            if self.split_batches:
                per = self._short_piece(len(flat))
                part = flat[r * per:(r + 1) * per]
                return part or None
            return group[r] if r < len(group) else None
        if full is None:  # variable-size batches: fill missing batches with the epoch's first ones
            batches = group + [list(b) for b in itertools.islice(itertools.cycle(head), W - len(group))]
            return batches[r]
        pad = list(itertools.islice(itertools.cycle([i for b in head for i in b] or flat), full - len(flat)))
        flat = flat + pad
        per = full // W
        return flat[r * per:(r + 1) * per]

    def __iter__(self) -> Iterator[List[int]]:
        # `skip` is read now but not cleared: a DataLoader with workers calls iter() twice and uses the
        # second iterator, so the prepared loader clears it once its own iter() has returned.
        if self.num_replicas == 1:  # one process: the user's batches exactly as their sampler makes them
            batches = self._iter_one(self.skip)
        else:
            batches = self._iter_sharded(self.skip)
        return batches if self.seen_indices is None else self._recorded(batches, self.seen_indices)

    @staticmethod
    def _recorded(batches: Iterator[Any], seen: List[Any]) -> Iterator[Any]:
        for indices in batches:
            seen.append(indices)
            yield indices

    def _iter_one(self, skip: int) -> Iterator[List[int]]:
        self._ready()
        batches = self._user_batches(self._draw_order())
        try:
            for _ in range(skip):
                if next(batches, None) is None:
                    break
        finally:
            self._skipped()
        yield from batches

    def _iter_sharded(self, skip: int) -> Iterator[List[int]]:
        r = self.rank
        self._ready()
        drawn = self._draw_order()
        if drawn is not None:  # (drawn whole, from the sampler's own generator: nothing to replay)
            self._skipped()
        if drawn is not None and not self.split_batches and self.batch_size:
            order, pulls = drawn
            # The common case in one generator (one resumption a step, not four): global step k is the
            # W batches order[(kW + j)b : (kW + j + 1)b], and this rank's is j = r. What is left after
            # the whole steps is one incomplete step, dealt with below as on the general path.
            W, b = self.num_replicas, self.batch_size
            whole = len(order) // (W * b)
            for k in range(skip, whole):
                if r is None:  # every rank's part: the whole global step
                    yield order[k * W * b:(k + 1) * W * b]
                    continue
                start = (k * W + r) * b
                yield order[start:start + b]
            self._finish(pulls)  # (where a plain loader with batch W*b runs its sampler out, or about)
            if whole < skip:
                return
            rest = order[whole * W * b:]
            tail = [rest[i:i + b] for i in range(0, len(rest) - len(rest) % b if self.batch_sampler.drop_last
                                                  else len(rest), b)]
            if tail:
                first = [order[j * b:(j + 1) * b] for j in range(W)] if whole else tail
                mine = self._this_rank(tail, first)
                if mine is not None:
                    yield mine
            return
        head: List[List[int]] = []  # the epoch's first global step: what padding repeats
        replaying = drawn is None
        groups = self._groups(drawn)
        try:
            for _ in range(skip):  # (pulled under the replayed RNG states, see `after_skip`)
                pulled = next(groups, None)
                if pulled is None:
                    break
                if not head:
                    head = pulled[0]
        finally:
            if replaying:
                self._skipped()
        for group, complete in groups:
            if not head:
                head = group
            if complete and not self.split_batches:
                yield group[r] if r is not None else [i for batch in group for i in batch]
                continue
            mine = self._this_rank(group, head)
            if mine is not None:
                yield mine

    def __len__(self) -> int:
        n = self._user_batch_count()
        W = self.num_replicas
        if self.split_batches and W > 1 and not self.even_batches and not self.drop_last and n \
                and self.rank is not None:
            # the short last batch is cut in pieces of `_short_piece`: the last ranks may get none
            sampler: Any = getattr(self.batch_sampler, "sampler", None)
            last = (len(sampler) - self.skip_samples) % self.batch_size if self.batch_size and hasattr(sampler, "__len__") else 0
            if last:
                return n - 1 + (1 if self.rank * self._short_piece(last) < last else 0)
        if self.split_batches or W == 1:
            return n
        if self.drop_last:
            return n // W
        if self.even_batches or self.rank is None:
            return math.ceil(n / W)
        return n // W + (1 if self.rank < n % W else 0)


class IterableDatasetShard(IterableDataset):
    """This rank's share of an IterableDataset: chunks of W*b samples, slice r of each (`rank=None`: all of
    each chunk, padded as the ranks' slices would be: what the main process reads for `dispatch_batches`)."""

    def __init__(
        self, dataset: Any, batch_size: int, num_replicas: int, rank: Optional[int],
        split_batches: bool = False, even_batches: bool = True, drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last = drop_last
        #: How the next pass starts when the dataset has a state of its own (a `StartPlan` of data/stateful.py).
        self.start: Optional[Any] = None

    @property
    def num_processes(self) -> int:
        """The number of processes the samples are shared by (Accelerate's name for `num_replicas`)."""
        return self.num_replicas

    @property
    def process_index(self) -> Optional[int]:
        """The process whose share this is (Accelerate's name for `rank`; None: every rank's)."""
        return self.rank

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """How many samples this shard yields in an epoch, when the dataset has a length (else TypeError)."""
        n = len(self.dataset)
        if self.num_replicas == 1:
            return n
        per = self.batch_size // self.num_replicas if self.split_batches else self.batch_size
        chunk = per * self.num_replicas
        whole, tail = divmod(n, chunk)
        share = chunk if self.rank is None else per
        if not tail or self.drop_last:
            return whole * share
        if self.even_batches:
            return (whole + 1) * share
        lo = 0 if self.rank is None else self.rank * per
        return whole * share + max(0, min(share, tail - lo))

    def __iter__(self) -> Iterator[Any]:
        # A source with a state of its own (data/stateful.py): the loader's plan for this pass, read now (in the
        # process that reads, before the pass) and used once.
        start, self.start = self.start, None
        if start is None:
            return self._items(0, None)
        lead = start.begin(self.dataset)
        return self._items(lead, start.placeholder())

    def _items(self, lead: int, placeholder: Any) -> Iterator[Any]:
        for _ in range(lead):  # a resumed worker whose turn has passed: one batch the loader drops
            yield placeholder
        if self.num_replicas == 1:
            yield from self.dataset
            return
        per = self.batch_size // self.num_replicas if self.split_batches else self.batch_size
        chunk = per * self.num_replicas
        lo, hi = (0, chunk) if self.rank is None else (self.rank * per, (self.rank + 1) * per)
        buffer: List[Any] = []
        head: List[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == chunk:
                if not head:
                    head = list(buffer)
                yield from buffer[lo:hi]
                buffer = []
        if not buffer or self.drop_last:
            return
        if self.even_batches:
            buffer += list(itertools.islice(itertools.cycle(head or buffer), chunk - len(buffer)))
        yield from buffer[lo:hi]
