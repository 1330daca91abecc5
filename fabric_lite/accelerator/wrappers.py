"""The prepared optimizer and scheduler: they step only when gradients are complete."""

from __future__ import annotations

import itertools
from typing import Any, Callable, DefaultDict, Dict, List, Optional, Sequence

import torch

from fabric_lite.engine import GradientState
from fabric_lite.strategies.base import Strategy

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "HookHandle", "is_scheduler"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer: `step`/`zero_grad` are no-ops on accumulation micro-steps, and
    `step` goes through the strategy (loss-scale unscaling and inf/NaN skipping under fp16), then the
    strategy's step marker."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy, gradient_state: GradientState,
                 module: Optional[torch.nn.Module] = None):
        # No super().__init__: the wrapped optimizer owns the parameter groups and state.
        self.optimizer = optimizer
        #: The prepared model this optimizer trains, where known (its state is saved with it: FSDP2).
        self.module = module
        self._strategy = strategy
        self._gradient_state = gradient_state
        self._stepped: Any = True  # a bool, or a device tensor read only when someone asks
        # The step marker, looked up once: strategies without one cost no call per step.
        self._after_step = strategy.runtime.step_marker

    @property
    def state(self) -> DefaultDict[torch.Tensor, Any]:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: DefaultDict[torch.Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped because fp16 gradients overflowed."""
        return not bool(self._stepped)

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        self._stepped = not value

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        return self._strategy.checkpoint_format.optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._strategy.checkpoint_format.load_optimizer_state_dict(self.module, self.optimizer, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        if self._gradient_state.sync_gradients:
            if closure is None:
                self._stepped = self._strategy.optimizer_step(self.optimizer)
            else:
                self._stepped = self._strategy.optimizer_step(self.optimizer, closure=closure)
            if self._after_step is not None:
                self._after_step()

    def train(self) -> None:  # schedule-free optimizers switch their weights between modes
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> Dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Wraps an LR scheduler: it steps only after a real optimizer step, never after a skipped one.

    As in Accelerate, without `split_batches` it steps once per process on each optimizer step: a
    schedule written for the whole dataset in one process stays right when W processes each see
    1/W of the batches.
    """

    def __init__(
        self, scheduler: Any, optimizers: Sequence[AcceleratedOptimizer], gradient_state: GradientState,
        step_with_optimizer: bool = True, split_batches: bool = False, num_processes: int = 1,
    ):
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self._gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self._steps_per_call = 1 if split_batches else num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._gradient_state.sync_gradients:
            return
        for opt in self.optimizers:
            if opt.step_was_skipped:
                return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
        for _ in range(self._steps_per_call):
            if total is not None and self.scheduler.last_epoch >= total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> List[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def is_scheduler(obj: Any) -> bool:
    """Whether `prepare` wraps `obj` as an LR scheduler: a torch `LRScheduler` (ReduceLROnPlateau included).

    As in Accelerate, only objects of PyTorch's classes are prepared: a scheduler of another kind (an object
    with a `step()`) is given back untouched, and steps whenever it is called.
    """
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler)


_HANDLE_IDS = itertools.count(1)


class HookHandle:
    """What `register_*_hook` returns: `.remove()` takes the hook out again."""

    def __init__(self, hooks: Dict[int, Callable], hook: Callable) -> None:
        self.id = next(_HANDLE_IDS)
        self._hooks = hooks
        hooks[self.id] = hook

    def remove(self) -> None:
        self._hooks.pop(self.id, None)
