"""FSDP's full state dicts (`FSDPStrategy.checkpoint_format`): gathered from the shards onto rank 0, scattered back.

A full state dict is what `save_model`, `get_state_dict` and a "full" checkpoint (`state_dict_type="full"`) read
and write: every sharded tensor is gathered one at a time onto rank 0's CPU memory, and loaded back by scattering
each tensor from rank 0 to the shards, so no process holds more than one whole tensor at a time. Sharded
checkpoints ("dcp") go through torch.distributed.checkpoint instead (checkpoint/sharded.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import nn

from fabric_lite.checkpoint.fit import fit_problem, shapes_of
from fabric_lite.strategies.checkpoint_format import CheckpointFormat
from fabric_lite.strategies.fsdp_blocks import is_dtensor

if TYPE_CHECKING:
    from fabric_lite.strategies.fsdp import FSDPStrategy

__all__ = ["FSDPCheckpointFormat"]


class FSDPCheckpointFormat(CheckpointFormat):
    """DCP shards or whole state dicts; either way the full state dicts are gathered to rank 0 and scattered back.

    Between micro-steps FSDP keeps the unsharded partial gradients in its own buffers, not `param.grad`
    (`partial_gradients=False`); big weights are read on rank 0 and scattered (`weights_on_rank_zero=True`).
    """

    def __init__(self, strategy: "FSDPStrategy", kind: str) -> None:
        super().__init__(strategy, kind, partial_gradients=False, weights_on_rank_zero=True)

    def module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """The full state dict, gathered shard by shard onto rank 0's CPU memory (empty on other ranks)."""
        rank_zero = self.strategy.is_global_zero
        out: Dict[str, Any] = {}
        for name, value in module.state_dict().items():
            if is_dtensor(value):
                value = self._gathered(value)
            if rank_zero:
                out[name] = value.detach().cpu()
        return out

    def _gathered(self, value: Any) -> torch.Tensor:
        """The whole tensor of a sharded one (a collective); offloaded shards travel through the GPU, as NCCL needs."""
        device = self.strategy.root_device
        if value.device != device:
            value = value.to(device)
        return value.full_tensor()

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, Any], strict: bool = True) -> None:
        """Load a full state dict (needed on rank 0 only; the others may pass {}): each tensor is scattered
        from rank 0 to the shards, so no process holds more than one whole tensor at a time."""
        strategy = self.strategy
        current = module.state_dict()
        if any(getattr(v, "is_meta", False) for v in current.values()):
            raise ValueError("This model is still on the meta device: prepare it first (prepare() gives each process "
                             "its shards), then load the weights.")
        problem = None
        if strategy.is_global_zero:
            problem = fit_problem(shapes_of(current), shapes_of(state), strict)
            if problem:
                problem = (f"The weights do not fit this model: {problem}. Nothing was loaded. Load weights of this "
                           f"model (strict=False allows missing or unexpected keys).")
        problem = strategy.collectives.broadcast_object(problem)
        if problem:
            raise ValueError(problem)
        from torch.distributed.tensor import distribute_tensor

        names = [n for n in current if n in state] if strategy.is_global_zero else None
        names = strategy.collectives.broadcast_object(names)
        with torch.no_grad():
            for name in names:
                target = current[name]
                if is_dtensor(target):
                    src = state[name] if strategy.is_global_zero else torch.empty(target.shape, dtype=target.dtype)
                    shard = distribute_tensor(src.to(device=strategy.root_device, dtype=target.dtype),
                                              target.device_mesh, target.placements, src_data_rank=0)
                    target.to_local().copy_(shard.to_local())
                else:
                    src = state[name] if strategy.is_global_zero else torch.empty_like(target)
                    target.copy_(strategy.collectives.broadcast(src.to(device=target.device, dtype=target.dtype).contiguous()))

    def optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's full state (each sharded tensor gathered), meaningful on rank 0."""
        rank_zero = self.strategy.is_global_zero
        state = optimizer.state_dict()
        full: Dict[Any, Any] = {}
        for index in sorted(state["state"]):  # the same order on every rank: each gather is a collective
            entry = {}
            for key, value in state["state"][index].items():
                if is_dtensor(value):
                    value = self._gathered(value)
                entry[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
            if rank_zero:
                full[index] = entry
        # a collective (every rank calls it); the whole state is kept on rank 0 only
        return {"state": full, "param_groups": state["param_groups"]}

    def load_optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer,
                                  state: Dict[str, Any]) -> None:
        """Load a full optimizer state (every rank holds it): each process keeps the slices of its shards."""
        from torch.distributed.tensor import distribute_tensor

        device = self.strategy.root_device
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in state["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(params):
            raise ValueError(f"The saved optimizer state has {len(saved_ids)} parameters; this optimizer has "
                             f"{len(params)}. Build the optimizer as the run that saved it did.")
        by_id = dict(zip(saved_ids, params))
        sharded: Dict[Any, Any] = {}
        for index, entry in state["state"].items():
            p = by_id.get(index)
            out = {}
            for key, value in entry.items():
                if p is not None and is_dtensor(p) and isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value = distribute_tensor(value.to(device), p.device_mesh, p.placements,
                                              src_data_rank=None).to(p.device)
                out[key] = value
            sharded[index] = out
        optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})
