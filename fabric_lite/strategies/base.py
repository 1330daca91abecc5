"""The Strategy contract: what every strategy implements, and the machinery they share.

A strategy answers, for a whole run, where this process is, how a model is wrapped, how gradients
move and how training state is saved. The doors never ask *which* strategy they hold: they call the
members below and read the capabilities, each of which has exactly one meaning. A new strategy is
one file with a subclass (it implements the five abstract members, overrides what differs) and one
line in `strategies/registry.py`.

Must implement (abstract): `setup_environment`, `setup_module`, `unwrap_module`, `no_backward_sync`,
`teardown`.

May override (the defaults suit one device or plain data parallel):

=============================  =========================================================================
`adapt_precision`              the Precision to train with (an engine may take loss scaling over)
`setup`                        wrap models and optimizers in one call (when `setup_takes_optimizers`)
`setup_optimizer`              an optimizer prepared on its own
`set_run_hints`                what the door knows before `setup` (micro-batch size, accumulation, clip)
`distributed_sampler_kwargs`   how the data is sharded
`backward`, `optimizer_step`   through the precision plugin (scaling, unscale, inf/NaN skip)
`force_backward_sync`          inside `no_backward_sync`, sync after all
`clip_gradients_norm/value`    the right way for this strategy (sharded norms, engine-side clipping)
`module_state_dict`, `load_module_state_dict`, `optimizer_state_dict(module, optimizer)`, `to_host`,
`load_optimizer_state_dict`    full (unsharded) state; the optimizer's with its module (FSDP2, DCP)
`explain_lines`                what `fabric-lite explain` shows about the strategy (sharding, dtypes, bytes)
`save_engine_state`, `read_engine_state`, `consolidate_checkpoint`
                               checkpoints in the engine's own files (when `checkpoint_engine` is set)
`new_side_group`               a process group of its own for collectives off the training thread
`runtime`                      how its processes meet its devices: device feed, step marker, re-launcher
                               (`strategies/runtime.py`; a class attribute `RuntimeSlot(...)`)
`_primitive_*`                 the backend's collectives (torch.distributed by default)
=============================  =========================================================================
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.strategies.precision import Precision
from fabric_lite.strategies.runtime import Runtime, RuntimeSlot

__all__ = ["Strategy", "ReduceOp"]

ReduceOp = str  # "sum" | "mean" | "max" | "min"
_REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy(abc.ABC):
    """The contract every strategy implements (see the module docstring for the list)."""

    #: Registry names this class answers to (see ``strategies/registry.py``).
    aliases: ClassVar[Tuple[str, ...]] = ()
    # Capabilities the front doors ask instead of isinstance checks; each means one thing.
    #: `setup()` must receive the models together with their optimizers, in one call (an engine that
    #: owns both, or a sharding that must see both); `setup_module` alone is refused.
    setup_takes_optimizers: ClassVar[bool] = False
    #: The strategy counts the accumulation window itself: every backward that does not close a window
    #: must run inside `no_backward_sync` (DeepSpeed's gradient accumulation boundary).
    owns_accumulation_window: ClassVar[bool] = False
    #: The name of an engine that saves model and optimizer state in its own per-rank files (written by
    #: `save_engine_state`, read by `read_engine_state`), recorded in each checkpoint's manifest, or
    #: None: the doors save state dicts.
    checkpoint_engine: ClassVar[Optional[str]] = None
    #: Checkpoints hold model and optimizer state shard by shard (torch.distributed.checkpoint, written by
    #: every process, reloadable on any number of processes) instead of whole state dicts from rank 0.
    sharded_checkpoints: bool = False
    #: Inside an accumulation window the partial gradients are in `param.grad`, where a checkpoint can save them
    #: (an engine or a sharding that keeps them in its own buffers cannot resume mid-window exactly).
    saves_partial_gradients: ClassVar[bool] = True
    #: `setup_module` takes a model built on the meta device and gives each process its own shards only
    #: (`init_module` builds there by default).
    initializes_on_meta: ClassVar[bool] = False
    #: `load_module_state_dict` needs the full state on global rank 0 only (the others pass {}): big weights
    #: are read by one process and scattered.
    reads_weights_on_rank_zero: ClassVar[bool] = False
    #: Hugging Face Accelerate's `DistributedType` name for this strategy, where it has its own one.
    accelerate_type: ClassVar[Optional[str]] = None
    #: Every forward is a collective (ZeRO-3 gathers parameters): evaluation must give every process
    #: the same number of batches, padding included.
    forward_is_collective: bool = False
    #: Gradients are averaged by the model's wrapper during the one backward that follows each forward (DDP's
    #: reducer). A loop that runs several backwards per forward (a module stepping its own optimizers, as a GAN
    #: does) forwards through the unwrapped model and averages each optimizer's gradients as it steps instead.
    syncs_gradients_per_forward: ClassVar[bool] = False
    #: Its state copies to host memory without a step of its runtime, so a checkpoint can be written by a
    #: background thread from such a copy (`save_state(blocking=False)`); with several processes, the saves
    #: agree over `new_side_group()`.
    background_checkpoints: ClassVar[bool] = True
    #: How its processes meet its devices (process per device, runtime replicas, one SPMD process): the device
    #: feed, the step marker, the device type it forces and the re-launcher (`strategies/runtime.py`).
    runtime = RuntimeSlot(Runtime)

    def __init__(self) -> None:
        self.process = ProcessInfo()
        self.root_device = torch.device("cpu")
        self.precision = Precision("32-true", "cpu")
        self.hang_guard: Any = None  # a HangGuard once a process group exists (strategies/hang_guard.py)

    # -- set-up ------------------------------------------------------------------------------------
    def configure(self, process: ProcessInfo, root_device: torch.device, precision: Precision) -> None:
        """Bind the strategy to a process, a device and a precision (done once by the connector)."""
        self.process = process
        self.root_device = root_device
        self.precision = self.adapt_precision(precision)

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
        """Wrap models together with their optimizers (the doors call it when `setup_takes_optimizers`)."""
        return [self.setup_module(m) for m in modules], [self.setup_optimizer(o) for o in optimizers]

    @abc.abstractmethod
    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module without the strategy's wrapper."""

    def set_run_hints(self, micro_batch_size: Optional[int] = None, accumulation_steps: int = 1,
                      gradient_clip_val: Optional[float] = None) -> None:
        """What the front door knows about the run before `setup`, for engines configured with it (DeepSpeed)."""

    @abc.abstractmethod
    def teardown(self) -> None:
        """Release what `setup_environment` took."""

    # -- where this process is ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.process.world_size

    @property
    def global_rank(self) -> int:
        return self.process.global_rank

    @property
    def local_rank(self) -> int:
        return self.process.local_rank

    @property
    def node_rank(self) -> int:
        return self.process.node_rank

    @property
    def is_global_zero(self) -> bool:
        return self.process.global_rank == 0

    @property
    def is_local_zero(self) -> bool:
        return self.process.local_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> Optional[Dict[str, int]]:
        """How the data is sharded: ``{"num_replicas": W, "rank": r}``, or None for no sharding."""
        if self.world_size == 1:
            return None
        return {"num_replicas": self.world_size, "rank": self.global_rank}

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

    # -- state -------------------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """A full (unsharded) state dict of the user's module, valid on global rank 0."""
        return self.unwrap_module(module).state_dict()

    def to_host(self, obj: Any) -> Any:
        """`obj` as `Accelerator.save` writes it: tensors that only this strategy's device can read back (XLA's)
        copied to the host; others as they are (a CUDA tensor saves as one, as with torch.save)."""
        return obj

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, Any], strict: bool = True) -> None:
        self.unwrap_module(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's full state; `module` is the prepared model it trains (None when unknown)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer,
                                  state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_engine_state(self, writer: Any) -> None:
        """Every rank: write the engine's files through `writer` (only when `checkpoint_engine` is set)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint engine.")

    def read_engine_state(self, url: str, manifest: Dict[str, Any], strict: bool) -> Callable[[], None]:
        """Read and verify the engine's files; return what applies them (after every other check passed)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint engine.")

    @classmethod
    def consolidate_checkpoint(cls, url: str, manifest: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """The full weights of a checkpoint written by this engine, in one state dict, without a process
        group (`fabric-lite consolidate`). Only for strategies with a `checkpoint_engine`."""
        raise NotImplementedError(f"{cls.__name__} has no checkpoint engine.")

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

    def new_side_group(self) -> Any:
        """A process group of its own (gloo) for collectives off the training thread, which must never use the
        training group: background checkpoint saves agree over it. Every process calls it at the same point;
        None on one process."""
        if self.world_size == 1:
            return None
        import torch.distributed as dist

        timeout = getattr(self, "timeout", None)
        return dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {}))

    # -- backend primitives (torch.distributed by default) -----------------------------------------
    def _collective(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one torch.distributed collective, under the hang guard where the strategy set one up."""
        guard = self.hang_guard
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
