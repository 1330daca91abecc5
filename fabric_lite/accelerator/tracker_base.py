"""What every tracker shares: the `GeneralTracker` base, the `on_main_process` decorator, and the helpers the
trackers (and the Trainer's logger callbacks, fabric_lite/callbacks/loggers.py) use to import their package
lazily and to turn logged values into plain ones.

The trackers are in tracker_mlflow.py, trackers_core.py (TensorBoard, W&B, CSV), trackers_services.py (Comet,
ClearML, SwanLab, Trackio) and trackers_local.py (DVCLive, Aim); tracking.py gathers them.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import numbers
import warnings
from typing import Any, Callable, Dict, Mapping, Optional

__all__ = ["GeneralTracker", "on_main_process", "require", "is_installed", "flatten", "scalar", "is_number",
           "config_for_file", "warn_once"]


# -- shared helpers ------------------------------------------------------------------------------------

def require(module: str, who: str, extra: str) -> Any:
    """Import `module`, or raise ModuleNotFoundError saying in one sentence what to install.

    `who` names what needs it (``"log_with='mlflow'"``, ``"MLFlowLogger"``); `extra` is the fabric-lite extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        message = f"{who} needs {top}: pip install 'fabric-lite[{extra}]'"
        if (err.name or "").split(".")[0] == top:
            raise ModuleNotFoundError(message, name=top) from None
        # the package is there but something it imports is not: say which
        raise ModuleNotFoundError(f"{message} (importing {top} failed: {err})", name=err.name) from err


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flatten(values: Any, sep: str = "/", prefix: str = "") -> Dict[str, Any]:
    """{"opt": {"lr": 0.1}} -> {"opt/lr": 0.1}; an argparse.Namespace counts as a dict."""
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


def scalar(value: Any) -> Any:
    """A one-element tensor or array as a Python number; anything else as it is."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        numel = getattr(value, "numel", None)
        count = numel() if callable(numel) else getattr(value, "size", 1)
        if count == 1:
            return value.item()
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def config_for_file(values: Any) -> Any:
    """`values` made of plain JSON/YAML types (anything else as its str())."""
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    return json.loads(json.dumps(values, default=str))


def warn_once(warned: set, key: str, message: str) -> None:
    """Warn with `message` the first time `key` is seen in `warned`."""
    if key not in warned:
        warned.add(key)
        warnings.warn(message, stacklevel=3)


def is_main_process() -> bool:
    """Whether this is the main process, from the current Accelerator or the launch environment (starts nothing)."""
    from fabric_lite.state import process_facts

    return process_facts()["process_index"] == 0


def on_main_process(function: Callable) -> Callable:
    """Decorate a tracker's method so that it runs on the main process only when the tracker's
    `main_process_only` is True (it returns None elsewhere); with `main_process_only = False` it runs everywhere.

    Which process is main is asked when the method is called, from the current Accelerator or else the launch
    environment, so decorating starts nothing.
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not is_main_process():
            return None
        return function(self, *args, **kwargs)

    return wrapper


class GeneralTracker:
    """A tracker: `store_init_configuration`, `log`, `finish`; `tracker` is the underlying object.

    `requires_logging_directory`: whether it needs `Accelerator(project_dir=...)`; `package`: the module it
    imports (None: nothing beyond fabric_lite), which `log_with="all"` checks for, with `setup_missing` (an
    account it would need and nobody set up here); `main_process_only`: whether
    its methods decorated with `on_main_process` run on the main process only (the Accelerator starts and feeds
    trackers on the main process either way).
    """

    name = "general"
    requires_logging_directory = False
    main_process_only = True
    package: Optional[str] = None

    @property
    def tracker(self) -> Any:
        return None

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """What this tracker lacks to start here and how to give it, in a few words, or None when it can start
        (the default: it needs no account). Decided from the environment, the tool's config files and
        `init_kwargs` (its part of `init_trackers(init_kwargs=...)`), without the network or its package.

        `log_with="all"` skips, with a warning, an installed tracker that lacks something; a tracker named in
        `log_with` is started anyway, and when it fails this is added to the error."""
        return None

    def start(self) -> None:
        """Start the run (the trackers here start when they are made; this is for trackers written to start
        later)."""

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        pass

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass
