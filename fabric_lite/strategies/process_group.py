"""The process group a strategy trains over: a component that DDP, FSDP and DeepSpeed hold (not a base class).

It owns the torch.distributed set-up (backend, timeout, the job's store with a prefix per restart and per
group), the hang guard that names a missing rank, a side group for collectives off the training thread,
leaving together at interpreter exit, and the destruction of the group it started. Strategies that train in
one process with no group (single device) hold none: `strategy.process_group` is None.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import sys
import weakref
from typing import Any, Callable, Dict, Optional, TypeVar

import torch
from torch import nn

__all__ = ["ProcessGroup", "ProcessGroupSetting", "DEFAULT_TIMEOUT", "ENV_EXIT_GRACE", "refuse_shared_gpus",
           "release_at_exit"]

T = TypeVar("T")
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
#: Seconds a rank whose interpreter exits waits for the others to reach their end before leaving alone.
ENV_EXIT_GRACE = "FABRIC_LITE_EXIT_GRACE_S"

# Model wrappers (DDP's) that hold a process group of this process. Only used at interpreter exit: a wrapper
# still referenced by the script's globals keeps its reducer, and through it the gloo process group, alive
# into interpreter finalization, where tearing the group down can abort the process.
_HOLDERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
#: How many process groups this process has started: a script that ends one (`end_training`) and starts another
#: names the new one's keys apart from the old one's, which stay in the launcher's store (every process starts
#: its groups in the same order, so the numbers agree).
_GROUPS_STARTED = itertools.count()


def release_at_exit(wrapper: nn.Module) -> None:
    """Let go of `wrapper`'s reference to the process group when the interpreter exits (see `_HOLDERS`)."""
    _HOLDERS.add(wrapper)


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


class ProcessGroup:
    """torch.distributed for one strategy: `start()`, `destroy()`, `new_side_group()`, the hang guard.

    `backend`: "nccl"/"gloo"/... or None (nccl on CUDA, else gloo). `lone_group`: on one process, start a
    one-member group over an in-memory store (FSDP's mesh and DeepSpeed's engine need one) instead of asking
    for a launcher's address. `name` is the strategy's name in error messages.
    """

    def __init__(self, strategy: Any, backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None,
                 lone_group: bool = False, name: str = "ddp") -> None:
        self.strategy = strategy
        self.requested_backend = backend
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.lone_group = lone_group
        self.name = name
        self.hang_guard: Any = None  # a HangGuard once the group exists (strategies/hang_guard.py)
        self.owned = False  # this component started the group (and so destroys it)
        self._dimension_groups: Dict[Any, Any] = {}  # (mesh names, sizes, dimension) -> this process's group

    @property
    def backend(self) -> str:
        if self.requested_backend:
            return self.requested_backend
        return "nccl" if self.strategy.root_device.type == "cuda" else "gloo"

    def start(self) -> None:
        """Pin the device and start (or join) the default process group of this job."""
        import torch.distributed as dist

        device, p = self.strategy.root_device, self.strategy.process
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_available():
            raise RuntimeError(f"strategy={self.name!r} needs torch.distributed, which this torch build lacks.")
        if self.lone_group and p.world_size == 1 and not dist.is_initialized():
            # A lone process: a one-member group over an in-memory store, no port needed.
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
            self.owned = True
            return
        if dist.is_initialized():
            if dist.get_world_size() != p.world_size:
                raise RuntimeError(
                    f"A process group of size {dist.get_world_size()} already exists, but the launch "
                    f"environment says WORLD_SIZE={p.world_size}."
                )
            try:  # the group's own store, for the hang guard's notes
                from torch.distributed.distributed_c10d import _get_default_store

                self._guard(_get_default_store())
            except Exception:
                pass
            return
        if p.master_port is None:
            raise RuntimeError(
                f"strategy={self.name!r} with WORLD_SIZE={p.world_size} needs MASTER_ADDR and MASTER_PORT. Launch "
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
        if device.type == "cuda":
            kwargs["device_id"] = device
            if self.backend == "nccl":
                refuse_shared_gpus(store, p.global_rank, p.world_size, _gpu_uuid(device),
                                   f"{device} of {torch.cuda.device_count()} visible")
        dist.init_process_group(
            self.backend, store=store, rank=p.global_rank, world_size=p.world_size, timeout=self.timeout, **kwargs
        )
        self.owned = True
        self._guard(store)
        # Scripts that never call end_training() must still leave cleanly: gloo aborts the process
        # ("terminate called without an active exception") if its group is alive at interpreter exit.
        atexit.register(self._teardown_at_exit)

    def _guard(self, store: Any) -> None:
        from fabric_lite.strategies.hang_guard import HangGuard

        p = self.strategy.process
        self.hang_guard = HangGuard(store, p.global_rank, p.world_size, self.timeout.total_seconds())

    def run_guarded(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`; a RuntimeError it raises because a peer left or died becomes a CollectiveError saying so
        (for collectives the hang guard does not run itself, like DDP's gradient all-reduce in backward)."""
        try:
            return fn()
        except RuntimeError as err:
            guard = self.hang_guard
            why = guard.explain_lost_peer(what, err) if guard else None
            if why is None:
                raise
            from fabric_lite.strategies.hang_guard import CollectiveError

            raise CollectiveError(why) from err

    def new_side_group(self) -> Any:
        """A process group of its own (gloo) for collectives off the training thread, which must never use the
        training group: background checkpoint saves agree over it. Every process calls it at the same point;
        None on one process."""
        if self.strategy.process.world_size == 1:
            return None
        import torch.distributed as dist

        return dist.new_group(backend="gloo", timeout=self.timeout)

    def dimension_group(self, mesh: Any, dimension: str) -> Any:
        """The torch.distributed group of this process along one dimension of `mesh` (a `base.Mesh`): the processes
        that share every other coordinate. Every process builds every group of the dimension, in the same order, as
        torch requires; built once per dimension."""
        import torch.distributed as dist

        key = (mesh.names, mesh.sizes, dimension)
        if key not in self._dimension_groups:
            rank, mine = self.strategy.process.global_rank, None
            for ranks in mesh.groups(dimension):
                group = dist.new_group(ranks, timeout=self.timeout)
                if rank in ranks:
                    mine = group
            self._dimension_groups[key] = mine
        return self._dimension_groups[key]

    def destroy(self) -> None:
        """Destroy the group, if this component started it."""
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned = False
        self._dimension_groups.clear()

    def _teardown_at_exit(self) -> None:
        import torch.distributed as dist

        died = getattr(sys, "last_value", None) is not None  # the script died of an exception: don't wait
        if not died and self.owned and dist.is_initialized() and not self._others_still_running():
            try:  # leave together: a rank that tears down alone makes its peers' gloo threads abort
                dist.barrier()
            except Exception:  # a peer is already gone; nothing left to wait for
                pass
        self.strategy.teardown()
        for wrapper in list(_HOLDERS):  # release the group now, not during interpreter finalization
            wrapper.__dict__.pop("reducer", None)
            wrapper.__dict__.pop("logger", None)
            wrapper.__dict__["process_group"] = None
        gc.collect()

    def _others_still_running(self) -> bool:
        """At interpreter exit: whether other ranks are still running after a short wait (then this one
        leaves without them: a barrier now would keep them waiting in their next collective, and this
        one in the barrier, until the process group's timeout; leaving makes them fail at once)."""
        guard, p = self.hang_guard, self.strategy.process
        if guard is None or p.world_size == 1:
            return False
        guard.note_exit()
        grace = float(os.environ.get(ENV_EXIT_GRACE, "5"))
        late = guard.wait_for_exits(grace)
        if late:
            print(f"fabric_lite: rank {p.global_rank} is exiting, but rank(s) {', '.join(map(str, late))} did not "
                  f"reach their end within {grace:g} s (set {ENV_EXIT_GRACE} to wait longer). This rank leaves now: "
                  f"a rank waiting for it in a collective fails at once instead of after the process group's "
                  f"timeout ({self.timeout.total_seconds():g} s). Call accelerator.end_training() on every rank "
                  f"to end together.", file=sys.stderr, flush=True)
        return bool(late)


class ProcessGroupSetting:
    """A strategy attribute that stands for a setting of its process group (``strategy.timeout``)."""

    def __init__(self, setting: str, writable: bool = True) -> None:
        self.setting, self.writable = setting, writable

    def __get__(self, strategy: Any, owner: type) -> Any:
        if strategy is None:
            return self
        return getattr(strategy.process_group, self.setting)

    def __set__(self, strategy: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"{self.setting} is derived; set process_group_backend instead.")
        setattr(strategy.process_group, self.setting, value)
