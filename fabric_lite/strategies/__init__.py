"""Strategies: where a process runs, how a model is wrapped, how gradients move.

`base.Strategy` is the contract; `single`, `ddp`, `fsdp`, `deepspeed`, `xla` implement it, one file each;
`registry` is the one list of names; `precision`, `environments` and `connector` are the pieces a
strategy is configured with. Names are imported on first use, so listing strategies stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from fabric_lite.strategies.registry import available_strategies, create_strategy, register_strategy, strategy_class

__all__ = ["Strategy", "ParallelStrategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "XLAStrategy",
           "XLASPMDStrategy", "register_strategy", "create_strategy", "available_strategies", "strategy_class"]

_LAZY = {"Strategy": "fabric_lite.strategies.base", "ParallelStrategy": "fabric_lite.strategies.parallel",
         "SingleDeviceStrategy": "fabric_lite.strategies.single",
         "DDPStrategy": "fabric_lite.strategies.ddp", "FSDPStrategy": "fabric_lite.strategies.fsdp",
         "XLAStrategy": "fabric_lite.strategies.xla", "XLASPMDStrategy": "fabric_lite.strategies.xla"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_lite.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
