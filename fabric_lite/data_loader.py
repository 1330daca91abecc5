"""Accelerate's ``accelerate.data_loader`` module path, so ``from fabric_lite.data_loader import ...`` works as the script's
``from accelerate.data_loader import ...`` did: the prepared dataloaders (DataLoaderShard, IterableDatasetShard, skip_first_batches, ...), from `fabric_lite.data` (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

TARGET = "fabric_lite.data"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(TARGET), name)


def __dir__() -> list:
    return sorted(set(globals()) | set(dir(importlib.import_module(TARGET))))
