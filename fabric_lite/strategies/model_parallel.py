"""Lightning's `ModelParallelStrategy`: data parallel x tensor parallel over a named 2-D device mesh (Trainer door).

``ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=T)`` builds torch's DeviceMesh with the
dimensions "data_parallel" and "tensor_parallel" (D x T processes, tensor-parallel ranks neighbours) before the
module's `configure_model()` runs, where `self.device_mesh` is that mesh. The module applies tensor parallelism
(`parallelize_module(..., self.device_mesh["tensor_parallel"], plan)`) and, if it likes, `fully_shard` over
`self.device_mesh["data_parallel"]`; whatever it did not shard, the strategy shards over "data_parallel" with FSDP2
when the model is prepared. Data, `self.log(..., sync_dist=True)` and metrics count the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from fabric_lite.strategies.base import Traits
from fabric_lite.strategies.fsdp import FSDPStrategy
from fabric_lite.strategies.mesh_shape import MeshShape

__all__ = ["ModelParallelStrategy"]

_DIMENSIONS = ("data_parallel", "tensor_parallel")


class ModelParallelStrategy(FSDPStrategy):
    """Data parallel (FSDP2) x tensor parallel; "auto" sizes: the nodes x the processes on each node."""

    traits = Traits(names=("model_parallel",), accelerate_type="FSDP", syncs_gradients_per_forward=True)

    def __init__(self, data_parallel_size: Union[str, int] = "auto", tensor_parallel_size: Union[str, int] = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: Optional[str] = None,
                 timeout: Any = None) -> None:
        super().__init__(state_dict_type="sharded" if save_distributed_checkpoint else "full",
                         process_group_backend=process_group_backend, timeout=timeout)
        for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelParallelStrategy({name}={value!r}): give an integer >= 1, or 'auto'.")
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    def setup_environment(self) -> None:
        self.mesh_shape = self.resolve_shape()
        super().setup_environment()

    def resolve_shape(self) -> MeshShape:
        """The sizes, "auto" resolved: tensor parallel within a node (its processes), data parallel across nodes."""
        world, per_node = self.world_size, self.process.local_world_size
        tp = per_node if self.tensor_parallel_size == "auto" else int(self.tensor_parallel_size)
        dp = world // tp if self.data_parallel_size == "auto" else int(self.data_parallel_size)
        if dp * tp != world:
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={self.data_parallel_size!r}, tensor_parallel_size="
                f"{self.tensor_parallel_size!r}): {dp} x {tp} = {dp * tp} processes, but this run has {world}. Give "
                f"sizes whose product is {world}, or leave them 'auto'.")
        return MeshShape(dp_shard=dp, tp=tp)

    def build_torch_mesh(self, shape: MeshShape) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, (shape.dp, shape.tp), mesh_dim_names=_DIMENSIONS)

    def fsdp_mesh_dimensions(self, shape: MeshShape) -> Tuple[str, ...]:
        return ("data_parallel",)
