"""`ParallelStrategy`: the base of the strategies that train over several processes or replicas (Lightning's name).

DDP, FSDP, DeepSpeed and the device-runtime strategies derive from it; `isinstance(trainer.strategy, ParallelStrategy)` tells code written
for Lightning that the run may span processes. It adds one of Lightning's names, `num_processes`; the collectives,
the data-parallel group and the process facts are the base contract's, identities on one process.
"""

from __future__ import annotations

from fabric_lite.strategies.base import Strategy

__all__ = ["ParallelStrategy"]


class ParallelStrategy(Strategy):
    """A strategy over several processes or replicas (DDP, FSDP, DeepSpeed, a runtime's replicas); see `Strategy` for its members."""

    @property
    def num_processes(self) -> int:
        """The processes on this node, one per device (Lightning's `ParallelStrategy.num_processes`)."""
        return self.process.local_world_size
