"""The collectives of `self.log(..., sync_dist=True)`: reducing a value, and checking first that every
process logged the same synced names (a name missing on one process would hang the reduction)."""

from __future__ import annotations

import hashlib
from typing import Any, List

import torch

from fabric_lite.strategies.base import Strategy

__all__ = ["reduce_value", "check_same_sync_names"]


def reduce_value(strategy: Strategy, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """`tensor` reduced across processes by `op` (mean/sum/max/min), over `group` when one is given."""
    if strategy.world_size == 1:
        return tensor
    if group is None:  # (logged values are averaged over the data-parallel group)
        return strategy.collectives.over("dp").all_reduce(tensor, op)
    import torch.distributed as dist

    out = tensor.detach().clone()
    dist.all_reduce(out, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM),
                    group=group)
    return out / dist.get_world_size(group) if op == "mean" else out


def check_same_sync_names(strategy: Strategy, stage: str, names: List[str], kind: str = "") -> None:
    """Raise on every process when the processes are about to reduce different names; every process calls it."""
    if strategy.world_size == 1:
        return
    # One tiny all-reduce compares a fingerprint of each process's names (max and -min at once);
    # only when they differ are the names themselves gathered, to say which process logged what.
    digest = hashlib.blake2b("\0".join(sorted(names)).encode(), digest_size=8).digest()
    fingerprint = int.from_bytes(digest, "little") >> 1  # 63 bits: -fingerprint fits an int64 too
    dp = strategy.collectives.over("dp")
    spread = dp.all_reduce(torch.tensor([fingerprint, -fingerprint], dtype=torch.long, device=strategy.root_device),
                           "max")
    highest, minus_lowest = spread.tolist()
    if highest == -minus_lowest:
        return
    everyone = dp.all_gather_object(sorted(names))
    if any(keys != everyone[0] for keys in everyone):
        detail = "; ".join(f"rank {r}: {keys}" for r, keys in enumerate(everyone))
        raise RuntimeError(
            f"self.log(..., sync_dist=True) was called for different {kind}names on different processes in "
            f"stage {stage!r} ({detail}). Every process must log the same synced names, or a collective "
            f"would hang. A value only one process has is logged with rank_zero_only=True (without sync_dist).")
