"""How the world is laid out for N-D parallelism: data-parallel replicas x data-parallel shards x tensor parallel.

A `MeshShape` is a plain value (tested without processes). Global ranks number its dimensions row-major in the
order `dp_replicate`, `dp_shard`, `tp` (tensor-parallel ranks are neighbours, so a tensor-parallel group stays on
one node), which is also the order `torch.distributed.device_mesh.init_device_mesh` numbers them in. The doors see
two dimensions of it (`mesh()`): "dp", every data-parallel rank (replicas and shards flattened), and "tp".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Tuple

if TYPE_CHECKING:
    from fabric_lite.strategies.base import Mesh

__all__ = ["MeshShape", "DIMENSIONS"]

DIMENSIONS = ("dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """`dp_replicate` x `dp_shard` x `tp` processes. FSDP shards over `dp_shard` (HSDP: and replicates over
    `dp_replicate`); the user, or the library that built the model, applies tensor parallelism over `tp`."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}_size={value!r} must be an integer >= 1 (1: the dimension is not used).")
        if self.tp > 1 and self.dp_replicate > 1 and self.dp_shard == 1:
            raise ValueError(
                f"dp_replicate_size={self.dp_replicate} with tp_size={self.tp} and dp_shard_size=1 would replicate "
                f"tensor-parallel weights without sharding them, which is not supported: use dp_shard_size="
                f"{self.dp_replicate} and dp_replicate_size=1 (FSDP x TP), or keep dp_replicate_size > 1 with "
                f"dp_shard_size > 1 (HSDP x TP).")

    @property
    def total(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel processes: replicas times shards (each reads its own batches)."""
        return self.dp_replicate * self.dp_shard

    def check_world(self, world_size: int) -> None:
        """Refuse, naming the sizes, a shape whose processes are not the world's."""
        if self.total != world_size:
            raise ValueError(
                f"The parallelism sizes multiply to {self.total} processes (dp_replicate_size={self.dp_replicate} x "
                f"dp_shard_size={self.dp_shard} x tp_size={self.tp}), but this run has {world_size}. Launch "
                f"{self.total} processes, or change the sizes so that they multiply to {world_size}.")

    def mesh(self, global_rank: int, torch_mesh: Any = None) -> "Mesh":
        """The doors' view: ("dp", "tp") with this process's coordinates (and torch's mesh, once built)."""
        from fabric_lite.strategies.base import Mesh

        return Mesh(("dp", "tp"), (self.dp, self.tp), (global_rank // self.tp, global_rank % self.tp), torch_mesh)

    def coordinates(self, global_rank: int) -> Tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) ranks of a process."""
        return global_rank // (self.dp_shard * self.tp), (global_rank // self.tp) % self.dp_shard, global_rank % self.tp

    @property
    def fsdp_dimensions(self) -> Tuple[str, ...]:
        """The dimensions FSDP works over: ("dp_replicate", "dp_shard") for HSDP, else ("dp_shard",)."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def build(self, device_type: str) -> Any:
        """torch's DeviceMesh over every dimension, named as Accelerate names them, with the data-parallel dimensions
        flattened into "dp" as well (every process calls it, at the same point: it creates process groups)."""
        from torch.distributed.device_mesh import init_device_mesh

        root = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=DIMENSIONS)
        # (torch names no public way to join dimensions yet; Accelerate's meshes carry the same "dp" dimension)
        root[("dp_replicate", "dp_shard")]._flatten("dp")
        return root

    def __str__(self) -> str:
        return f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"
