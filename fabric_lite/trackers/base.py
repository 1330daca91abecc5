"""What the tracker backends share: importing a service's package lazily with a one-sentence error, and turning
logged values (tensors, nested dicts, argparse namespaces) into plain ones."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import numbers
import warnings
from typing import Any, Dict, Mapping

__all__ = ["require", "is_installed", "flatten", "scalar", "is_number", "config_for_file", "warn_once",
           "numbers_and_texts", "url_exists", "open_url"]


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


def numbers_and_texts(values: Mapping[str, Any], where: str, warned: set) -> Dict[str, Any]:
    """`values` flattened with '/', tensors as numbers; values that are neither numbers nor strings are left
    out with a warning (once per name)."""
    out = {}
    for key, value in flatten(values).items():
        value = scalar(value)
        if is_number(value) or isinstance(value, str):
            out[key] = value
        else:
            warn_once(warned, key, f"{where} logs numbers and strings: {key}={value!r} is not logged.")
    return out


def url_exists(url: str) -> bool:
    """Whether the file at `url` (a local path or any fsspec URL) is there."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return bool(fs.exists(path))


def open_url(url: str, mode: str, **text_kwargs: Any) -> Any:
    """Open the file at `url` (a local path or any fsspec URL), making its folder when writing; `text_kwargs`
    (`newline=`, `encoding=`) go to the text wrapper."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    if "r" not in mode:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    return fs.open(path, mode, **text_kwargs)
