"""TPUs (and other XLA devices) through torch_xla: data-parallel replicas ("xla") or SPMD over a mesh ("xla_spmd").

This strategy places models and batches on the replica's XLA device, averages gradients with XLA's all-reduce
when a backward closes an accumulation window (as DDP does, so clipping and the optimizer see global gradients),
and maps the collectives to XLA's. Its runtime (`xla_runtime.py`) starts torch_xla, places the replicas, feeds
batches and marks steps. Checkpoints hold plain CPU tensors: one written on a TPU loads on a CPU and back.

`XLASPMDStrategy` drives every device from one process: parameters stay replicated, each batch is split
along its first dimension over a one-axis mesh ("data"), and the compiler inserts the gradient reduction.
"""

from __future__ import annotations

import contextlib
import pickle
import weakref
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
from torch import nn

from fabric_lite._tree import tree_map
from fabric_lite.strategies.base import Traits
from fabric_lite.strategies.parallel import ParallelStrategy
from fabric_lite.strategies.moved_params import MovedParameters
from fabric_lite.strategies.collectives import Collectives
from fabric_lite.strategies.runtime import RuntimeSlot, Slot
from fabric_lite.strategies.xla_runtime import (  # (import_torch_xla & co.: importable from here as before)
    XLARuntime, XLASPMDRuntime, abort_replica_barriers, import_torch_xla, torch_xla_problem,
)

__all__ = ["XLAStrategy", "XLASPMDStrategy", "import_torch_xla", "torch_xla_problem", "abort_replica_barriers"]


class XLACollectives(Collectives):
    """The collectives among XLA replicas, each built on one channel-numbered all-gather (`rows`).

    Replicas that are threads of one process (XLA's CPU device, TPU v2/v3) hang in XLA's all-reduce when two of
    them compile the same graph at once: each compile numbers its all-reduce differently and the threads wait at
    different rendezvous. An all-gather with a channel id is numbered by that id, so every collective here is built
    on one; only gradients of replicas that are processes (one per TPU chip) take XLA's all-reduce (the strategy's
    `_average_in_place`), which moves W times less data.
    """

    def rows(self, tensor: torch.Tensor, now: bool = True) -> torch.Tensor:
        """Every replica's `tensor`, stacked along a new first dimension (on this replica's device); `now`:
        the exchange runs before returning, with every replica in it (reading the result is then safe)."""
        strategy = self.strategy
        t = tensor if tensor.device.type == "xla" else tensor.to(strategy.root_device)
        rows = strategy.runtime.xm.all_gather(t.unsqueeze(0), dim=0, pin_layout=False, channel_id=1,
                                   use_global_device_ids=True, groups=[list(range(strategy.world_size))])
        if now:
            strategy.runtime.sync()
        return rows

    def primitive_barrier(self) -> None:
        self.rows(torch.zeros(1)).cpu()  # returns once every replica has sent its part

    def primitive_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        rows = self.rows(tensor)
        reduced = rows.sum(0) if op == "sum" else (rows.amax(0) if op == "max" else rows.amin(0))
        tensor.copy_(reduced)

    def primitive_all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        return list(self.rows(tensor).to(tensor.device).unbind(0))

    def primitive_broadcast(self, tensor: torch.Tensor, src: int) -> None:
        tensor.copy_(self.rows(tensor)[src])

    def exchange(self, obj: Any) -> List[Any]:
        """Every replica's `obj` (pickled: the payloads come from this job's own replicas, as with
        torch.distributed's object collectives)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(n) for n in self.rows(torch.tensor([payload.numel()])).cpu().reshape(-1)]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        rows = self.rows(padded).cpu()
        return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]

    def primitive_all_gather_object(self, out: List[Any], obj: Any) -> None:
        out[:] = self.exchange(obj)

    def primitive_broadcast_object_list(self, box: List[Any], src: int) -> None:
        box[0] = self.exchange(box[0] if self.rank == src else None)[src]


class XLAStrategy(ParallelStrategy):
    """One replica per XLA device (a TPU core, or XLA's CPU device); gradients averaged by XLA's all-reduce.

    ``XLAStrategy(sync_module_states=True)``: every replica starts from replica 0's weights, as under DDP.
    """

    traits = Traits(names=("xla",), accelerate_type="XLA")
    runtime = RuntimeSlot(XLARuntime)
    collectives = Slot(XLACollectives, "collectives")

    def __init__(self, sync_module_states: bool = True) -> None:
        super().__init__()
        from fabric_lite.strategies.xla_state import XLACheckpointFormat

        #: Plain CPU tensors, never copied in the background: reading XLA tensors to the host runs the pending graph.
        self.checkpoint_format = XLACheckpointFormat(self)
        self.sync_module_states = sync_module_states
        self._modules: List["weakref.ref[nn.Module]"] = []  # in preparation order: every replica reduces alike
        self._syncing: Dict[int, bool] = {}  # id(module) -> gradients are reduced by the next backward
        self._moved = MovedParameters()

    # -- set-up ------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if not self.runtime.started:
            raise RuntimeError(f"{type(self).__name__} was not started: build it through Accelerator/Trainer "
                               f"(accelerator='tpu'), which start the XLA runtime.")

    def setup_module(self, module: nn.Module) -> nn.Module:
        before = dict(module.named_parameters())
        module = self.precision.convert_module(module).to(self.root_device)
        self._moved.record(before, dict(module.named_parameters()))
        if self.world_size > 1 and self.sync_module_states:  # replica 0's weights everywhere, as under DDP
            self._broadcast_in_place([*module.parameters(), *module.buffers()])
            self.runtime.mark_step()  # (as at the start: a run resumed from a checkpoint marks the same steps)
        self._modules.append(weakref.ref(module))
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built before `prepare` at the model's XLA parameters (by name): moving a module to
        an XLA device makes new Parameter objects."""
        self._moved.repoint(optimizer, "the model before it moved to the XLA device",
                            lambda p: p.device.type == "xla", (self.traits.names or ("xla",))[0])
        return optimizer

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        return module

    def teardown(self) -> None:
        if self.runtime.started:
            self.runtime.sync()
        self._modules.clear()

    # -- the step ----------------------------------------------------------------------------------
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if not enabled or self.world_size == 1:
            return contextlib.nullcontext()
        return self._gradient_sync(module, False)

    def force_backward_sync(self, module: nn.Module) -> ContextManager:
        if self.world_size == 1:
            return contextlib.nullcontext()
        return self._gradient_sync(module, True)

    @contextlib.contextmanager
    def _gradient_sync(self, module: nn.Module, sync: bool) -> Any:
        key = id(module)
        previous = self._syncing.get(key, True)  # (nested contexts restore what they found)
        self._syncing[key] = sync
        try:
            yield
        finally:
            self._syncing[key] = previous

    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        self.precision.backward(loss, **kwargs)
        if self.world_size > 1:
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        """Average the gradients of every prepared model outside a no-sync window, in place (one all-reduce).
        An average of gradients already averaged changes nothing, so a backward that touched one of two
        models costs only bandwidth."""
        grads: List[torch.Tensor] = []
        seen: set = set()
        for ref in self._modules:
            module = ref()
            if module is None or not self._syncing.get(id(module), True):
                continue
            for p in module.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    grads.append(p.grad)
        if grads:
            self._average_in_place(grads)
            if self.runtime.threads:
                self.runtime.sync()  # the exchange runs now, with every replica in it, not at a read of the gradients

    def batch_to_device(self, batch: Any) -> Any:
        device = self.root_device
        return tree_map(lambda t: t.to(device), batch)

    # -- gradients and weights in place, through XLA (the other collectives: XLACollectives) -------------
    def _average_in_place(self, tensors: List[torch.Tensor]) -> None:
        if self.runtime.threads and self.world_size > 1:
            self._exchange_flat(tensors, lambda rows: rows.sum(0) / self.world_size)
        else:
            xm = self.runtime.xm
            xm.all_reduce(xm.REDUCE_SUM, tensors, scale=1.0 / self.world_size)

    def _broadcast_in_place(self, tensors: List[torch.Tensor], src: int = 0) -> None:
        if self.runtime.threads:
            self._exchange_flat(tensors, lambda rows: rows[src])
        else:
            self.runtime.xm.collective_broadcast(tensors, root_ordinal=src)

    def _exchange_flat(self, tensors: List[torch.Tensor], combine: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One all-gather per dtype of the tensors flattened together; `combine(rows)` gives the new flat values,
        copied back in place."""
        with torch.no_grad():
            for group in _by_dtype(tensors):
                flat = combine(self.collectives.rows(torch.cat([t.reshape(-1) for t in group]), now=False))
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


def _by_dtype(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


class XLASPMDStrategy(XLAStrategy):
    """One process drives every XLA device: weights replicated, each batch split over a one-axis "data"
    mesh; the compiler inserts the gradient reduction. Global batches must divide by the device count."""

    traits = Traits(names=("xla_spmd",), accelerate_type="XLA")
    runtime = RuntimeSlot(XLASPMDRuntime)

    def __init__(self) -> None:
        super().__init__(sync_module_states=False)
        self.mesh: Any = None

    def setup_environment(self) -> None:
        super().setup_environment()
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        count = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(count), (count,), ("data",))
        self.runtime.driven_devices = count

    def batch_to_device(self, batch: Any) -> Any:
        import torch_xla.distributed.spmd as xs

        xm, device, mesh = self.runtime.xm, self.root_device, self.mesh

        def send(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0:
                return t.to(device)
            spec = xs.ShardingSpec(mesh, ("data",) + (None,) * (t.dim() - 1))
            return xm.send_cpu_data_to_device(t, device, input_sharding=spec)[0]

        return tree_map(send, batch)
