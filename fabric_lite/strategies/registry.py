"""The strategy registry: the one list of strategy names (the doors, `fabric-lite launch --strategy`,
the config file, `explain` and error messages all read it).

Entries name their class by module path, so listing the names imports neither torch nor an optional
engine. A new strategy adds one `register_strategy` line at the bottom.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Tuple, Type, Union

from fabric_lite.checkpoint.engines import engine_format, register_engine_format

__all__ = ["register_strategy", "create_strategy", "available_strategies", "strategy_class",
           "register_checkpoint_engine", "strategy_for_checkpoint_engine", "checkpoint_format_for_engine",
           "runs_one_process"]

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
    return _load(cls) if isinstance(cls, str) else cls


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


def _load(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def strategy_for_checkpoint_engine(engine: str) -> Optional[Type[Any]]:
    """The strategy class whose checkpoint engine wrote a checkpoint (the manifest records the name)."""
    entry = _ENGINES.get(engine)
    return _load(entry) if entry else None


def checkpoint_format_for_engine(engine: str) -> Optional[Type[Any]]:
    """The CheckpointFormat class of an engine's files (its `consolidate` needs no strategy), or None."""
    return engine_format(engine)


register_strategy("single", "fabric_lite.strategies.single:SingleDeviceStrategy", one_process=True)
register_strategy("single_device", "fabric_lite.strategies.single:SingleDeviceStrategy", one_process=True)
register_strategy("ddp", "fabric_lite.strategies.ddp:DDPStrategy")
# Lightning's names for DDP that looks for parameters a step leaves out of its loss (frozen layers, a GAN's other net)
register_strategy("ddp_find_unused_parameters_true", "fabric_lite.strategies.ddp:DDPStrategy", find_unused_parameters=True)
register_strategy("ddp_find_unused_parameters_false", "fabric_lite.strategies.ddp:DDPStrategy", find_unused_parameters=False)
register_strategy("fsdp", "fabric_lite.strategies.fsdp:FSDPStrategy")
_DEEPSPEED = "fabric_lite.strategies.deepspeed:DeepSpeedStrategy"
register_strategy("deepspeed", _DEEPSPEED)
for _stage in (1, 2, 3):
    register_strategy(f"deepspeed_stage_{_stage}", _DEEPSPEED, stage=_stage)
register_strategy("deepspeed_stage_2_offload", _DEEPSPEED, stage=2, offload_optimizer=True)
register_strategy("deepspeed_stage_3_offload", _DEEPSPEED, stage=3, offload_optimizer=True, offload_parameters=True)
register_checkpoint_engine("deepspeed", _DEEPSPEED, "fabric_lite.strategies.deepspeed_checkpoint:DeepSpeedCheckpointFormat")
register_strategy("xla", "fabric_lite.strategies.xla:XLAStrategy")
register_strategy("xla_spmd", "fabric_lite.strategies.xla:XLASPMDStrategy", one_process=True)
