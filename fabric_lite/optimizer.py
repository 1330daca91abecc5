"""Accelerate's ``accelerate.optimizer`` module path, so ``from fabric_lite.optimizer import ...`` works as the script's
``from accelerate.optimizer import ...`` did: AcceleratedOptimizer, from `fabric_lite.accelerator.wrappers` (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

TARGET = "fabric_lite.accelerator.wrappers"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(TARGET), name)


def __dir__() -> list:
    return sorted(set(globals()) | set(dir(importlib.import_module(TARGET))))
