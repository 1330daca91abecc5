"""A shuffling sampler whose order in an epoch depends only on a seed and the epoch's number.

`DataLoaderConfiguration(use_seedable_sampler=True)` puts it in place of a loader's `RandomSampler`: epoch e
is drawn from a generator seeded with ``seed + e``, so the order does not depend on how much the global RNG
was used before (model initialization, dropout, another loader), and every process draws the same order
without a broadcast each epoch. The prepared loader tells it the epoch (`set_epoch`) before each one.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import torch
from torch.utils.data import RandomSampler, Sampler

__all__ = ["SeedableRandomSampler", "seedable_from"]


class SeedableRandomSampler(Sampler[int]):
    """Indices of `data_source` in an order drawn from ``seed + epoch`` (with `replacement`: `num_samples`
    draws with replacement; without, permutations, as many as `num_samples` needs)."""

    def __init__(self, data_source: Any, seed: int, replacement: bool = False,
                 num_samples: Optional[int] = None) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.replacement = replacement
        self._num_samples = num_samples
        self.epoch = 0

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        """The indices of epoch `epoch`."""
        n, count = len(self.data_source), self.num_samples
        generator = torch.Generator()
        generator.manual_seed((self.seed + epoch) % (1 << 64))
        if self.replacement:
            return torch.randint(high=n, size=(count,), dtype=torch.int64, generator=generator)
        parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
        if count % n:
            parts.append(torch.randperm(n, generator=generator)[: count % n])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch).tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> Dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state.get("epoch", self.epoch))


def seedable_from(sampler: Any, seed: int) -> Optional[SeedableRandomSampler]:
    """The seedable replacement for a torch `RandomSampler` (None for any other sampler, which is kept)."""
    if not isinstance(sampler, RandomSampler):
        return None
    return SeedableRandomSampler(sampler.data_source, seed, sampler.replacement, sampler.num_samples)
