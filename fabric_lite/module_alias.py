"""Module paths of Accelerate's (`accelerate.optimizer`, `accelerate.tracking`, ...) that answer from fabric_lite's own
module holding the same names, imported on first use, so `from fabric_lite.tracking import X` costs nothing until
X is asked for."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Tuple


def forward_names(target: str, namespace: Dict[str, Any]) -> Tuple[Callable[[str], Any], Callable[[], list]]:
    """The module-level `__getattr__` and `__dir__` of an alias module (`namespace`: its globals()) whose names
    live in the module `target`."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(target), name)

    def __dir__() -> list:
        return sorted(set(namespace) | set(dir(importlib.import_module(target))))

    return __getattr__, __dir__
