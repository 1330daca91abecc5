"""The Strategy contract: a small core every strategy implements, and the collaborators it may hold.

A strategy answers, for a whole run, where this process is, how a model is wrapped and how gradients
move; it owns *where* and *how*, never *when*. The doors never ask *which* strategy they hold. A new
strategy is one file with a subclass and one line in `strategies/registry.py`.

The core:

=====================================  ==================================================================
topology                               `device_mesh` (named dimensions; one "dp" dimension today), `world_size`,
                                       `global_rank`, `dp_size`, `dp_rank` (the data-parallel group the doors
                                       shard data over), `is_global_zero`, `distributed_sampler_kwargs`
`setup_environment()` / `teardown()`   start and release communication (abstract)
`setup(modules, optimizers)`           wrap for this strategy; `setup_module` (abstract), `setup_optimizer`
`unwrap_module`                        the user's module without the wrapper (abstract)
`backward` / `optimizer_step`          through the precision plugin (scaling, unscale, inf/NaN skip)
`no_backward_sync(module)`             one meaning: skip the gradient reduction (abstract);
                                       `force_backward_sync` undoes it for one backward
`clip_gradients_norm/value`            the right way for this strategy
collectives                            `barrier`, `all_reduce`, `all_gather(_object)`, `broadcast(_object)`:
                                       identities on one process, torch.distributed (`_primitive_*`) otherwise
=====================================  ==================================================================

Collaborators it holds, each with one meaning:

- `process_group` (`process_group.py`): backend, timeout, store, hang guard, side group; None where there is
  no torch.distributed group of its own (one device, a runtime that owns the world).
- `checkpoint_format` (`checkpoint_format.py`): "state_dict" | "dcp" | an engine's own files, with save, read,
  consolidate and what a save may do (partial gradients, background writes, rank-0 weight reads); it holds the
  state dict reads and writes (`module_state_dict`, `optimizer_state_dict`, their loads, `to_host`).
- `engine_step` (`engine_step.py`): for an engine that owns the step (DeepSpeed): joint set-up, run hints and
  the accumulation boundary; None elsewhere.

Capabilities, each with one reader: `initializes_on_meta`, `forward_is_collective`,
`syncs_gradients_per_forward`; `accelerate_type` names it for Accelerate's `DistributedType`.
- `runtime` (`runtime.py`, a class attribute `RuntimeSlot(...)`): how its processes meet its devices (process
  per device, runtime replicas, one SPMD process): the device feed, the step marker, the device type it forces,
  the start of a runtime that owns the world, and the Trainer's re-launcher.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.strategies.checkpoint_format import CheckpointFormat
from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.strategies.precision import Precision
from fabric_lite.strategies.runtime import Runtime, RuntimeSlot

if TYPE_CHECKING:
    from fabric_lite.strategies.engine_step import EngineStep
    from fabric_lite.strategies.process_group import ProcessGroup

__all__ = ["Strategy", "ReduceOp", "Mesh"]

ReduceOp = str  # "sum" | "mean" | "max" | "min"
_REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy(abc.ABC):
    """The contract every strategy implements (see the module docstring for the list)."""

    #: Registry names this class answers to (see ``strategies/registry.py``).
    aliases: ClassVar[Tuple[str, ...]] = ()
    #: Hugging Face Accelerate's `DistributedType` name for this strategy, where it has its own one.
    accelerate_type: ClassVar[Optional[str]] = None
    # Capabilities the front doors ask instead of isinstance checks; each means one thing.
    #: `setup_module` takes a model built on the meta device and gives each process its own shards only
    #: (`init_module` builds there by default).
    initializes_on_meta: ClassVar[bool] = False
    #: Every forward is a collective (ZeRO-3 gathers parameters): evaluation must give every process
    #: the same number of batches, padding included.
    forward_is_collective: bool = False
    #: Gradients are averaged by the model's wrapper during the one backward that follows each forward (DDP's
    #: reducer). A loop that runs several backwards per forward (a module stepping its own optimizers, as a GAN
    #: does) forwards through the unwrapped model and averages each optimizer's gradients as it steps instead.
    syncs_gradients_per_forward: ClassVar[bool] = False
    #: How its processes meet its devices (process per device, runtime replicas, one SPMD process): the device
    #: feed, the step marker, the device type it forces and the re-launcher (`strategies/runtime.py`).
    runtime = RuntimeSlot(Runtime)
    # Collaborators (see the module docstring); a strategy that has one sets it in its __init__.
    #: The torch.distributed group it trains over (strategies/process_group.py), or None.
    process_group: Optional["ProcessGroup"] = None
    #: For an engine that owns the step (strategies/engine_step.py): the doors hand it models and optimizers
    #: together, tell it the run's hints and its accumulation boundary. None for every other strategy.
    engine_step: Optional["EngineStep"] = None

    def __init__(self) -> None:
        self.process = ProcessInfo()
        self.root_device = torch.device("cpu")
        self.precision = Precision("32-true", "cpu")
        #: How checkpoints hold model and optimizer state (strategies/checkpoint_format.py).
        self.checkpoint_format = CheckpointFormat(self)

    # -- set-up (the connector binds process, root_device and precision: connector.configure_strategy) --
    def adapt_precision(self, precision: Precision) -> Precision:
        """The precision plugin this strategy trains with, given the one the user asked for."""
        return precision

    @abc.abstractmethod
    def setup_environment(self) -> None:
        """Start communication (a process group) and pin the device."""

    @abc.abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move the module to the device and wrap it for this strategy."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def setup(
        self, modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Tuple[List[nn.Module], List[torch.optim.Optimizer]]:
        """Wrap models together with their optimizers (the doors call it for an `engine_step`)."""
        return [self.setup_module(m) for m in modules], [self.setup_optimizer(o) for o in optimizers]

    @abc.abstractmethod
    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module without the strategy's wrapper."""

    @abc.abstractmethod
    def teardown(self) -> None:
        """Release what `setup_environment` took."""

    # -- where this process is ---------------------------------------------------------------------
    @property
    def device_mesh(self) -> "Mesh":
        """The device mesh this process sits in, by named dimension: one "dp" dimension over the world today.
        (Named apart from `mesh`, which an SPMD strategy uses for its runtime's own mesh object.)"""
        return Mesh(("dp",), (self.world_size,), (self.global_rank,))

    @property
    def dp_size(self) -> int:
        """The size of this process's data-parallel group (the doors shard data and gather metrics over it)."""
        return self.device_mesh.size("dp")

    @property
    def dp_rank(self) -> int:
        """This process's rank in its data-parallel group."""
        return self.device_mesh.rank("dp")

    @property
    def world_size(self) -> int:
        return self.process.world_size

    @property
    def global_rank(self) -> int:
        return self.process.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.process.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> Optional[Dict[str, int]]:
        """How the data is sharded: ``{"num_replicas": W, "rank": r}``, or None for no sharding."""
        if self.dp_size == 1:
            return None
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # -- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        self.precision.backward(loss, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Step through the precision plugin; the result is falsy when the step was skipped (inf/NaN
        gradients). It may be a device tensor, so that reading it is the caller's choice."""
        return self.precision.optimizer_step(optimizer, **kwargs)

    @abc.abstractmethod
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip the gradient all-reduce inside this context (accumulation micro-steps)."""

    def force_backward_sync(self, module: nn.Module) -> ContextManager:
        """Inside `no_backward_sync`, make the next backward synchronise after all."""
        return contextlib.nullcontext()

    def clip_gradients_norm(
        self, parameters: Iterable[torch.Tensor], optimizer: Optional[torch.optim.Optimizer],
        max_norm: float, norm_type: float = 2.0,
    ) -> torch.Tensor:
        if optimizer is not None:
            self.precision.unscale_gradients(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_gradients_value(
        self, parameters: Iterable[torch.Tensor], optimizer: Optional[torch.optim.Optimizer], clip_value: float
    ) -> None:
        if optimizer is not None:
            self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def explain_lines(self, modules: Sequence[nn.Module], optimizers: Sequence[Any], world: int) -> List[Tuple[str, str, str]]:
        """What `fabric-lite explain` adds about this strategy, as (section, label, text); section is
        "hardware" or "precision". `world` is the planned number of processes."""
        return []

    # -- collectives (identities on one process) ---------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if self.world_size > 1:
            self._primitive_barrier()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce a tensor across processes; returns a new tensor, the input is left alone."""
        op = op.lower()
        if op not in _REDUCE_OPS:
            raise ValueError(f"Unknown reduce op {op!r}; allowed: {', '.join(_REDUCE_OPS)}.")
        if self.world_size == 1:
            return tensor.clone()
        out = tensor.detach().clone()
        self._primitive_all_reduce(out, "sum" if op == "mean" else op)
        if op == "mean":
            out = out / self.world_size if out.is_floating_point() else out // self.world_size
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every process's tensor along dim 0 (0-dim tensors become length-1).

        Tensors whose first dimension differs between processes are padded for the exchange and
        trimmed after, so callers never have to line shapes up.
        """
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        sizes = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
        all_sizes = [int(s) for s in torch.cat(self._primitive_all_gather(sizes)).tolist()]
        longest = max(all_sizes)
        if longest != tensor.shape[0]:
            pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = self._primitive_all_gather(tensor)
        return torch.cat([p[:n] for p, n in zip(parts, all_sizes)])

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        out: List[Any] = [None] * self.world_size
        self._primitive_all_gather_object(out, obj)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        self._primitive_broadcast(tensor, src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj if self.global_rank == src else None]
        self._primitive_broadcast_object_list(box, src)
        return box[0]

    # -- backend primitives (torch.distributed by default) -----------------------------------------
    def _collective(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one torch.distributed collective, under the hang guard where the process group has one."""
        guard = self.process_group.hang_guard if self.process_group is not None else None
        return fn() if guard is None else guard.run(name, fn)

    def _primitive_barrier(self) -> None:
        import torch.distributed as dist

        self._collective("barrier", dist.barrier)

    def _primitive_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        self._collective(f"all_reduce({op})", lambda: dist.all_reduce(tensor, op=reduce_op))

    def _primitive_all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._collective("all_gather", lambda: dist.all_gather(parts, tensor))
        return parts

    def _primitive_all_gather_object(self, out: List[Any], obj: Any) -> None:
        import torch.distributed as dist

        self._collective("all_gather_object", lambda: dist.all_gather_object(out, obj))

    def _primitive_broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        self._collective(f"broadcast(src={src})", lambda: dist.broadcast(tensor, src))

    def _primitive_broadcast_object_list(self, box: List[Any], src: int) -> None:
        import torch.distributed as dist

        self._collective(f"broadcast_object(src={src})", lambda: dist.broadcast_object_list(box, src))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self.root_device}, precision={self.precision.name!r}, "
            f"rank={self.global_rank}/{self.world_size})"
        )


class Mesh:
    """Named dimensions of a device mesh: each one's size and this process's coordinate on it."""

    __slots__ = ("names", "sizes", "coords")

    def __init__(self, names: Tuple[str, ...], sizes: Tuple[int, ...], coords: Tuple[int, ...]) -> None:
        self.names, self.sizes, self.coords = tuple(names), tuple(sizes), tuple(coords)

    def size(self, name: str) -> int:
        return self.sizes[self._index(name)]

    def rank(self, name: str) -> int:
        return self.coords[self._index(name)]

    def _index(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"The mesh has no dimension {name!r}; it has {', '.join(map(repr, self.names))}.")
        return self.names.index(name)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes)) + ")"
