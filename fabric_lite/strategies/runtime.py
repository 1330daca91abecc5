"""The runtime a strategy holds (`strategy.runtime`): how its processes meet its devices.

Three kinds, each a `Runtime` class:

- process per device (`Runtime`, the default: single device, DDP, FSDP, DeepSpeed): a launcher starts one
  process per device, the accelerator says the device type, the prepared loader moves batches itself, and
  the Trainer re-launches a plain `python train.py` under torchrun;
- runtime replicas (`kind = REPLICAS`): a device runtime owns the world (it starts, numbers and places the
  replicas: `start`), forces its device type, and may feed batches and mark steps of its own;
- one SPMD process (`kind = SPMD`) drives every device of the machine: `devices` counts the devices each
  batch is spread over, and nothing is re-launched.

A new device runtime is a subclass in its own file; the strategy names it with `runtime = RuntimeSlot(...)`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, ClassVar, List, Optional, Tuple, Type

import torch

from fabric_lite.strategies.environments import LaunchSettings, ProcessInfo

__all__ = ["Runtime", "Slot", "RuntimeSlot", "PROCESS_PER_DEVICE", "REPLICAS", "SPMD"]

PROCESS_PER_DEVICE, REPLICAS, SPMD = "process_per_device", "replicas", "spmd"


class Runtime:
    """Process per device (the default); subclasses describe a device runtime of their own."""

    #: PROCESS_PER_DEVICE, REPLICAS or SPMD.
    kind: ClassVar[str] = PROCESS_PER_DEVICE
    #: The device type it trains on whatever else is asked, or None (cpu, cuda or mps, as the accelerator says).
    #: Where set, the connector calls `start` instead of placing the process itself.
    device_type: ClassVar[Optional[str]] = None
    #: Evaluation may run under torch.inference_mode (False where the device has no inference tensors).
    inference_tensors: ClassVar[bool] = True
    #: What `fabric-lite launch` needs besides `--nproc-per-node N` to start this runtime's processes.
    launch_flags: ClassVar[str] = ""

    def __init__(self, strategy: Any = None) -> None:
        # Held weakly: the strategy holds its runtime, and a cycle would keep a finished run's strategy (and the
        # parameters it recorded) alive until the garbage collector runs, on a lazy device with their pending work.
        self._strategy = None if strategy is None else weakref.ref(strategy)
        #: Called after each optimizer step the doors run, or None (then no call per step at all).
        self.step_marker: Optional[Callable[[], None]] = None
        #: The devices one process drives, in every node together, once a runtime that spreads each batch over them
        #: (SPMD) started; None: one device per process.
        self.driven_devices: Optional[int] = None

    @property
    def strategy(self) -> Any:
        """The strategy holding this runtime (None once it is gone, or for a runtime built on its own)."""
        return None if self._strategy is None else self._strategy()

    @property
    def drives_all_devices(self) -> bool:
        """One process drives every device of the machine (SPMD)."""
        return self.kind == SPMD

    def start(self, launched: ProcessInfo, devices: Any, settings: Any = None) -> Tuple[ProcessInfo, torch.device]:
        """Start the runtime that owns the world (only where `device_type` is set); return this replica's place in
        it and its device. `launched`: what the launch environment said; `devices`: what the user asked for;
        `settings`: this runtime's launch settings (`LaunchEnvironment.runtimes`; None where nothing is set)."""
        raise NotImplementedError(f"{type(self).__name__} trains where the accelerator says; it starts nothing.")

    def check_precision(self, precision: str) -> None:
        """Refuse, in one sentence, a precision (a canonical name: "16-mixed", ...) this runtime's device cannot train
        in; the connector asks before building the precision plugin."""

    def device_feed(self, non_blocking: bool = False) -> Optional[Callable[[Any], Any]]:
        """A callable that moves one batch to this process's device, which the prepared loader calls on every batch
        (it stays the one object with position, epoch and sizes). None: the loader moves batches to the strategy's
        `root_device` itself (on a CUDA side stream where it can)."""
        return None

    @classmethod
    def started_by_launcher(cls, launch: LaunchSettings) -> bool:
        """This process is one that the runtime's own launcher started (nothing to re-launch); `launch`: the
        settings the launch environment passed down."""
        return False

    @classmethod
    def relaunch_command(cls, devices: int, num_nodes: int, script: str, args: List[str]) -> Optional[List[str]]:
        """The command that starts `script` again on `devices` processes (the Trainer's re-launch); None: the
        default, one process per device under torch.distributed.run (`launch.launcher.torchrun_command`)."""
        return None


class Slot:
    """`runtime = Slot(SomeRuntime)` (or `collectives = Slot(SomeCollectives)`) on a strategy class: the class reads
    the collaborator's class (the runtime: what the Trainer re-launches by, before anything is built), each instance
    its own collaborator, built from the strategy on first use."""

    def __init__(self, runtime: Type[Any], name: str = "runtime") -> None:
        self.runtime = runtime
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self.runtime
        built = self.runtime(obj)
        obj.__dict__[self.name] = built  # later reads find it there, without this call
        return built



RuntimeSlot = Slot  # (the name strategies use for their runtime)
