"""Manual optimization (`automatic_optimization = False`) over a strategy whose wrapper averages gradients in the
one backward after each forward (DDP): the module may call `manual_backward` several times per `training_step`
(a GAN's discriminator and generator losses), which that wrapper cannot follow. The step then runs unwrapped, and
each optimizer averages its own parameters' gradients over the processes just before it steps."""

from __future__ import annotations

from typing import Any, Callable, List

import torch

__all__ = ["average_gradients_before_step"]


def average_gradients_before_step(strategy: Any) -> Callable[..., None]:
    """An optimizer step pre-hook: the mean over every process of the gradients of the optimizer's parameters
    (one collective per step, over one flat buffer). Every process steps the same optimizers in the same order, so
    the collectives match; parameters without a gradient (frozen, or untouched by this step's losses on every
    process) are left out."""

    def average(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        grads: List[torch.Tensor] = [p.grad for group in optimizer.param_groups for p in group["params"]
                                     if p.grad is not None]
        if not grads:
            return
        flat = strategy.collectives.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    return average
