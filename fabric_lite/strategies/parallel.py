"""`ParallelStrategy`: the base of the strategies that train over several processes or replicas (Lightning's name).

DDP, FSDP, DeepSpeed and XLA derive from it; `isinstance(trainer.strategy, ParallelStrategy)` tells code written
for Lightning that the run may span processes. It adds no member to `Strategy`: the collectives, the data-parallel
group and the process facts are the base contract's, identities on one process.
"""

from __future__ import annotations

from fabric_lite.strategies.base import Strategy

__all__ = ["ParallelStrategy"]


class ParallelStrategy(Strategy):
    """A strategy over several processes or replicas (DDP, FSDP, DeepSpeed, XLA); see `Strategy` for its members."""
