"""The module the strategy wraps for the Trainer: its forward runs the TrainModule's step method for a stage, so DDP
(or FSDP, DeepSpeed) sees a forward; its state dict is the TrainModule's own (checkpoints hold the user's names)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from fabric_lite.trainer.module import TrainModule

__all__ = ["StepRunner", "STEP_METHODS", "takes_batch_idx"]


STEP_METHODS = {"train": "training_step", "validate": "validation_step", "test": "test_step",
                 "predict": "predict_step"}


class StepRunner(nn.Module):
    """Routes the strategy's wrapped forward to the module's step methods (so DDP sees a forward)."""

    def __init__(self, module: TrainModule) -> None:
        super().__init__()
        self.module = module
        # Lightning calls a step method that names no batch index (`def training_step(self, batch)`, as its GAN
        # and PPO templates write it) with the batch alone; decided here once, not at every step.
        self.without_batch_idx = {stage for stage, name in STEP_METHODS.items()
                                  if not takes_batch_idx(getattr(module, name))}

    # Checkpoints hold the TrainModule's own keys ("net.0.weight", not "module.net.0.weight"), so
    # the exported weights load straight into the user's module.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, batch: Any, batch_idx: int, stage: str = "train", *dataloader_idx: int) -> Any:
        # (`dataloader_idx` only with several evaluation or prediction loaders, as Lightning passes it)
        if stage in self.without_batch_idx:
            return getattr(self.module, STEP_METHODS[stage])(batch)
        return getattr(self.module, STEP_METHODS[stage])(batch, batch_idx, *dataloader_idx)


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a step method accepts a batch index: a `batch_idx` parameter, `*args`, or a second positional."""
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: pass the index, as before
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 2)
