"""The strategy registry: one place where strings like "ddp" become Strategy objects.

Each strategy class lists its own names in ``aliases``; optional engines are registered by module
path so that naming them here does not import them.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple, Type, Union

from fabric_lite.strategies.base import Strategy
from fabric_lite.strategies.ddp import DDPStrategy
from fabric_lite.strategies.single import SingleDeviceStrategy

__all__ = ["Strategy", "SingleDeviceStrategy", "DDPStrategy", "register_strategy", "create_strategy", "available_strategies"]

# name -> (class or "module:Class", keyword defaults)
_REGISTRY: Dict[str, Tuple[Union[Type[Strategy], str], Dict[str, Any]]] = {}


def register_strategy(name: str, cls: Union[Type[Strategy], str], **defaults: Any) -> None:
    """Make `name` resolve to `cls(**defaults)`; `cls` may be "package.module:ClassName"."""
    _REGISTRY[name.lower()] = (cls, defaults)


def available_strategies() -> list:
    return ["auto", *sorted(_REGISTRY)]


def create_strategy(name: str, world_size: int = 1) -> Strategy:
    """Build the strategy a string names; "auto" means DDP when several processes run, else single."""
    key = name.lower()
    if key == "auto":
        key = "ddp" if world_size > 1 else "single"
    if key not in _REGISTRY:
        raise ValueError(
            f"Unknown strategy {name!r}. Allowed values: {', '.join(repr(s) for s in available_strategies())}. "
            f"Pass one of these names or a Strategy instance such as DDPStrategy(find_unused_parameters=True)."
        )
    cls, defaults = _REGISTRY[key]
    if isinstance(cls, str):
        module_name, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
    return cls(**defaults)


for _cls in (SingleDeviceStrategy, DDPStrategy):
    for _alias in _cls.aliases:
        register_strategy(_alias, _cls)

_DEEPSPEED = "fabric_lite.strategies.deepspeed:DeepSpeedStrategy"
register_strategy("deepspeed", _DEEPSPEED)
for _stage in (1, 2, 3):
    register_strategy(f"deepspeed_stage_{_stage}", _DEEPSPEED, stage=_stage)
register_strategy("deepspeed_stage_2_offload", _DEEPSPEED, stage=2, offload_optimizer=True)
register_strategy("deepspeed_stage_3_offload", _DEEPSPEED, stage=3, offload_optimizer=True, offload_parameters=True)
