"""The environment a launch hands its workers: the settings `Accelerator()` reads in each one
(`settings_env`), set for the duration of a start (`patched_environ`)."""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Mapping, Optional

from fabric_lite.strategies.environments import ENV_GRAD_ACCUM, ENV_LAUNCHED, ENV_MIXED_PRECISION, ENV_USE_CPU
from fabric_lite.strategies.precision import resolve_precision

__all__ = ["settings_env", "patched_environ"]


def settings_env(mixed_precision: Optional[str], gradient_accumulation_steps: Optional[int],
                 cpu: bool) -> Dict[str, str]:
    """The variables that carry a launch's settings to the Accelerator in each worker."""
    env: Dict[str, str] = {ENV_LAUNCHED: "1"}
    if mixed_precision is not None:
        env[ENV_MIXED_PRECISION] = resolve_precision(mixed_precision)
    if gradient_accumulation_steps is not None:
        if gradient_accumulation_steps < 1:
            raise ValueError(f"--gradient-accumulation-steps={gradient_accumulation_steps} must be >= 1.")
        env[ENV_GRAD_ACCUM] = str(gradient_accumulation_steps)
    if cpu:
        env[ENV_USE_CPU] = "1"
    return env


@contextlib.contextmanager
def patched_environ(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (str) or remove (None) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
