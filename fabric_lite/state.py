"""Accelerate's state objects (``accelerate.state``): `PartialState`, `AcceleratorState`, `GradientState`.

`PartialState()` tells a script where its process is (ranks, device, kind of run) and runs the process
control helpers (`wait_for_everyone`, `main_process_first`, `split_between_processes`, ...) before any
`Accelerator` exists: the first one reads the launch environment and starts the process group, as the
Accelerator would. Once an `Accelerator` exists, every state object answers from that Accelerator's
strategy (the latest one created), so the two never disagree. `accelerator.state` is an
`AcceleratorState` bound to that Accelerator.

>>> state = PartialState()
>>> state.num_processes, state.distributed_type == "NO"
(1, True)
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

from fabric_lite.accelerator.enums import DistributedType
from fabric_lite.accelerator.process_control import ProcessFacts
from fabric_lite.engine import GradientState as EngineGradientState

__all__ = ["PartialState", "AcceleratorState", "GradientState", "DistributedType", "bind_accelerator",
           "current_strategy", "process_facts"]

# Shared by every state object of this process: the latest Accelerator (held weakly: a state object must not
# keep a finished run alive), and the strategy a PartialState started when there was no Accelerator.
_shared: Dict[str, Any] = {"accelerator": None, "strategy": None}


def bind_accelerator(accelerator: Any) -> None:
    """Make `accelerator` the one every state object answers from (each new Accelerator calls this)."""
    _shared["accelerator"] = weakref.ref(accelerator)


def current_accelerator() -> Any:
    """The latest Accelerator still alive, or None."""
    ref = _shared["accelerator"]
    return ref() if ref is not None else None


def current_strategy(start: bool = False, cpu: bool = False, mixed_precision: Optional[str] = None,
                     backend: Optional[str] = None, timeout: Any = None) -> Any:
    """The strategy of the latest Accelerator, else the one a PartialState started; with `start`, start one
    from the launch environment when neither exists (None otherwise)."""
    accelerator = current_accelerator()
    if accelerator is not None:
        return accelerator.strategy
    if _shared["strategy"] is None and start:
        _shared["strategy"] = _start_strategy(cpu, mixed_precision, backend, timeout)
    return _shared["strategy"]


def _start_strategy(cpu: bool, mixed_precision: Optional[str], backend: Optional[str], timeout: Any) -> Any:
    """The strategy `Accelerator()` would pick for this process (from the launch environment), started: with
    several processes, the process group is up when this returns."""
    from fabric_lite.strategies import create_strategy
    from fabric_lite.strategies.connector import connect
    from fabric_lite.strategies.environments import read_launch_environment

    env = read_launch_environment()  # (no Accelerator yet: this is the run's one read)
    launch, process = env.launch, env.process
    accelerator = "cpu" if (cpu or launch.use_cpu) else (launch.accelerator or "auto")
    strategy = create_strategy("auto", process.world_size)
    group = strategy.process_group  # (None for one process on one device)
    if backend is not None and group is not None:
        group.requested_backend = backend
    if timeout is not None and group is not None:
        group.timeout = timeout
    strategy = connect(strategy, accelerator=accelerator, precision=mixed_precision or launch.mixed_precision or "no",
                       process=process, runtimes=env.runtimes)
    strategy.setup_environment()
    return strategy


def process_facts() -> Dict[str, int]:
    """This process's ranks without starting anything: from the current state when there is one, else from
    the launch environment (for logging and progress bars, which must not start a process group)."""
    strategy = current_strategy()
    if strategy is not None:
        return {"process_index": strategy.global_rank, "local_process_index": strategy.process.local_rank,
                "num_processes": strategy.world_size}
    from fabric_lite.strategies.environments import read_launch_environment

    process = read_launch_environment().process
    return {"process_index": process.global_rank, "local_process_index": process.local_rank,
            "num_processes": process.world_size}


class PartialState(ProcessFacts):
    """Where this process is, and process control, without an Accelerator (Accelerate's `PartialState`).

    All instances share one state: they answer from the latest `Accelerator`, or, before there is one, from
    the strategy the first `PartialState()` started (`cpu=True` keeps it on the CPU; `backend=` and
    `timeout=` set the process group's). Attributes: `process_index`, `local_process_index`,
    `num_processes`, `device`, `distributed_type`, `is_main_process`, `is_local_main_process`,
    `is_last_process`, `use_distributed`, `backend`; methods `wait_for_everyone`, `main_process_first`,
    `local_main_process_first`, `split_between_processes`, `on_main_process`, `print`, ...
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        current_strategy(start=True, cpu=cpu, mixed_precision=kwargs.get("mixed_precision"),
                         backend=kwargs.get("backend"), timeout=kwargs.get("timeout"))

    @property
    def strategy(self) -> Any:
        return current_strategy(start=True)

    @property
    def initialized(self) -> bool:
        return current_strategy() is not None

    @property
    def default_device(self) -> Any:
        return self.device

    @property
    def backend(self) -> Optional[str]:
        """The process group's backend ("nccl", "gloo", ...), None on one process."""
        if not self.use_distributed:
            return None
        group = self.strategy.process_group
        return group.backend if group is not None else None

    @property
    def num_processes_per_node(self) -> int:
        return self.strategy.process.local_world_size

    debug = False  # (Accelerate's debug mode checks collectives' shapes; fabric_lite's hang guard names them)
    fork_launched = False

    def destroy_process_group(self, group: Any = None) -> None:
        """Shut the process group down (what `end_training` does), if one is up."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = True) -> None:
        """Forget the shared state (for tests that build several runs in one process)."""
        _shared["accelerator"] = None
        if reset_partial_state:
            _shared["strategy"] = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(distributed_type={self.distributed_type.value}, num_processes="
                f"{self.num_processes}, process_index={self.process_index}, local_process_index="
                f"{self.local_process_index}, device={self.device})")


class AcceleratorState(PartialState):
    """`PartialState` plus the run's settings (Accelerate's `AcceleratorState`): `mixed_precision`,
    `dynamo_plugin`, `deepspeed_plugin`, `fsdp_plugin`. `accelerator.state` is one bound to that Accelerator;
    `AcceleratorState()` answers from the latest Accelerator (or, before one exists, as `PartialState`)."""

    def __init__(self, mixed_precision: Optional[str] = None, cpu: bool = False, **kwargs: Any) -> None:
        self.accelerator = None
        if current_accelerator() is None:
            super().__init__(cpu=cpu, mixed_precision=mixed_precision, **kwargs)

    @classmethod
    def of(cls, accelerator: Any) -> "AcceleratorState":
        """The state of `accelerator` (what `accelerator.state` returns)."""
        state = cls.__new__(cls)
        state.accelerator = accelerator
        return state

    def _source(self) -> Any:
        return self.accelerator if self.accelerator is not None else current_accelerator()

    @property
    def strategy(self) -> Any:
        source = self._source()
        return source.strategy if source is not None else current_strategy(start=True)

    @property
    def mixed_precision(self) -> str:
        """'no', 'fp16' or 'bf16'."""
        return self.strategy.precision.accelerate_name

    @property
    def dynamo_plugin(self) -> Any:
        return getattr(self._source(), "dynamo_plugin", None)

    @property
    def deepspeed_plugin(self) -> Any:
        return getattr(self._source(), "deepspeed_plugin", None)

    @property
    def fsdp_plugin(self) -> Any:
        return getattr(self._source(), "fsdp_plugin", None)

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP  # (fabric_lite's FSDP is FSDP2)

    use_ipex = False

    def __repr__(self) -> str:
        # (`print(accelerator.state)` shows the precision in use, as Accelerate's does)
        return f"{super().__repr__()[:-1]}, mixed_precision={self.mixed_precision})"


class GradientState(EngineGradientState):
    """What the step knows about gradients and the loader being iterated (Accelerate's `GradientState`):
    `sync_gradients`, `end_of_dataloader`, `remainder`, and `active_dataloader` (the prepared loader being
    iterated, innermost first; None outside any), `in_dataloader`, `num_steps`."""

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        super().__init__()
        self.plugin = gradient_accumulation_plugin

    @property
    def active_dataloader(self) -> Any:
        return self.active[-1] if self.active else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)

    @property
    def dataloader_references(self) -> List[Any]:
        return [None, *self.active]

    @property
    def num_steps(self) -> int:
        return self.plugin.num_steps if self.plugin is not None else 1

    @property
    def adjust_scheduler(self) -> bool:
        return getattr(self.plugin, "adjust_scheduler", True)

    @property
    def sync_with_dataloader(self) -> bool:
        return getattr(self.plugin, "sync_with_dataloader", True)

    @property
    def plugin_kwargs(self) -> Dict[str, Any]:
        return self.plugin.to_kwargs() if self.plugin is not None and hasattr(self.plugin, "to_kwargs") else {}
