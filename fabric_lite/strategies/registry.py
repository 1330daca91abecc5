"""The strategy registry: the one list of strategy names (the doors, `fabric-lite launch --strategy`,
the config file, `explain` and error messages all read it), and of the device runtimes that place their own
processes.

Entries name their class by module path, so listing the names imports neither torch nor an optional
engine. A new strategy adds one `register_strategy` line at the bottom; a new device runtime one
`register_runtime` line (its launch variables, its launcher, the accelerator names that pick it, its strategy).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type, Union

from fabric_lite.checkpoint.engines import engine_format, register_engine_format

__all__ = ["register_strategy", "create_strategy", "available_strategies", "strategy_class",
           "register_checkpoint_engine", "strategy_for_checkpoint_engine", "checkpoint_format_for_engine",
           "runs_one_process", "register_runtime", "RuntimeEntry", "runtimes", "runtime_entry",
           "runtime_for_accelerator", "read_runtime_settings", "runtime_launcher", "runtime_profilers",
           "register_public_class", "public_classes", "load_path"]

# name -> (class or "module:Class", keyword defaults)
_REGISTRY: Dict[str, Tuple[Union[type, str], Dict[str, Any]]] = {}
_ONE_PROCESS: set = set()  # names that train in exactly one process (a launch of several is refused)
# checkpoint engine name (a manifest's "engine") -> "module:Strategy"; its CheckpointFormat is in checkpoint/engines
_ENGINES: Dict[str, str] = {}


def register_strategy(name: str, cls: Union[type, str], one_process: bool = False, **defaults: Any) -> None:
    """Make `name` resolve to `cls(**defaults)`; `cls` may be "package.module:ClassName". `one_process`:
    the strategy trains in a lone process, so `fabric-lite launch` refuses to start several with it."""
    _REGISTRY[name.lower()] = (cls, defaults)
    (_ONE_PROCESS.add if one_process else _ONE_PROCESS.discard)(name.lower())


def runs_one_process(name: str) -> bool:
    """Whether the strategy `name` trains in exactly one process."""
    return name.lower() in _ONE_PROCESS


def available_strategies() -> List[str]:
    """Every name a strategy may be given by ("auto" first)."""
    return ["auto", *sorted(_REGISTRY)]


def strategy_class(name: str) -> Type[Any]:
    """The class a registered name stands for (imports its module, not its engine)."""
    cls, _ = _entry(name)
    return load_path(cls) if isinstance(cls, str) else cls


def _entry(name: str) -> Tuple[Union[type, str], Dict[str, Any]]:
    key = name.lower()
    if key not in _REGISTRY:
        raise ValueError(
            f"Unknown strategy {name!r}. Allowed values: {', '.join(repr(s) for s in available_strategies())}. "
            f"Pass one of these names or a Strategy instance such as DDPStrategy(find_unused_parameters=True)."
        )
    return _REGISTRY[key]


def create_strategy(name: str, world_size: int = 1) -> Any:
    """Build the strategy a string names; "auto" means DDP when several processes run, else single."""
    key = name.lower()
    if key == "auto":
        key = "ddp" if world_size > 1 else "single"
    _, defaults = _entry(key)
    return strategy_class(key)(**defaults)


def register_checkpoint_engine(engine: str, strategy: str, checkpoint_format: str) -> None:
    """Say which strategy ("module:Class") writes checkpoints in the engine files named `engine`, and which
    CheckpointFormat class ("module:Class") reads and consolidates them (registered with checkpoint/, whose
    export of such a checkpoint asks it)."""
    _ENGINES[engine] = strategy
    register_engine_format(engine, checkpoint_format)


def load_path(path: str) -> Any:
    """The object "package.module:name" names (its module imported now)."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)



def strategy_for_checkpoint_engine(engine: str) -> Optional[Type[Any]]:
    """The strategy class whose checkpoint engine wrote a checkpoint (the manifest records the name)."""
    entry = _ENGINES.get(engine)
    return load_path(entry) if entry else None


def checkpoint_format_for_engine(engine: str) -> Optional[Type[Any]]:
    """The CheckpointFormat class of an engine's files (its `consolidate` needs no strategy), or None."""
    return engine_format(engine)


# -- device runtimes that place their own processes ---------------------------------------------------------------

@dataclass(frozen=True)
class RuntimeEntry:
    """A device runtime that starts, numbers and places its own processes (its strategies hold its `Runtime`)."""

    #: The device type its strategies train on; also the name of its profiler (`Trainer(profiler=name)`).
    name: str
    #: "module:function": reads the runtime's launch variables from a mapping into a frozen settings object with
    #: `requested` (accelerator="auto" picks this runtime), `names_device` (notebook_launcher starts its replicas)
    #: and `reason` (the variable that said so, for messages). Built with no arguments: nothing said.
    settings: str
    #: The module of its replica launcher (`asked_for(args)`, `check_launch_args`, `launch_script`,
    #: `launch_function`, `one_process`, `EXPLAIN_REFUSAL`, `RUNTIME_VARIABLES`).
    launcher: str
    #: The accelerator names that pick it.
    accelerators: Tuple[str, ...]
    #: The registry name strategy="auto" becomes on its device.
    strategy: str
    #: Its devices, in messages ("... trains on {label}").
    label: str
    #: The strategies to use on its devices, in messages ("Use {advice}, or leave strategy 'auto'.").
    advice: str
    #: "module:Class" of its profiler, or None.
    profiler: Optional[str] = None


_RUNTIMES: Dict[str, RuntimeEntry] = {}


def register_runtime(name: str, settings: str, launcher: str, accelerators: Tuple[str, ...], strategy: str,
                     label: str, advice: str, profiler: Optional[str] = None) -> None:
    """Register a device runtime (see `RuntimeEntry`); module paths are strings, imported when first asked."""
    _RUNTIMES[name] = RuntimeEntry(name, settings, launcher, tuple(a.lower() for a in accelerators), strategy,
                                   label, advice, profiler)


def runtimes() -> List[RuntimeEntry]:
    """Every registered device runtime, in registration order."""
    return list(_RUNTIMES.values())


def runtime_entry(name: str) -> RuntimeEntry:
    """The registered runtime of device type `name` (KeyError where none is)."""
    return _RUNTIMES[name]


def read_runtime_settings(env: Mapping[str, str]) -> Dict[str, Any]:
    """Each runtime's launch settings read from `env`, by runtime name; a runtime `env` says nothing about
    (its settings equal those built with no arguments) has no entry. Called by `read_launch_environment`."""
    found: Dict[str, Any] = {}
    for entry in _RUNTIMES.values():
        reader: Callable[[Mapping[str, str]], Any] = load_path(entry.settings)
        settings = reader(env)
        if settings != type(settings)():
            found[entry.name] = settings
    return found


def runtime_for_accelerator(accelerator: str, settings: Optional[Mapping[str, Any]] = None
                            ) -> Optional[RuntimeEntry]:
    """The runtime accelerator name `accelerator` picks: the one that lists the name, or for "auto" the first whose
    launch `settings` (`LaunchEnvironment.runtimes`) request it; None: no runtime (a device torch drives)."""
    name = str(accelerator).lower()
    for entry in _RUNTIMES.values():
        if name in entry.accelerators:
            return entry
    if name == "auto" and settings:
        for entry in _RUNTIMES.values():
            if getattr(settings.get(entry.name), "requested", False):
                return entry
    return None


def runtime_launcher(name: str) -> ModuleType:
    """The replica launcher module of the runtime `name` (imported now)."""
    return importlib.import_module(_RUNTIMES[name].launcher)


def runtime_profilers() -> Dict[str, str]:
    """{profiler name: "module:Class"} of the runtimes that have one."""
    return {entry.name: entry.profiler for entry in _RUNTIMES.values() if entry.profiler is not None}


# -- the public classes `fabric_lite.strategies` exports, imported on first use -----------------------------------

_PUBLIC: Dict[str, str] = {}


def register_public_class(name: str, module: str) -> None:
    """Export class `name` of `module` from `fabric_lite.strategies` (imported when first read)."""
    _PUBLIC[name] = module


def public_classes() -> Dict[str, str]:
    """{public class name: module} that `fabric_lite.strategies` exports."""
    return dict(_PUBLIC)


for _name, _module in (("Strategy", "base"), ("ParallelStrategy", "parallel"), ("SingleDeviceStrategy", "single"),
                       ("DDPStrategy", "ddp"), ("FSDPStrategy", "fsdp"), ("ModelParallelStrategy", "model_parallel")):
    register_public_class(_name, f"fabric_lite.strategies.{_module}")

register_strategy("single", "fabric_lite.strategies.single:SingleDeviceStrategy", one_process=True)
register_strategy("single_device", "fabric_lite.strategies.single:SingleDeviceStrategy", one_process=True)
register_strategy("ddp", "fabric_lite.strategies.ddp:DDPStrategy")
# Lightning's names for DDP that looks for parameters a step leaves out of its loss (frozen layers, a GAN's other net)
register_strategy("ddp_find_unused_parameters_true", "fabric_lite.strategies.ddp:DDPStrategy", find_unused_parameters=True)
register_strategy("ddp_find_unused_parameters_false", "fabric_lite.strategies.ddp:DDPStrategy", find_unused_parameters=False)
register_strategy("fsdp", "fabric_lite.strategies.fsdp:FSDPStrategy")
register_strategy("model_parallel", "fabric_lite.strategies.model_parallel:ModelParallelStrategy")
_DEEPSPEED = "fabric_lite.strategies.deepspeed:DeepSpeedStrategy"
register_strategy("deepspeed", _DEEPSPEED)
for _stage in (1, 2, 3):
    register_strategy(f"deepspeed_stage_{_stage}", _DEEPSPEED, stage=_stage)
register_strategy("deepspeed_stage_2_offload", _DEEPSPEED, stage=2, offload_optimizer=True)
register_strategy("deepspeed_stage_3_offload", _DEEPSPEED, stage=3, offload_optimizer=True, offload_parameters=True)
register_checkpoint_engine("deepspeed", _DEEPSPEED, "fabric_lite.strategies.deepspeed_checkpoint:DeepSpeedCheckpointFormat")
register_strategy("xla", "fabric_lite.strategies.xla:XLAStrategy")
register_strategy("xla_spmd", "fabric_lite.strategies.xla:XLASPMDStrategy", one_process=True)
register_public_class("XLAStrategy", "fabric_lite.strategies.xla")
register_public_class("XLASPMDStrategy", "fabric_lite.strategies.xla")
register_runtime("xla", settings="fabric_lite.strategies.xla_env:read_xla_settings",
                 launcher="fabric_lite.launch.xla_launch", accelerators=("tpu", "xla"), strategy="xla",
                 label="XLA devices (TPU)",
                 advice="strategy='xla' (a replica per device) or 'xla_spmd' (one process over every device)",
                 profiler="fabric_lite.profilers.xla:XLAProfiler")
