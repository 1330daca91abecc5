"""Strategies: where a process runs, how a model is wrapped, how gradients move.

`base.Strategy` is the contract; each strategy implements it in a file of its own; `registry` is the one list of
names (and of the public classes exported here); `precision`, `environments` and `connector` are the pieces a
strategy is configured with. Names are imported on first use, so listing strategies stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from fabric_lite.strategies.registry import (
    available_strategies, create_strategy, public_classes, register_strategy, strategy_class,
)

__all__ = [*public_classes(), "register_strategy", "create_strategy", "available_strategies", "strategy_class"]


def __getattr__(name: str) -> Any:
    module = public_classes().get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_lite.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
