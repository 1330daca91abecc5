"""The Strategy contract: a small core every strategy implements, and the collaborators it may hold.

A strategy answers, for a whole run, where this process is, how a model is wrapped and how gradients
move; it owns *where* and *how*, never *when*. The doors never ask *which* strategy they hold. A new
strategy is one file with a subclass and one line in `strategies/registry.py`.

The core:

=====================================  ==================================================================
topology                               `device_mesh` (named dimensions: "dp", and "tp" for N-D parallelism),
                                       `world_size`, `global_rank`, `dp_size`, `dp_rank` (the data-parallel
                                       group the doors shard data over), `is_global_zero`
`setup_environment()` / `teardown()`   start and release communication (abstract)
`setup(modules, optimizers)`           wrap for this strategy; `setup_module` (abstract), `setup_optimizer`
`unwrap_module`                        the user's module without the wrapper (abstract)
`backward` / `optimizer_step`          through the precision plugin (scaling, unscale, inf/NaN skip)
`no_backward_sync(module)`             one meaning: skip the gradient reduction (abstract);
                                       `force_backward_sync` undoes it for one backward
`clip_gradients`                       by norm or by value, the right way for this strategy
`barrier()`                            wait for every process (the other collectives: `collectives` below)
=====================================  ==================================================================

Collaborators it holds, each with one meaning:

- `collectives` (`collectives.py`): `barrier`, `all_reduce`, `all_gather(_object)`, `broadcast(_object)` over the
  world, and `collectives.over("dp")` over the data-parallel group; identities on one process.
- `process_group` (`process_group.py`): backend, timeout, store, hang guard, side group; None where there is
  no torch.distributed group of its own (one device, a runtime that owns the world).
- `checkpoint_format` (`checkpoint_format.py`): "state_dict" | "dcp" | an engine's own files, with save, read,
  consolidate and what a save may do (partial gradients, background writes, rank-0 weight reads); it holds the
  state dict reads and writes (`module_state_dict`, `optimizer_state_dict`, their loads, `to_host`).
- `engine_step` (`engine_step.py`): for an engine that owns the step (DeepSpeed): joint set-up, run hints and
  the accumulation boundary; None elsewhere.

- `runtime` (`runtime.py`, a class attribute `RuntimeSlot(...)`): how its processes meet its devices (process
  per device, runtime replicas, one SPMD process): the device feed, the step marker, the device type it forces,
  the start of a runtime that owns the world, and the Trainer's re-launcher.

`traits` (`Traits`, a frozen value on the class): its registry names, Accelerate's `DistributedType` name, and the
capabilities the doors ask instead of isinstance checks (`initializes_on_meta`, `forward_is_collective`,
`syncs_gradients_per_forward`), each with one reader.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fabric_lite.strategies.checkpoint_format import CheckpointFormat
from fabric_lite.strategies.collectives import Collectives, ReduceOp
from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.strategies.precision import Precision
from fabric_lite.strategies.runtime import Runtime, Slot

if TYPE_CHECKING:
    from fabric_lite.strategies.engine_step import EngineStep
    from fabric_lite.strategies.process_group import ProcessGroup

__all__ = ["Strategy", "Traits", "ReduceOp", "Mesh"]



@dataclasses.dataclass(frozen=True)
class Traits:
    """What a strategy class is, for the doors that must not ask which class it is; each field has one reader.

    - `names`: the registry names it answers to (the first is its own), () for a class of the user's.
    - `accelerate_type`: Hugging Face Accelerate's `DistributedType` name for it, where it has its own one.
    - `initializes_on_meta`: `setup_module` takes a model built on the meta device and gives each process its own
      shards only (`init_module` builds there by default).
    - `forward_is_collective`: every forward is a collective (ZeRO-3 gathers parameters): evaluation must give every
      process the same number of batches, padding included.
    - `syncs_gradients_per_forward`: gradients are averaged by the model's wrapper during the one backward that
      follows each forward (DDP's reducer). A loop that runs several backwards per forward (a module stepping its own
      optimizers, as a GAN does) forwards through the unwrapped model and averages each optimizer's gradients as it
      steps instead.
    """

    names: Tuple[str, ...] = ()
    accelerate_type: Optional[str] = None
    initializes_on_meta: bool = False
    forward_is_collective: bool = False
    syncs_gradients_per_forward: bool = False

    def but(self, **changes: Any) -> "Traits":
        """These traits with some fields changed (a strategy whose instances differ: DeepSpeed's stage 3)."""
        return dataclasses.replace(self, **changes)


class Strategy(abc.ABC):
    """The contract every strategy implements (see the module docstring for the list)."""

    #: What the doors may ask about it instead of which class it is (`Traits`; each field has one meaning).
    traits: Traits = Traits()
    #: How its processes meet its devices (process per device, runtime replicas, one SPMD process): the device
    #: feed, the step marker, the device type it forces and the re-launcher (`strategies/runtime.py`).
    runtime = Slot(Runtime)
    #: Reductions, gathers and broadcasts over the world, or `.over("dp")` the data-parallel group
    #: (strategies/collectives.py); a runtime with collectives of its own names its subclass here.
    collectives = Slot(Collectives, "collectives")
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

    def clip_gradients(
        self, parameters: Iterable[torch.Tensor], optimizer: Optional[torch.optim.Optimizer], *,
        max_norm: Optional[float] = None, norm_type: float = 2.0, clip_value: Optional[float] = None,
    ) -> Optional[torch.Tensor]:
        """Clip by norm (`max_norm`: returns the total norm) or by value (`clip_value`: returns None), after
        unscaling `optimizer`'s gradients where one is given."""
        if optimizer is not None:
            self.precision.unscale_gradients(optimizer)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(parameters, clip_value)
            return None
        if max_norm is None:
            raise TypeError("clip_gradients() needs max_norm or clip_value.")
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


    def explain_lines(self, modules: Sequence[nn.Module], optimizers: Sequence[Any], world: int) -> List[Tuple[str, str, str]]:
        """What `fabric-lite explain` adds about this strategy, as (section, label, text); section is
        "hardware" or "precision". `world` is the planned number of processes."""
        return []

    # -- collectives: `collectives` (world) and `collectives.over("dp")`; the barrier is also spelled here ---------
    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every process gets here (Lightning's `strategy.barrier()`)."""
        self.collectives.barrier(name)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self.root_device}, precision={self.precision.name!r}, "
            f"rank={self.global_rank}/{self.world_size})"
        )


class Mesh:
    """Named dimensions of a device mesh: each one's size and this process's coordinate on it."""

    __slots__ = ("names", "sizes", "coords", "torch")

    def __init__(self, names: Tuple[str, ...], sizes: Tuple[int, ...], coords: Tuple[int, ...],
                 torch_mesh: Any = None) -> None:
        self.names, self.sizes, self.coords = tuple(names), tuple(sizes), tuple(coords)
        #: torch's DeviceMesh over the same processes, where the strategy built one (N-D parallelism), else None.
        self.torch = torch_mesh

    def size(self, name: str) -> int:
        return self.sizes[self._index(name)]

    def rank(self, name: str) -> int:
        return self.coords[self._index(name)]

    def groups(self, name: str) -> List[List[int]]:
        """The global ranks of each group along dimension `name`: processes that share every other coordinate.
        Global ranks number the mesh row-major, in the order of `names` (the last dimension varies fastest)."""
        axis = self._index(name)
        strides = [1] * len(self.sizes)
        for i in range(len(self.sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * self.sizes[i + 1]
        others = [range(n) if i != axis else range(1) for i, n in enumerate(self.sizes)]
        return [[sum(c * s for c, s in zip(fixed, strides)) + k * strides[axis] for k in range(self.sizes[axis])]
                for fixed in itertools.product(*others)]

    def _index(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"The mesh has no dimension {name!r}; it has {', '.join(map(repr, self.names))}.")
        return self.names.index(name)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes)) + ")"
