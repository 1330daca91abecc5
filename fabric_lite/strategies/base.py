"""The Strategy contract: where a process runs, how a model is wrapped, how gradients move.

A strategy is configured once (process info, device, precision) and then answers for the whole run.
Front doors never ask *which* strategy they hold; they read the capability flags below.
Collectives are written once here over a handful of torch.distributed primitives; a backend with
other primitives (XLA) overrides the `_primitive_*` methods only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.environments import ProcessInfo
from fabric_lite.precision import Precision

__all__ = ["Strategy", "ReduceOp"]

ReduceOp = str  # "sum" | "mean" | "max" | "min"
_REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy:
    """Base class: a lone process on one device. Subclasses add wrapping and communication."""

    #: Registry names this class answers to (see ``strategies/__init__.py``).
    aliases: ClassVar[Tuple[str, ...]] = ()
    # Capabilities the front doors ask instead of isinstance checks.
    #: The model and optimizer must be wrapped together in one call (an engine that owns both).
    requires_joint_setup: ClassVar[bool] = False
    #: The strategy counts micro-steps itself; the doors must not skip optimizer steps.
    handles_gradient_accumulation: ClassVar[bool] = False
    #: `no_backward_sync` really skips a gradient all-reduce (so accumulation saves communication).
    supports_no_sync: ClassVar[bool] = False
    #: The name of an engine that saves model and optimizer state in its own per-rank files (written by
    #: `save_engine_state`, read by `read_engine_state`), or None: the doors save state dicts.
    checkpoint_engine: ClassVar[Optional[str]] = None
    #: Every forward is a collective (ZeRO-3 gathers parameters): evaluation must give every process
    #: the same number of batches, padding included.
    forward_is_collective: bool = False

    def __init__(self) -> None:
        self.process = ProcessInfo()
        self.root_device = torch.device("cpu")
        self.precision = Precision("32-true", "cpu")
        self._configured = False
        self._hang_guard: Any = None  # a HangGuard once a process group exists (strategies/hang_guard.py)

    # -- set-up ------------------------------------------------------------------------------------
    def configure(self, process: ProcessInfo, root_device: torch.device, precision: Precision) -> None:
        """Bind the strategy to a process, a device and a precision (done once by the connector)."""
        self.process = process
        self.root_device = root_device
        self.precision = precision
        self._configured = True

    def setup_environment(self) -> None:
        """Start communication and pin the device. A lone process only pins the device."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move the module to the device and wrap it for this strategy."""
        module = self.precision.convert_module(module)
        return module.to(self.root_device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def setup(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        """Wrap a model together with its optimizers (used when `requires_joint_setup`)."""
        return self.setup_module(module), [self.setup_optimizer(o) for o in optimizers]

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module without the strategy's wrapper."""
        return module

    def set_run_hints(self, micro_batch_size: Optional[int] = None, accumulation_steps: int = 1,
                      gradient_clip_val: Optional[float] = None) -> None:
        """What the front door knows about the run before `setup`, for engines configured with it (DeepSpeed)."""

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

    def process_dataloader(self, dataloader: Iterable) -> Iterable:
        """A hook for backends that need their own loader wrapper (XLA's device loader)."""
        return dataloader

    # -- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        self.precision.backward(loss, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Step through the precision plugin; the result is falsy when the step was skipped (inf/NaN
        gradients). It may be a device tensor, so that reading it is the caller's choice."""
        return self.precision.optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip the gradient all-reduce inside this context (accumulation micro-steps)."""
        return contextlib.nullcontext()

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

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, Any], strict: bool = True) -> None:
        self.unwrap_module(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_engine_state(self, writer: Any) -> None:
        """Every rank: write the engine's files through `writer` (only when `checkpoint_engine` is set)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint engine.")

    def read_engine_state(self, url: str, manifest: Dict[str, Any], strict: bool) -> Callable[[], None]:
        """Read and verify the engine's files; return what applies them (after every other check passed)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint engine.")

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
        """Run one torch.distributed collective, under the hang guard where the strategy set one up."""
        guard = self._hang_guard
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
