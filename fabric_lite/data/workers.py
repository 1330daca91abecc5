"""The random streams of a prepared loader's worker processes, followed batch by batch so that a
resumed run repeats them.

A plain DataLoader seeds worker w (python ``random``, numpy, torch) from its base seed + w when the
worker starts, and hands out batch j of an epoch to worker j mod W (round robin from worker 0 each
epoch), so a map-style dataset's random augmentation in batch j comes from "slot" j mod W's stream.
The prepared loader keeps exactly that seeding and dispatch: its batches, randomness included, are
the plain loader's. What a plain loader cannot do is resume: fresh workers restart their streams from
the seed, and persistent workers carry theirs over from epoch to epoch.

So each worker reports, with every batch it collates, its random states right after it (a few KB,
sent as plain bytes and tuples, not tensors). The loader keeps the last reports of each slot, and a
checkpoint holds, for every slot, the states its next batch starts from (None: a fresh worker's own).
A resumed run starts its workers with those states; its first batch goes to worker 0, so the resumed
epoch starts at the last multiple of W at or before the saved position, and the few batches up to the
position are loaded again and dropped (at most W-1), which keeps slot j mod W on worker j mod W.
Persistent workers: the states at an epoch's end become the next epoch's start, the seed they were
started with is kept (their first iterator draws it from a copy of the generator, as the uninterrupted
run's did not draw it again), and a live pool loaded into is restarted.

Randomness the worker does not keep in these three global generators (a ``random.Random`` or
``numpy.random.Generator`` object created when the dataset is built) is not followed: see the
checkpoints guide.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from fabric_lite.data.rng_states import HostRngStates, checkpointable, restore

__all__ = ["WorkerRandomness"]


class ReportingCollate:
    """The user's collate_fn, run in the worker; returns (batch, the worker's states after it)."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, items: Any) -> Any:
        batch = self.collate(items)
        return batch, HostRngStates()


class WorkerStart:
    """The user's worker_init_fn, then (a resumed run) the worker's saved random states."""

    def __init__(self, init: Optional[Callable[[int], None]], states: Optional[List[Optional[Dict[str, Any]]]]):
        self.init = init
        self.states = states

    def __call__(self, worker_id: int) -> None:
        if self.init is not None:
            self.init(worker_id)
        state = self.states[worker_id] if self.states is not None else None
        if state is not None:
            restore(state)


class WorkerRandomness:
    """What one prepared loader knows of its workers' random streams (see the module docstring).

    `per_batch`: the workers report their states with every batch (map-style datasets); an
    IterableDataset's workers draw their items themselves and are only seeded as a plain loader's.
    """

    def __init__(self, num_workers: int, persistent: bool, per_batch: bool) -> None:
        self.num_workers = num_workers
        self.persistent = persistent
        self.per_batch = per_batch
        self.after: Dict[int, Any] = {}  # batch index in the epoch -> its slot's states right after it
        self.at_start: List[Any] = [None] * num_workers  # each slot's states at the epoch's start (None: fresh)
        self.pool_base: Optional[torch.Tensor] = None  # live persistent workers: the state their seed came from
        self.pool_epoch: Optional[int] = None  # ... and the epoch they started in
        self.to_restore: Optional[List[Optional[Dict[str, Any]]]] = None  # loaded: for the next workers started
        self.restored_base: Optional[torch.Tensor] = None  # loaded: the saved live workers' seed state
        self.warned = False

    # -- the epoch ---------------------------------------------------------------------------------------------

    def aligned(self, skip: int) -> int:
        """Where a resumed epoch's dispatch starts: the last multiple of W at or before `skip`."""
        return skip - skip % self.num_workers if self.per_batch else skip

    def loaded(self, index: int, states: HostRngStates) -> None:
        self.after[index] = states
        self.after.pop(index - 2 * self.num_workers, None)

    def end_epoch(self) -> None:
        if self.persistent:
            for index in sorted(self.after):
                self.at_start[index % self.num_workers] = self.after[index]
        else:
            self.at_start = [None] * self.num_workers
        self.after = {}

    # -- starting workers ------------------------------------------------------------------------------------

    def seed_replay(self) -> Optional[torch.Tensor]:
        """The generator state the next workers' seed is drawn from, when it must not be drawn afresh: the saved
        run's persistent workers were running, and it did not draw their seed again."""
        return self.restored_base

    def start(self, init: Optional[Callable[[int], None]], collate: Callable[[Any], Any], base: Optional[torch.Tensor],
              epoch: int) -> Dict[str, Any]:
        """The DataLoader arguments for a new set of workers (`base`: the state their seed is drawn from)."""
        states, self.to_restore, self.restored_base = self.to_restore, None, None
        if self.persistent:
            self.pool_base, self.pool_epoch = base, epoch
        kwargs: Dict[str, Any] = {"worker_init_fn": WorkerStart(init, states) if states is not None else init}
        if self.per_batch:
            kwargs["collate_fn"] = ReportingCollate(collate)
        return kwargs

    def stopped(self) -> None:
        """The persistent workers were shut down: the next ones start fresh."""
        self.pool_base = self.pool_epoch = None
        self.at_start = [None] * self.num_workers

    # -- checkpoints -----------------------------------------------------------------------------------------

    def state(self, batches_seen: int, pool_live: bool) -> Dict[str, Any]:
        W = self.num_workers
        start = self.aligned(batches_seen)
        states = [self.after.get(start - W + s) if start - W + s >= 0 else self.at_start[s] for s in range(W)]
        live = pool_live and self.persistent
        return {"num_workers": W, "per_batch": self.per_batch,
                "states": [checkpointable(s) for s in states] if self.per_batch else None,
                "pool_base": self.pool_base if live else None, "pool_epoch": self.pool_epoch if live else None}

    def load(self, saved: Optional[Dict[str, Any]], batches_seen: int, epoch: int, what: str) -> None:
        self.after, self.at_start = {}, [None] * self.num_workers
        self.to_restore = self.restored_base = None
        if saved is None:
            return
        live = saved.get("pool_base") is not None
        if saved.get("num_workers") != self.num_workers:
            if saved.get("states") and any(s is not None for s in saved["states"]) or live:
                self.warn_once(
                    f"{what} was saved with num_workers={saved.get('num_workers')} and resumes with "
                    f"num_workers={self.num_workers}: each worker's random stream (augmentation in the dataset) "
                    f"cannot be carried over, so the resumed run draws other random values. Resume with "
                    f"num_workers={saved.get('num_workers')} to repeat the uninterrupted run exactly.")
            return
        if live:
            self.restored_base = saved["pool_base"]
        states = saved.get("states")
        if self.per_batch and states is not None:
            W, start = self.num_workers, self.aligned(batches_seen)
            for s, state in enumerate(states):
                if start - W + s >= 0:
                    self.after[start - W + s] = state
                else:
                    self.at_start[s] = state
            self.to_restore = list(states) if any(s is not None for s in states) else None
        elif live and (not batches_seen or saved.get("pool_epoch") != epoch):
            self.warn_once(
                f"{what} reads an IterableDataset with persistent_workers=True, and the checkpoint was saved while "
                f"its workers had already loaded an earlier epoch: their random state is not restored, so random "
                f"values drawn in the dataset differ from the uninterrupted run's. Use persistent_workers=False "
                f"(every epoch's workers then start from the replayed seed) to resume exactly.")

    def warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, stacklevel=4)
