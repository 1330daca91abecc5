"""`ParallelStrategy`: the base of the strategies that train over several processes or replicas (Lightning's name).

DDP, FSDP, DeepSpeed and the device-runtime strategies derive from it; `isinstance(trainer.strategy, ParallelStrategy)` tells code written
for Lightning that the run may span processes. It adds two of Lightning's names, `num_processes` and `distributed_sampler_kwargs`; the collectives,
the data-parallel group and the process facts are the base contract's, identities on one process.
"""

from __future__ import annotations

from typing import Dict, Optional

from fabric_lite.strategies.base import Strategy

__all__ = ["ParallelStrategy"]


class ParallelStrategy(Strategy):
    """A strategy over several processes or replicas (DDP, FSDP, DeepSpeed, a runtime's replicas); see `Strategy` for its members."""

    @property
    def distributed_sampler_kwargs(self) -> Optional[Dict[str, int]]:
        """How the data is sharded, as Lightning spells it: ``{"num_replicas": dp_size, "rank": dp_rank}``, or None
        on one process."""
        if self.dp_size == 1:
            return None
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @property
    def num_processes(self) -> int:
        """The processes on this node, one per device (Lightning's `ParallelStrategy.num_processes`)."""
        return self.process.local_world_size
