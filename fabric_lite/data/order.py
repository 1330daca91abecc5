"""The random draws behind a prepared loader's epochs, made from the generators a plain DataLoader
draws from, in the same order, and recorded so that a checkpoint replays them.

Each epoch a plain ``DataLoader`` makes two kinds of draw:

* when it builds a new iterator (every epoch; only the first with persistent workers), one number
  for its workers' seeds, from ``DataLoader(generator=...)`` or else the global RNG;
* when the first batch is asked for, the sampler draws the order: ``RandomSampler(generator=g)``
  from ``g`` (a permutation, and a second one when it runs out: the generator's state after an
  epoch includes that one), ``RandomSampler()`` from a generator seeded by one draw from the
  global RNG.

A prepared loader keeps the user's generator objects: its DataLoader draws the worker seed from
the same generator and its sampler (a copy of the user's) draws from the same ``g``, so every epoch
equals the plain loader's and reseeding ``g`` at any time takes effect as it would there. A sampler
without a generator gets one of the loader's own, seeded at each epoch's first batch by one draw
from the global RNG, which for ``RandomSampler`` is exactly its own seeding. On several processes
the ranks must draw the same order: rank 0's generator states are handed to every rank at
``prepare``, and a sampler without a generator takes rank 0's draw from the global RNG each epoch
(one small broadcast an epoch, at the first batch), so ranks whose global RNGs differ (seeded per
process) still agree.

Exact resume: `record` holds, for the epoch in progress, the states the epoch started from (the
worker-seed generator before its draw, the order's generator right before the order was drawn).
A checkpoint saved mid-epoch stores them; the resumed epoch replays its draws from them without
touching the global RNG (which the checkpoint restores as it was mid-epoch), so the order and every
generator afterwards are those of the uninterrupted run. Saved between epochs, the generators'
current states are stored and the next epoch draws afresh.

Some draws come from the global RNGs themselves (python, numpy, torch): a custom sampler without a
`generator` that shuffles with ``torch.randperm(n)``, an IterableDataset loaded in this process that
draws per item. For those the record also holds the global host RNGs' states (Python's, NumPy's,
torch's CPU generator) right before the draws began (``"global"``); a resumed epoch replays the draws it skips under that state, then puts back the
checkpoint's (mid-epoch) state, so what comes after the skip draws exactly as in the uninterrupted run.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from fabric_lite.data.rng_states import HostRngStates, checkpointable, restore

__all__ = ["EpochRandomness"]

# "global": every global RNG right before a draw from them began; "pending": an iterable loader's global
# RNGs right before it fetched the batch it holds ahead (see DataLoaderShard.__iter__)
_KEYS = ("base", "order", "loader", "global", "pending")


def _draw(generator: Optional[torch.Generator]) -> int:
    """One number as a DataLoader or a RandomSampler draws it (from the global RNG for None)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _state(generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.get_rng_state() if generator is None else generator.get_state()


class EpochRandomness:
    """The generators one prepared loader draws from, and the record of the epoch in progress.

    `loader_generator`: the user's ``DataLoader(generator=...)`` (None: the global RNG).
    `sampler`: the loader's copy of the user's sampler when it has a ``generator`` attribute (the
    object whose ``generator`` draws the order), else None.
    `global_order`: the class name of a sampler (or batch sampler) that has no ``generator`` and may draw
    its order from the global RNGs (anything but torch's SequentialSampler), else None.
    """

    def __init__(self, loader_generator: Optional[torch.Generator], sampler: Any, num_replicas: int,
                 broadcast: Callable[[Any], Any], global_order: Optional[str] = None) -> None:
        self.loader_generator = loader_generator
        self.sampler = sampler
        self.global_order = global_order
        #: The checkpoint's global RNG states, kept while a resumed epoch replays draws under older ones.
        self.stashed: Optional[HostRngStates] = None
        self.warned = False
        self.own: Optional[torch.Generator] = None
        if sampler is not None and sampler.generator is None:
            self.own = torch.Generator()
            sampler.generator = self.own
        self.num_replicas = num_replicas
        self.broadcast = broadcast
        #: The epoch in progress: the states it started from (see the module docstring); None between epochs.
        #: Generator states (tensors, or None) under "base", "loader" and "order"; the global RNGs' states
        #: (`HostRngStates`, or their checkpoint form once loaded) under the keys `replay_global` records.
        self.record: Optional[Dict[str, Any]] = None
        #: The epoch replays `record` (loaded from a checkpoint) instead of drawing.
        self.resuming = False
        #: The resumed epoch's skipped draws from the global RNGs were replayed: later ones are recorded again.
        self.replayed = False

    @property
    def order_generator(self) -> Optional[torch.Generator]:
        return self.sampler.generator if self.sampler is not None else None

    def _user_generators(self) -> List[torch.Generator]:
        found: List[torch.Generator] = []
        for gen in (self.loader_generator, self.order_generator):
            if gen is not None and gen is not self.own and all(gen is not g for g in found):
                found.append(gen)
        return found

    def agree(self) -> None:
        """Several processes, at prepare: every rank's generators take rank 0's states."""
        generators = self._user_generators()
        if generators:
            for gen, state in zip(generators, self.broadcast([g.get_state() for g in generators])):
                gen.set_state(state)

    # -- one epoch: start, the DataLoader's iterator, the sampler's order, end -------------------------

    def start_epoch(self, resumed: bool) -> None:
        """A new epoch; `resumed`: it continues the epoch of a loaded checkpoint, whose draws `record` holds."""
        self.resuming = resumed and self.record is not None
        self.replayed = False
        if not self.resuming:
            self.record = None

    def end_epoch(self) -> None:
        self.record = None
        self.resuming = False

    def iterator_generator(self, replay: Optional[torch.Tensor] = None) -> Optional[torch.Generator]:
        """What the DataLoader's next iterator draws its workers' seed from: the user's generator (or the
        global RNG); when resuming, a copy of it as the saved epoch started, which leaves the real one (already
        past that draw) alone. `replay`: draw from a copy in that state instead (the saved run's persistent
        workers were seeded from it, and it drew no seed when its later epochs began)."""
        if self.resuming or replay is not None:
            copy = torch.Generator()
            base = replay if replay is not None else (self.record or {}).get("base")
            if base is not None:
                copy.set_state(base)
            if self.record is None:
                self.record = {}
            self.record["base"] = base
            return copy
        self.record = {"base": _state(self.loader_generator)}
        return self.loader_generator

    def iterator_built(self) -> None:
        """After the DataLoader built its iterator: a DataLoader generator that does not draw the order is
        recorded (or, resuming, put back) as it is after the worker-seed draw."""
        gen = self.loader_generator
        if gen is None or gen is self.order_generator:
            return
        if self.resuming:
            saved = (self.record or {}).get("loader")
            if saved is not None:
                gen.set_state(saved)
        elif self.record is not None:
            self.record["loader"] = gen.get_state()

    def before_order(self) -> None:
        """Right before the sampler draws this epoch's order (called by the sharded sampler)."""
        gen = self.order_generator
        if self.global_order is not None:
            self.replay_global("the order drawn by " + self.global_order)
        if self.resuming:
            saved = (self.record or {}).get("order")
            if gen is None:
                return
            if saved is not None:
                gen.set_state(saved)
                return
            # nothing saved to replay (the checkpoint's loader had no shuffling sampler): draw afresh
        if self.own is not None:
            seed = _draw(None)  # RandomSampler's own draw for an epoch
            if self.num_replicas > 1:
                seed = self.broadcast(seed)
            self.own.manual_seed(seed)
        if self.record is None:
            self.record = {"base": None}
        self.record["order"] = gen.get_state() if gen is not None else None

    # -- draws from the global RNGs (a custom sampler, an iterable dataset loaded in this process) ------

    def replay_global(self, what: str, key: str = "global") -> None:
        """Right before draws from the global RNGs that a resumed epoch skips: record the states (a new epoch),
        or, resuming, switch to the recorded ones until `end_replay` puts the checkpoint's back."""
        if not self.resuming or self.replayed:
            if self.record is None:
                self.record = {"base": None}
            self.record[key] = HostRngStates()  # (every batch for an iterable dataset: kept raw till saved)
            return
        saved = (self.record or {}).get(key)
        if saved is None:
            self.warn_once(f"{what} draws from the global random number generators, and the checkpoint holds no "
                           f"state of theirs from before those draws (it was saved by an older version): the "
                           f"resumed epoch redraws them from the checkpoint's mid-epoch state, so it sees other "
                           f"samples (or other random values) than the uninterrupted run would. Give the sampler a "
                           f"`generator` attribute to draw from, or resume from a checkpoint saved at an epoch's end.")
            return
        if self.stashed is None:
            self.stashed = HostRngStates()
        restore(saved)

    def end_replay(self) -> None:
        """The skipped draws are done: the global RNGs go on from the checkpoint's states."""
        self.replayed = self.resuming
        if self.stashed is not None:
            self.stashed.restore()
            self.stashed = None

    def warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, stacklevel=4)

    # -- checkpoints -------------------------------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        if self.record is not None:
            return {"drawn": True, **{k: checkpointable(self.record[k]) for k in _KEYS if k in self.record}}
        order, loader = self.order_generator, self.loader_generator
        return {"drawn": False, "base": None,
                "order": order.get_state() if order is not None and order is not self.own else None,
                "loader": loader.get_state() if loader is not None and loader is not order else None}

    def load(self, saved: Dict[str, Any]) -> None:
        self.resuming = False
        self.stashed = None
        if saved.get("drawn"):
            self.record = {k: saved[k] for k in _KEYS if k in saved}
            return
        self.record = None
        order, loader = self.order_generator, self.loader_generator
        if saved.get("order") is not None and order is not None and order is not self.own:
            order.set_state(saved["order"])
        if saved.get("loader") is not None and loader is not None and loader is not order:
            loader.set_state(saved["loader"])

    def load_legacy(self, base_seed: int, epoch: int, draws_before_sampler: int) -> None:
        """A checkpoint from before generator states were stored: its epoch replays the order the loader
        drew then (a generator seeded with base_seed + epoch); later epochs draw as described above."""
        base, order = torch.Generator(), torch.Generator()
        base.manual_seed(base_seed + epoch + (1 << 40))
        order.manual_seed(base_seed + epoch)
        for _ in range(draws_before_sampler):
            _draw(order)
        self.resuming = False
        self.record = {"base": base.get_state(), "order": order.get_state(), "loader": None}
