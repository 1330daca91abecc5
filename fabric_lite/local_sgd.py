"""Local SGD on top of the Accelerator (Accelerate's `accelerate.local_sgd.LocalSGD`): each process takes its own
optimizer steps without synchronizing gradients, and every `local_sgd_steps` steps the model's parameters are
averaged over the processes.

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, batch))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()

Inside the block DDP's gradient all-reduce is off (gradient accumulation still works: its windows close as usual,
with local gradients); `step()` counts calls and averages the parameters at every `local_sgd_steps`-th; leaving the
block averages them once more. The optimizers' states stay each process's own. On one process, or with
`enabled=False`, it does nothing. It needs whole parameters in every process, averaged by DDP's reducer: strategies
that shard them (FSDP, DeepSpeed) or reduce over a device runtime's own collectives are refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from fabric_lite.accelerator.enums import DistributedType

__all__ = ["LocalSGD"]

# Kinds of run whose processes each hold the whole model and reduce gradients with DDP (or train alone).
_REPLICATED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_NPU,
               DistributedType.MULTI_MLU, DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA,
               DistributedType.MULTI_XPU, DistributedType.MULTI_HPU}
#: Elements averaged in one all-reduce (64 MiB in fp32): the flat copy is never the whole of a big model.
BUCKET_ELEMENTS = 1 << 24


class LocalSGD:
    """Run `local_sgd_steps` optimizer steps on each process independently, then average the model's parameters.

    `accelerator`: the `Accelerator` the model was prepared with; `model`: the prepared model (as `prepare`
    returned it; the model it wraps is found too); `local_sgd_steps`: steps between averages (an integer >= 1;
    may be None when `enabled=False`); `enabled`: False makes it a no-op, as on one process.
    """

    def __init__(self, accelerator: Any, model: nn.Module, local_sgd_steps: Optional[int], enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if enabled and kind not in _REPLICATED:
            raise NotImplementedError(
                f"LocalSGD averages whole parameters that every process holds, and this run is {kind} "
                f"(strategy {type(accelerator.strategy).__name__}), which "
                f"{'shards them' if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED) else 'reduces them its own way'}. "
                f"Train with plain data parallel (MULTI_CPU/MULTI_GPU, strategy='ddp') for LocalSGD, or pass "
                f"enabled=False.")
        if enabled and (not isinstance(local_sgd_steps, int) or isinstance(local_sgd_steps, bool) or local_sgd_steps < 1):
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): pass the number of optimizer steps between "
                             f"parameter averages, an integer >= 1 (or enabled=False to turn LocalSGD off).")
        self.accelerator = accelerator
        self.local_sgd_steps: int = local_sgd_steps or 1  # (checked above when enabled)
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        self.num_steps = 0
        self.model = _prepared(accelerator, model) if self.enabled else model
        self._no_sync: Any = None

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        context, self._no_sync = self._no_sync, None
        try:
            # After an error the other processes may not reach this point: no collective that would wait for them.
            if exc_type is None:
                self._average_parameters()
        finally:
            context.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count one step; every `local_sgd_steps`-th averages the parameters over the processes."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        """Replace every trainable parameter by its mean over the processes, in place (the optimizers keep
        pointing at the same tensors); 16-bit parameters are summed in fp32."""
        with torch.no_grad():
            for params in _buckets([p for p in self.model.parameters() if p.requires_grad]):
                dtype = params[0].dtype
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                if dtype in (torch.float16, torch.bfloat16):
                    flat = flat.float()
                mean = self.accelerator.reduce(flat, reduction="mean")
                offset = 0
                for p in params:
                    p.copy_(mean[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()


def _prepared(accelerator: Any, model: nn.Module) -> nn.Module:
    """The prepared model `model` is or wraps (its no_sync is the one that stops DDP's all-reduce)."""
    for prepared in accelerator.models:
        if prepared is model:
            return prepared
    for prepared in accelerator.models:
        if accelerator.unwrap_model(prepared) is model:
            return prepared
    raise ValueError(f"LocalSGD(model=...) got a {type(model).__name__} that this accelerator did not prepare: pass the "
                     f"model accelerator.prepare() returned, so that its gradient all-reduce can be turned off.")


def _buckets(params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Parameters grouped by device and dtype, in their order, each group at most BUCKET_ELEMENTS (unless one
    parameter alone is bigger)."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
    sizes: Dict[Tuple[torch.device, torch.dtype], int] = {}  # elements in each group's last run
    for p in params:
        key = (p.device, p.dtype)
        runs = groups.setdefault(key, [[]])
        if runs[-1] and sizes[key] + p.numel() > BUCKET_ELEMENTS:
            runs.append([])
            sizes[key] = 0
        runs[-1].append(p)
        sizes[key] = sizes.get(key, 0) + p.numel()
    return [run for runs in groups.values() for run in runs]
