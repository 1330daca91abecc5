"""Data parallel training with torch's DistributedDataParallel (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import weakref
import contextlib
import os
import sys
from typing import Any, ClassVar, ContextManager, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.strategies.parallel import ParallelStrategy
from fabric_lite.strategies.comm_hooks import CommHook

__all__ = ["DDPStrategy"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# DDP wrappers made by any DDPStrategy in this process. Only used at interpreter exit: a wrapper
# still referenced by the script's globals keeps its reducer, and through it the gloo process group,
# alive into interpreter finalization, where tearing the group down can abort the process.
_WRAPPERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
#: How many process groups this process has started: a script that ends one (`end_training`) and starts another
#: names the new one's keys apart from the old one's, which stay in the launcher's store (every process starts
#: its groups in the same order, so the numbers agree).
_GROUPS_STARTED = itertools.count()
#: Seconds a rank whose interpreter exits waits for the others to reach their end before leaving alone.
ENV_EXIT_GRACE = "FABRIC_LITE_EXIT_GRACE_S"


def _gpu_uuid(device: torch.device) -> Optional[str]:
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid else None


def refuse_shared_gpus(store: Any, rank: int, world_size: int, gpu: Optional[str], where: str) -> None:
    """Raise in every process whose GPU another process of the job picked too (NCCL needs one each).

    Each process counts itself under its GPU's UUID in the job's store (GPUs are told apart by UUID,
    so one GPU per process through CUDA_VISIBLE_DEVICES is fine); once all have counted, a count
    above one is an error in each process that shares. Three store operations per process.
    """
    if gpu is None:
        return
    key = f"gpu_users/{gpu}"
    store.add(key, 1)
    if store.add("gpu_users_counted", 1) == world_size:
        store.set("gpu_users_done", "1")
    store.wait(["gpu_users_done"])
    users = store.add(key, 0)
    if users > 1:
        raise RuntimeError(
            f"Rank {rank} and {users - 1} other process(es) of this job picked the same GPU ({where}, {gpu}): "
            f"NCCL needs a GPU of its own for each process. Start at most as many processes on a machine as it "
            f"has GPUs (--nproc-per-node), check CUDA_VISIBLE_DEVICES, or train on the CPU with "
            f"accelerator='cpu' (gloo)."
        )


class DDPStrategy(ParallelStrategy):
    """One process per device; gradients are averaged with an all-reduce during backward.

    ``DDPStrategy(find_unused_parameters=True, timeout=timedelta(minutes=5))``; any keyword of
    ``torch.nn.parallel.DistributedDataParallel`` may be given. `comm_hook` replaces DDP's plain gradient
    all-reduce with one of torch's communication hooks ("fp16", "bf16", "power_sgd", "batched_power_sgd"),
    `comm_wrapper` ("fp16"/"bf16") casts what PowerSGD compresses, `comm_state_option` are PowerSGDState keywords:
    ``DDPStrategy(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 2})``.
    """

    aliases: ClassVar[Tuple[str, ...]] = ("ddp",)
    syncs_gradients_per_forward: ClassVar[bool] = True

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
        self.process_group_backend = process_group_backend
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.ddp_kwargs = ddp_kwargs
        #: The communication hook registered on every model this strategy wraps in DDP (`CommHook("no")`: none).
        self.comm_hook = CommHook(comm_hook, comm_wrapper, comm_state_option or {})
        self._comm_states: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
        self._owns_process_group = False

    @property
    def backend(self) -> str:
        if self.process_group_backend:
            return self.process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def setup_environment(self) -> None:
        import torch.distributed as dist

        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if not dist.is_available():
            raise RuntimeError("strategy='ddp' needs torch.distributed, which this torch build lacks.")
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(
                    f"A process group of size {dist.get_world_size()} already exists, but the launch "
                    f"environment says WORLD_SIZE={self.world_size}."
                )
            try:  # the group's own store, for the hang guard's notes
                from torch.distributed.distributed_c10d import _get_default_store

                self._guard(_get_default_store())
            except Exception:
                pass
            return
        p = self.process
        if p.master_port is None:
            raise RuntimeError(
                f"strategy='ddp' with WORLD_SIZE={p.world_size} needs MASTER_ADDR and MASTER_PORT. Launch "
                f"with `fabric-lite launch` or `torchrun`, which set them."
            )
        # Workers of an elastic agent share its TCPStore, which outlives a restart; keys written by a
        # dead attempt (or by this process's previous group) would be read by the new one. A prefix per
        # restart and per group keeps them apart.
        base_store = dist.TCPStore(
            p.master_addr, p.master_port, p.world_size,
            is_master=(p.global_rank == 0 and not p.uses_agent_store),
            timeout=self.timeout, multi_tenant=True,
        )
        store = dist.PrefixStore(f"fabric_lite/attempt_{p.restart_count}/group_{next(_GROUPS_STARTED)}", base_store)
        kwargs: dict = {}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
            if self.backend == "nccl":
                refuse_shared_gpus(store, p.global_rank, p.world_size, _gpu_uuid(self.root_device),
                                   f"{self.root_device} of {torch.cuda.device_count()} visible")
        dist.init_process_group(
            self.backend, store=store, rank=p.global_rank, world_size=p.world_size, timeout=self.timeout, **kwargs
        )
        self._owns_process_group = True
        self._guard(store)
        # Scripts that never call end_training() must still leave cleanly: gloo aborts the process
        # ("terminate called without an active exception") if its group is alive at interpreter exit.
        atexit.register(self._teardown_at_exit)

    def _guard(self, store: Any) -> None:
        from fabric_lite.strategies.hang_guard import HangGuard

        self.hang_guard = HangGuard(store, self.global_rank, self.world_size, self.timeout.total_seconds())

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        module = self.precision.convert_module(module).to(self.root_device)
        if self.world_size == 1 or not any(p.requires_grad for p in module.parameters()):
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        _WRAPPERS.add(wrapped)
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
            return module.no_sync()
        return contextlib.nullcontext()

    def _teardown_at_exit(self) -> None:
        import torch.distributed as dist

        died = getattr(sys, "last_value", None) is not None  # the script died of an exception: don't wait
        if not died and self._owns_process_group and dist.is_initialized() and not self._others_still_running():
            try:  # leave together: a rank that tears down alone makes its peers' gloo threads abort
                dist.barrier()
            except Exception:  # a peer is already gone; nothing left to wait for
                pass
        self.teardown()
        for wrapper in list(_WRAPPERS):  # release the group now, not during interpreter finalization
            wrapper.__dict__.pop("reducer", None)
            wrapper.__dict__.pop("logger", None)
            wrapper.__dict__["process_group"] = None
        gc.collect()

    def _others_still_running(self) -> bool:
        """At interpreter exit: whether other ranks are still running after a short wait (then this one
        leaves without them: a barrier now would keep them waiting in their next collective, and this
        one in the barrier, until the process group's timeout; leaving makes them fail at once)."""
        guard = self.hang_guard
        if guard is None or self.world_size == 1:
            return False
        guard.note_exit()
        grace = float(os.environ.get(ENV_EXIT_GRACE, "5"))
        late = guard.wait_for_exits(grace)
        if late:
            print(f"fabric_lite: rank {self.global_rank} is exiting, but rank(s) {', '.join(map(str, late))} did not "
                  f"reach their end within {grace:g} s (set {ENV_EXIT_GRACE} to wait longer). This rank leaves now: "
                  f"a rank waiting for it in a collective fails at once instead of after the process group's "
                  f"timeout ({self.timeout.total_seconds():g} s). Call accelerator.end_training() on every rank "
                  f"to end together.", file=sys.stderr, flush=True)
        return bool(late)

    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        try:
            super().backward(loss, module, **kwargs)
        except RuntimeError as err:  # a peer that left shows here first, in DDP's gradient all-reduce
            guard = self.hang_guard
            why = guard.explain_lost_peer("the gradient all-reduce in backward()", err) if guard else None
            if why is None:
                raise
            from fabric_lite.strategies.hang_guard import CollectiveError

            raise CollectiveError(why) from err

    @contextlib.contextmanager
    def force_backward_sync(self, module: nn.Module):  # type: ignore[override]
        if not hasattr(module, "require_backward_grad_sync"):
            yield
            return
        saved = module.require_backward_grad_sync, module.require_forward_param_sync
        module.require_backward_grad_sync = module.require_forward_param_sync = True
        module.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            module.require_backward_grad_sync, module.require_forward_param_sync = saved

    def teardown(self) -> None:
        import torch.distributed as dist

        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
