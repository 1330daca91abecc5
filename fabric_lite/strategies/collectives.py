"""The collectives a strategy holds (`strategy.collectives`): reductions, gathers and broadcasts over its processes.

`strategy.collectives` works over the whole world; `strategy.collectives.over("dp")` over one named dimension of the
strategy's device mesh (the doors gather metrics and reduce logged values over the data-parallel group, "dp"). With
one dimension, as every strategy has today, that group is the world; a strategy whose `device_mesh` has several
dimensions gets a torch.distributed group per dimension from its process group (`ProcessGroup.dimension_group`).
Every collective is an identity on a group of one process.

The default talks through torch.distributed, under the process group's hang guard where it has one; a device
runtime with collectives of its own (a runtime's replicas) subclasses `Collectives` and overrides the six `primitive_*`
methods, which see the tensors already laid out (same shape on every process, reductions "sum"/"max"/"min").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["Collectives", "ReduceOp", "REDUCE_OPS"]

ReduceOp = str  # "sum" | "mean" | "max" | "min"
REDUCE_OPS = ("sum", "mean", "max", "min")


class Collectives:
    """Collectives over the strategy's world (or, from `over`, one dimension of its mesh)."""

    def __init__(self, strategy: Any = None, group: Any = None, size: Optional[int] = None,
                 rank: Optional[int] = None) -> None:
        # Held weakly, as the runtime holds it: the strategy holds its collectives.
        self._strategy = None if strategy is None else weakref.ref(strategy)
        #: The torch.distributed group these collectives run in (None: the world) and this process's place in it.
        self.group, self._size, self._rank = group, size, rank
        self._over: Dict[str, "Collectives"] = {}

    @property
    def strategy(self) -> Any:
        return None if self._strategy is None else self._strategy()

    @property
    def size(self) -> int:
        """The processes in this group."""
        return self.strategy.world_size if self._size is None else self._size

    @property
    def rank(self) -> int:
        """This process's rank in this group."""
        return self.strategy.global_rank if self._rank is None else self._rank

    def over(self, dimension: str) -> "Collectives":
        """The collectives over one named dimension of the strategy's device mesh ("dp": the data-parallel group):
        the processes that share every other coordinate with this one. The world itself where the dimension spans
        it (one dimension, as with DDP); otherwise a torch.distributed group per dimension, which the strategy's
        process group builds the first time (every process asks at the same point, as torch requires)."""
        found = self._over.get(dimension)
        if found is not None:
            return found
        strategy = self.strategy
        mesh = strategy.device_mesh
        size = mesh.size(dimension)
        if size == strategy.world_size:
            found = self if self.group is None else type(self)(strategy)
        elif strategy.process_group is None:
            raise NotImplementedError(
                f"Collectives over the mesh dimension {dimension!r} ({mesh}) need a torch.distributed process group, "
                f"which {type(strategy).__name__} does not hold; use the world's (strategy.collectives).")
        else:
            group = strategy.process_group.dimension_group(mesh, dimension)
            found = type(self)(strategy, group=group, size=size, rank=mesh.rank(dimension))
        self._over[dimension] = found
        return found

    # -- the collectives ------------------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if self.size > 1:
            self.primitive_barrier()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce a tensor across processes; returns a new tensor, the input is left alone."""
        op = op.lower()
        if op not in REDUCE_OPS:
            raise ValueError(f"Unknown reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}.")
        size = self.size
        if size == 1:
            return tensor.clone()
        out = tensor.detach().clone()
        self.primitive_all_reduce(out, "sum" if op == "mean" else op)
        if op == "mean":
            out = out / size if out.is_floating_point() else out // size
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every process's tensor along dim 0 (0-dim tensors become length-1).

        Tensors whose first dimension differs between processes are padded for the exchange and
        trimmed after, so callers never have to line shapes up.
        """
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        sizes = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
        all_sizes = [int(s) for s in torch.cat(self.primitive_all_gather(sizes)).tolist()]
        longest = max(all_sizes)
        if longest != tensor.shape[0]:
            pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = self.primitive_all_gather(tensor)
        return torch.cat([p[:n] for p, n in zip(parts, all_sizes)])

    def all_gather_object(self, obj: Any) -> List[Any]:
        size = self.size
        if size == 1:
            return [obj]
        out: List[Any] = [None] * size
        self.primitive_all_gather_object(out, obj)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        self.primitive_broadcast(tensor, src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj if self.rank == src else None]
        self.primitive_broadcast_object_list(box, src)
        return box[0]

    # -- the primitives (torch.distributed) ------------------------------------------------------------
    def guarded(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one torch.distributed collective, under the hang guard where the process group has one."""
        group = self.strategy.process_group
        guard = group.hang_guard if group is not None else None
        return fn() if guard is None else guard.run(name, fn)

    def primitive_barrier(self) -> None:
        import torch.distributed as dist

        self.guarded("barrier", lambda: dist.barrier(group=self.group))

    def primitive_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        self.guarded(f"all_reduce({op})", lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group))

    def primitive_all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.guarded("all_gather", lambda: dist.all_gather(parts, tensor, group=self.group))
        return parts

    def primitive_all_gather_object(self, out: List[Any], obj: Any) -> None:
        import torch.distributed as dist

        self.guarded("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))

    def primitive_broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        if self.group is None:
            self.guarded(f"broadcast(src={src})", lambda: dist.broadcast(tensor, src))
        else:  # (`src` is a rank in this group)
            self.guarded(f"broadcast(src={src})", lambda: dist.broadcast(tensor, group=self.group, group_src=src))

    def primitive_broadcast_object_list(self, box: List[Any], src: int) -> None:
        import torch.distributed as dist

        if self.group is None:
            self.guarded(f"broadcast_object(src={src})", lambda: dist.broadcast_object_list(box, src))
        else:  # (`src` is a rank in this group)
            self.guarded(f"broadcast_object(src={src})",
                         lambda: dist.broadcast_object_list(box, group=self.group, group_src=src))

    def __repr__(self) -> str:
        strategy = self.strategy
        return f"{type(self).__name__}(size={self.size if strategy is not None else '?'})"
