"""Accelerate's environment helpers: `patch_environment`, `clear_environment`, `purge_accelerate_environment`,
`write_basic_config`, and the small readers of flags in the environment (`str_to_bool`, `parse_flag_from_env`,
...)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Union

__all__ = ["patch_environment", "clear_environment", "purge_accelerate_environment", "write_basic_config",
           "str_to_bool", "parse_flag_from_env", "parse_choice_from_env", "get_int_from_env"]


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable (name upper-cased, value as a string) inside the block; on exit
    each is put back as it was (removed if it was not set)."""
    from fabric_lite.launch.launcher import patched_environ

    with patched_environ({key.upper(): str(value) for key, value in kwargs.items()}):
        yield


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty environment; the whole previous environment is back on exit (whatever the block
    set is dropped)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_PREFIXES = ("ACCELERATE_", "FABRIC_LITE_")


def _launch_variables() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_PREFIXES)}


def _purging(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = _launch_variables()
        try:
            return function(*args, **kwargs)
        finally:
            for key in set(_launch_variables()) - set(before):
                os.environ.pop(key, None)
            os.environ.update(before)

    return wrapper


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """A decorator: the ``ACCELERATE_*`` (and ``FABRIC_LITE_*``) environment variables a function sets are removed
    (or put back as they were) when it returns. On a class, every method whose name starts with ``test`` (and
    ``setUp`` / ``tearDown``) is wrapped so, for test suites where one test must not leak settings into the next."""
    if inspect.isclass(func_or_cls):
        for name, member in list(vars(func_or_cls).items()):
            if callable(member) and (name.startswith("test") or name in ("setUp", "tearDown")):
                setattr(func_or_cls, name, _purging(member))
        return func_or_cls
    return _purging(func_or_cls)


def str_to_bool(value: str) -> int:
    """1 for y / yes / t / true / on / 1, 0 for n / no / f / false / off / 0 (any case); ValueError otherwise."""
    value = str(value).lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return 0
    raise ValueError(f"invalid truth value {value!r}: use yes/no, true/false, on/off or 1/0.")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: Any, default: int) -> int:
    """The first of `env_keys` set to a non-negative integer, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def write_basic_config(mixed_precision: str = "no",
                       save_location: Optional[Union[str, os.PathLike]] = None) -> Union[Path, bool]:
    """Write a config file for `fabric-lite launch` without asking questions (what `fabric-lite config --default`
    writes, with `mixed_precision`): one process per GPU on this machine, or one process on the CPU where there is
    no GPU.

    `save_location` defaults to the file `fabric-lite launch` reads by default
    (``~/.config/fabric_lite/default_config.yaml``; ``$FABRIC_LITE_CONFIG_DIR`` or ``$XDG_CONFIG_HOME`` move it);
    pass another path to `--config_file`. As in Accelerate, an existing file is not overwritten: a notice is
    printed and False returned. Returns the path written."""
    import torch

    from fabric_lite.launch.config_file import LaunchConfigFile, default_config_path, save_config, validate

    mixed_precision = str(mixed_precision).lower()
    if mixed_precision == "fp8":
        raise ValueError("write_basic_config(mixed_precision='fp8'): fp8 is not a launch setting fabric_lite "
                         "takes; use 'bf16' (or 'fp16' on a GPU), or configure FP8 in the script.")
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"write_basic_config(mixed_precision={mixed_precision!r}): use 'no', 'fp16' or 'bf16'.")
    path = Path(save_location) if save_location is not None else default_config_path(os.environ)
    if path.exists():
        print(f"User configuration already exists at {path}, will not override. Run `fabric-lite config` or pass "
              f"another save_location.")
        return False
    gpus = torch.cuda.device_count()
    config = validate({**LaunchConfigFile().to_dict(), "nproc_per_node": gpus or 1, "use_cpu": gpus == 0,
                       "mixed_precision": mixed_precision})
    return save_config(config, path)
