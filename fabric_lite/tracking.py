"""Accelerate's ``accelerate.tracking`` module path, so ``from fabric_lite.tracking import ...`` works as the script's
``from accelerate.tracking import ...`` did: experiment trackers (GeneralTracker, TensorBoardTracker, ...), from `fabric_lite.accelerator.tracking` (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

TARGET = "fabric_lite.accelerator.tracking"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(TARGET), name)


def __dir__() -> list:
    return sorted(set(globals()) | set(dir(importlib.import_module(TARGET))))
