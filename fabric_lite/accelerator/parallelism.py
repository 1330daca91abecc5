"""Accelerate's `ParallelismConfig`: N-D parallelism for the raw door (`Accelerator(parallelism_config=...)`).

``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S, tp_size=T)`` lays R x S x T processes out as
`strategies.mesh_shape.MeshShape` does: FSDP2 shards over `dp_shard` (HSDP when R > 1 too), the user (or
transformers) applies tensor parallelism on `accelerator.torch_device_mesh["tp"]` before `prepare`, and the doors
shard the data, gather metrics and reduce over the R x S data-parallel ranks only. Context parallelism
(`cp_size > 1`) is not there yet and is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from fabric_lite.refusals import refused
from fabric_lite.strategies.mesh_shape import MeshShape

__all__ = ["ParallelismConfig", "MeshFacts"]


@dataclasses.dataclass
class ParallelismConfig:
    """The sizes of each parallel dimension (1: not used); their product is the number of processes."""

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    tp_handler: Any = None
    cp_handler: Any = None

    def __post_init__(self) -> None:
        if self.cp_size != 1:
            refused("ParallelismConfig(cp_size=...)", "context parallelism",
                    "leave cp_size=1; shard long sequences with tp_size, or train on shorter ones")()
        self.shape()  # (checks the sizes, naming any that is not valid)
        #: torch's DeviceMesh, once an Accelerator built it (`accelerator.torch_device_mesh`).
        self.device_mesh: Any = None

    def shape(self) -> MeshShape:
        """The layout as the strategies take it."""
        return MeshShape(self.dp_replicate_size, self.dp_shard_size, self.tp_size)

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def dp_dim_names(self) -> List[str]:
        """The data-parallel dimensions in use (each process of them reads different batches)."""
        return [name for name, on in (("dp_replicate", self.dp_replicate_enabled),
                                      ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> List[str]:
        """The dimensions in use whose processes read the same batches."""
        return ["tp"] if self.tp_enabled else []

    @property
    def fsdp_dim_names(self) -> List[str]:
        """The dimensions FSDP works over."""
        return list(self.shape().fsdp_dimensions)

    @property
    def active_mesh_dims(self) -> List[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def build_device_mesh(self, device_type: str) -> Any:
        """torch's DeviceMesh with the dimensions dp_replicate, dp_shard and tp (and "dp", the two data-parallel ones
        joined); every process must call it at the same point. The Accelerator builds it itself."""
        self.device_mesh = self.shape().build(device_type)
        return self.device_mesh

    def get_device_mesh(self, device_type: Optional[str] = None) -> Any:
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("ParallelismConfig.get_device_mesh(): no mesh was built yet; pass device_type "
                                 "('cpu', 'cuda'), or read accelerator.torch_device_mesh after Accelerator(...).")
            return self.build_device_mesh(device_type)
        return self.device_mesh


class MeshFacts:
    """The Accelerator's N-D members, as Accelerate names them: torch's mesh and this process's rank in each dimension."""

    strategy: Any
    parallelism_config: Optional[ParallelismConfig]

    @property
    def torch_device_mesh(self) -> Any:
        """torch's DeviceMesh (dimensions dp_replicate, dp_shard, tp and the joined "dp"); with a strategy that lays
        out its own mesh (ModelParallelStrategy: data_parallel, tensor_parallel), that one; else None."""
        return self.strategy.device_mesh.torch

    def _mesh_rank(self, dimension: str, what: str) -> int:
        if self.parallelism_config is None:
            raise RuntimeError(f"{what} is not configured: pass Accelerator(parallelism_config=ParallelismConfig(...)).")
        mesh = self.torch_device_mesh
        if mesh is None or mesh.size(mesh.mesh_dim_names.index(dimension)) == 1:
            return 0
        return int(mesh.get_local_rank(dimension))

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel replicas (dp_replicate; 0 when there is one)."""
        return self._mesh_rank("dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank among the data-parallel shards (dp_shard; 0 when there is one)."""
        return self._mesh_rank("dp_shard", "Shard-based data parallelism")

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in its tensor-parallel group (0 when there is none)."""
        return self._mesh_rank("tp", "Tensor parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """Context parallelism is not there: raises NotSupportedError (a NotImplementedError, as Accelerate raises)."""
        from fabric_lite.refusals import NotSupportedError, message

        raise NotSupportedError(message("context_parallel_rank", "context parallelism (cp_size > 1)",
                                        "leave cp_size at 1; long sequences can use activation checkpointing"))

    @property
    def pipeline_parallel_rank(self) -> int:
        """Pipeline parallelism is not there: raises NotSupportedError (a NotImplementedError, as Accelerate
        raises)."""
        from fabric_lite.refusals import NotSupportedError, message

        raise NotSupportedError(message("pipeline_parallel_rank", "pipeline parallelism",
                                        "lay the model out with FSDP (dp_shard_size) and tensor parallelism (tp_size)"))
