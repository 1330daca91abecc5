"""`fabric-lite explain --rehearse`: one real training step of the script at the launch's world size, in one process.

This process plays rank 0 of the whole planned world (e.g. 64 or 512 ranks) on torch's fake process group, which
completes every collective at once without moving data. Everything else is real: the strategy builds its device
mesh and groups for the full world, shards the model over it, the loader hands rank 0 its share, and one optimizer
step runs forward, backward and the update on rank 0's shards. So the mesh is validated by the code that will run it
(a size that does not divide the world, a tensor-parallel dimension that does not divide a weight), and what one rank
holds and sends is measured rather than estimated:

* bytes rank 0 holds after the step: parameters, gradients and optimizer state (the local shards of DTensors);
* the collectives one step issues on rank 0, by kind and process group (a mesh dimension), with their buffer bytes.

The numbers of the data are meaningless (collectives on the fake group return what their buffers held). What runs
between `prepare(...)` with a dataloader (the Trainer: the start of training, after its sanity check) and the end of
the first optimizer step is what is counted; the report is printed and the script stops with status 0.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from fabric_lite.strategies.fsdp_blocks import local_bytes

__all__ = ["Rehearsal", "CollectiveCount", "start_fake_world", "end_fake_world", "active", "rehearse",
           "local_bytes", "module_bytes", "optimizer_state_bytes"]

# The collective each c10d operation stands for (the in-place ProcessGroup ops and the functional ones DTensor uses).
_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter", "barrier": "barrier",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}


def start_fake_world(world_size: int) -> None:
    """Start torch's fake process group with this process as rank 0 of `world_size`."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("the rehearsal starts its own process group, but one is already started in this process.")
    try:  # (torch registers its "fake" backend in its testing package; the backend itself is built into torch)
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"this torch build has no fake process-group backend ({err}); the rehearsal needs "
                           f"torch >= 2.4 with torch.distributed.") from err
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)


def end_fake_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- bytes -----------------------------------------------------------------------------------------------------------

def _unique(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    seen: Dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def module_bytes(models: Sequence[torch.nn.Module]) -> Tuple[int, int]:
    """(parameter bytes, gradient bytes) this process holds for `models` (each tensor once)."""
    params = _unique(p for m in models for p in m.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return sum(local_bytes(p) for p in params), sum(local_bytes(g) for g in grads)


def optimizer_state_bytes(optimizers: Sequence[Any]) -> int:
    """Bytes of every tensor in the optimizers' state (moments, step counts) this process holds."""
    tensors: List[torch.Tensor] = []
    for opt in optimizers:
        for state in opt.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return sum(local_bytes(t) for t in _unique(tensors))


# -- collectives -----------------------------------------------------------------------------------------------------

@dataclass
class CollectiveCount:
    kind: str        # all_gather, reduce_scatter, all_reduce, ...
    group: str       # the mesh dimension (or "world") it ran over
    ranks: int       # processes in that group
    calls: int = 0
    bytes: int = 0   # the buffers' bytes, summed over calls (all_gather: the gathered output; reduce_scatter: input)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _collective_log_mode() -> Any:
    """A TorchDispatchMode class recording every collective issued while it is active (built on first use: it
    imports torch's dispatch machinery, which the rest of the package never needs)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveLog(TorchDispatchMode):
        def __init__(self, groups: Dict[str, Tuple[str, int]]) -> None:
            super().__init__()
            self.groups = groups
            self.recording = True
            self.counts: "OrderedDict[Tuple[str, str], CollectiveCount]" = OrderedDict()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # A mode sees an operation before a tensor subclass does; a DTensor operation's own collectives (a norm
            # reduced over the mesh, a redistribute) are issued inside it. Declining lets DTensor run it and turn
            # it into plain operations and collectives, which come back here.
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if self.recording and func.namespace in ("c10d", "_c10d_functional"):
                kind = _KINDS.get(func.overloadpacket.__name__)
                if kind is not None:
                    self.record(kind, args)
            return func(*args, **(kwargs or {}))

        def record(self, kind: str, args: Sequence[Any]) -> None:
            import torch.distributed as dist

            group, ranks = "world", dist.get_world_size()
            for a in args:
                if isinstance(a, torch.ScriptObject):
                    try:
                        pg = dist.ProcessGroup.unbox(a)
                    except RuntimeError:  # (a ReduceOp)
                        continue
                    group, ranks = self.groups.get(pg.group_name, (f"a group of {pg.size()}", pg.size()))
                elif isinstance(a, str) and a in self.groups:  # (a functional collective names its group)
                    group, ranks = self.groups[a]
            count = self.counts.setdefault((kind, group), CollectiveCount(kind, group, ranks))
            count.calls += 1
            count.bytes += max((_tensor_bytes(a) for a in args), default=0)

    return CollectiveLog


def mesh_groups(strategy: Any) -> Dict[str, Tuple[str, int]]:
    """{process group name: (what it is, its size)}: the world and each dimension of the strategy's torch mesh."""
    import torch.distributed as dist

    world = dist.group.WORLD
    assert world is not None  # (the rehearsal started the group)
    groups: Dict[str, Tuple[str, int]] = {world.group_name: ("world", dist.get_world_size())}
    mesh = strategy.device_mesh
    torch_mesh = mesh.torch if mesh is not None else None
    if torch_mesh is not None:
        names = list(torch_mesh.mesh_dim_names or ())
        flattened = [n for n in ("dp",) if n not in names]
        for name in names + flattened:
            try:
                sub = torch_mesh[name]
            except (KeyError, RuntimeError, ValueError):
                continue
            if sub.size() > 1:
                groups.setdefault(sub.get_group().group_name, (name, sub.size()))
    return groups


def _complete_ddp_futures(model: torch.nn.Module) -> None:
    """DDP reads the result of each bucket's all-reduce from the collective's future, which the fake group leaves
    empty (backward fails inside DDP's reducer). A communication hook that all-reduces the bucket and returns it
    as the result issues the same collective (DDP's default) and completes the future."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return

    def all_reduce_bucket(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=state)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    # (DDP checks the annotations themselves, which this module's postponed annotations leave as strings)
    all_reduce_bucket.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                         "return": torch.futures.Future[torch.Tensor]}
    try:
        model.register_comm_hook(model.process_group, all_reduce_bucket)
    except RuntimeError as err:  # (DDP takes one hook: the script's own, a compression hook, is there already)
        raise RuntimeError(
            "fabric-lite explain --rehearse: the model has a DDP communication hook of its own (comm_hook=...), whose "
            "collectives' results the fake process group does not produce; rehearse without it (the bytes and "
            "collectives are DDP's plain all-reduce then).") from err


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# -- the rehearsal ---------------------------------------------------------------------------------------------------

@dataclass
class Rehearsal:
    door: Any                  # the Accelerator or the Trainer
    world_size: int
    log: Any = None
    hook: Any = None
    started: float = field(default_factory=time.perf_counter)
    report: Optional[Dict[str, Any]] = None
    skipped: Optional[str] = None  # what of the script the rehearsal leaves out, said in the report
    device: Any = None

    def begin(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        accelerator = getattr(self.door, "accelerator", self.door)
        if getattr(self.door, "num_sanity_val_steps", 0):  # (the Trainer: the step is the first thing fit runs)
            self.skipped = f"the Trainer's sanity check ({self.door.num_sanity_val_steps} validation batch(es))"
            self.door.num_sanity_val_steps = 0
        self.log = _collective_log_mode()(mesh_groups(accelerator.strategy))
        self.log.__enter__()
        self.hook = register_optimizer_step_post_hook(self._after_step)
        for model in self._models_and_optimizers()[0]:
            _complete_ddp_futures(model)
        self.device = accelerator.device
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.started = time.perf_counter()

    def close(self) -> None:
        """Stop recording (idempotent)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.log is not None:
            log, self.log = self.log, None
            log.__exit__(None, None, None)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.log is None or not self.log.recording:
            return
        counts = list(self.log.counts.values())
        seconds = time.perf_counter() - self.started
        self.hook.remove()
        self.hook = None
        self.log.counts = OrderedDict()
        self.log.recording = False  # (it leaves the mode stack in `finish`, after any mode the script entered)
        self.report = self.measure(counts, seconds)
        print(self.format(), flush=True)  # (this process is rank 0)
        raise SystemExit(0)

    def _models_and_optimizers(self) -> Tuple[List[torch.nn.Module], List[Any]]:
        door = self.door
        if hasattr(door, "models"):  # the Accelerator
            return list(door.models), [getattr(o, "optimizer", o) for o in door.optimizers]
        return [door.model], [getattr(o, "optimizer", o) for o in door.optimizers]

    def measure(self, counts: List[CollectiveCount], seconds: float) -> Dict[str, Any]:
        models, optimizers = self._models_and_optimizers()
        params, grads = module_bytes(models)
        state = optimizer_state_bytes(optimizers)
        accelerator = getattr(self.door, "accelerator", self.door)
        strategy = accelerator.strategy
        mesh = strategy.device_mesh
        layout = dict(zip(mesh.names, mesh.sizes)) if mesh is not None else {"world": self.world_size}
        shape = accelerator.run_config.mesh_shape
        return {
            "world_size": self.world_size, "strategy": strategy.traits.names[0], "mesh": str(shape) if shape else None,
            "layout": layout, "parameter_bytes": params, "gradient_bytes": grads, "optimizer_state_bytes": state,
            "total_bytes": params + grads + state, "seconds": seconds,
            # on a GPU, what the allocator held at most during the step: the shards, the all-gathered weights of
            # the largest group, activations and temporaries (the fake group's buffers are real allocations)
            "peak_device_bytes": (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                                  else None),
            "collectives": [vars(c) for c in counts],
        }

    def format(self) -> str:
        r = self.report
        assert r is not None
        lines = [f"Rehearsal: one training step as rank 0 of {r['world_size']} on torch's fake process group "
                 f"(one process; collectives move no data)",
                 f"  strategy          {r['strategy']}; mesh "
                 + " x ".join(f"{name}={size}" for name, size in r["layout"].items())
                 + (f" ({r['mesh']})" if r["mesh"] else ""),
                 "  bytes rank 0 holds after the step:"]
        for label, key in (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"),
                           ("optimizer state", "optimizer_state_bytes"), ("total", "total_bytes")):
            lines.append(f"    {label:<17} {r[key]:>16,} B  ({_size(r[key])})")
        if r["peak_device_bytes"] is not None:
            lines.append(f"    {'peak on ' + str(self.device):<17} {r['peak_device_bytes']:>16,} B  "
                         f"({_size(r['peak_device_bytes'])}; with activations and gathered weights)")
        if r["collectives"]:
            lines.append("  collectives of the step on rank 0 (calls, their buffers' bytes in all, group):")
            for c in r["collectives"]:
                group = c["group"] + ("" if c["group"].startswith("a group") else f" ({c['ranks']} ranks)")
                lines.append(f"    {c['kind']:<15} {c['calls']:>5} call(s) {c['bytes']:>16,} B  ({_size(c['bytes'])}) "
                             f"over {group}")
        else:
            lines.append("  collectives of the step on rank 0: none")
        lines.append(f"  the step took {r['seconds']:.2f} s here (fake collectives: not a prediction of the real step)")
        if self.skipped:
            lines.append(f"  not run: {self.skipped}")
        return "\n".join(lines)


_ACTIVE: List[Rehearsal] = []


def active() -> Optional[Rehearsal]:
    return _ACTIVE[-1] if _ACTIVE else None


def rehearse(door: Any, world_size: int) -> Rehearsal:
    """Begin recording for `door` (once per process: a later prepare(...) finds the rehearsal running)."""
    current = active()
    if current is not None:
        return current
    rehearsal = Rehearsal(door, world_size)
    _ACTIVE.append(rehearsal)
    rehearsal.begin()
    return rehearsal


def finish() -> Optional[Rehearsal]:
    """End the rehearsal of this process (the script ended or failed): stop recording, forget it, return it."""
    rehearsal = _ACTIVE.pop() if _ACTIVE else None
    if rehearsal is not None:
        rehearsal.close()
    return rehearsal


def no_step_message(script: str) -> str:
    return (f"fabric-lite explain --rehearse: {script} ended without an optimizer step after prepare(...) with a "
            f"dataloader (or the start of Trainer.fit): there was no step to rehearse.")


def print_error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
