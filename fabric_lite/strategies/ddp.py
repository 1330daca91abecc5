"""Data parallel training with torch's DistributedDataParallel (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import Any, ContextManager, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.strategies.base import Traits
from fabric_lite.strategies.comm_hooks import CommHook
from fabric_lite.strategies.parallel import ParallelStrategy
from fabric_lite.strategies.process_group import (  # noqa: F401  (DEFAULT_TIMEOUT, refuse_shared_gpus: their old home)
    DEFAULT_TIMEOUT, ENV_EXIT_GRACE, ProcessGroup, ProcessGroupSetting, refuse_shared_gpus, release_at_exit,
)

__all__ = ["DDPStrategy"]


class DDPStrategy(ParallelStrategy):
    """One process per device; gradients are averaged with an all-reduce during backward.

    ``DDPStrategy(find_unused_parameters=True, timeout=timedelta(minutes=5))``; any keyword of
    ``torch.nn.parallel.DistributedDataParallel`` may be given. `comm_hook` replaces DDP's plain gradient
    all-reduce with one of torch's communication hooks ("fp16", "bf16", "power_sgd", "batched_power_sgd"),
    `comm_wrapper` ("fp16"/"bf16") casts what PowerSGD compresses, `comm_state_option` are PowerSGDState keywords:
    ``DDPStrategy(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 2})``.
    """

    traits = Traits(names=("ddp",), syncs_gradients_per_forward=True)
    process_group: ProcessGroup

    def __init__(
        self,
        process_group_backend: Optional[str] = None,
        timeout: Optional[datetime.timedelta] = None,
        comm_hook: Any = "no",
        comm_wrapper: Any = "no",
        comm_state_option: Optional[Mapping[str, Any]] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.process_group = ProcessGroup(self, process_group_backend, timeout)
        self.ddp_kwargs = ddp_kwargs
        #: The communication hook registered on every model this strategy wraps in DDP (`CommHook("no")`: none).
        self.comm_hook = CommHook(comm_hook, comm_wrapper, comm_state_option or {})
        self._comm_states: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()

    #: The process group's settings, as strategy attributes (the constructor's names).
    process_group_backend = ProcessGroupSetting("requested_backend")
    timeout = ProcessGroupSetting("timeout")
    backend = ProcessGroupSetting("backend", writable=False)

    def setup_environment(self) -> None:
        self.process_group.start()

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        module = self.precision.convert_module(module).to(self.root_device)
        if self.world_size == 1 or not any(p.requires_grad for p in module.parameters()):
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        release_at_exit(wrapped)
        if self.comm_hook.enabled:
            self._comm_states[wrapped] = self.comm_hook.register(wrapped)
        return wrapped

    def comm_hook_state(self, module: nn.Module) -> Any:
        """The state of the communication hook on a model this strategy wrapped (a PowerSGDState, with its
        iteration count and error-feedback memory), or None (no hook, a stateless one, or an unwrapped model)."""
        return self._comm_states.get(module)

    def explain_lines(self, modules: Sequence[nn.Module], optimizers: Sequence[Any], world: int) -> List[Tuple[str, str, str]]:
        if not self.comm_hook.enabled:
            return []
        where = "" if world > 1 else " (unused on one process: nothing is all-reduced)"
        return [("precision", "gradient all-reduce", self.comm_hook.describe() + where)]

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if enabled and hasattr(module, "no_sync"):
            no_sync: Any = module.no_sync  # DistributedDataParallel's, not declared on nn.Module
            return no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        # a peer that left shows here first, in DDP's gradient all-reduce
        self.process_group.run_guarded("the gradient all-reduce in backward()",
                                       lambda: ParallelStrategy.backward(self, loss, module, **kwargs))

    @contextlib.contextmanager
    def force_backward_sync(self, module: nn.Module):  # type: ignore[override]
        if not hasattr(module, "require_backward_grad_sync"):
            yield
            return
        ddp: Any = module  # DistributedDataParallel: its sync flags are not declared on nn.Module
        saved = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = saved

    def teardown(self) -> None:
        self.process_group.destroy()
