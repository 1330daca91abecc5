"""The base of the raw door's trackers (Accelerate's `GeneralTracker`), the `on_main_process` decorator, and
`BackendTracker`: a tracker whose calls go to a backend of `fabric_lite.trackers`, where each service's work
is done (the Trainer's loggers use the same backends). tracking.py holds the trackers themselves.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, Optional, Union

__all__ = ["GeneralTracker", "BackendTracker", "on_main_process", "is_main_process"]

PathLike = Union[str, "os.PathLike[str]"]


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


class BackendTracker(GeneralTracker):
    """A tracker over a backend of `fabric_lite.trackers`: it starts when made (`run_name`, `logging_dir`, and
    the keyword arguments of the service's start function); `open_backend` makes the backend, and the
    configuration, values and the end of the run go to it, on the main process only unless `main_process_only`
    is False. `tracker` is the backend's run."""

    backend: Any = None

    def __init__(self, run_name: str, *, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.run_name, self.logging_dir, self.init_kwargs = run_name, logging_dir, kwargs
        self.start()

    @property
    def who(self) -> str:
        """How errors name what asked for the service's package."""
        return f"log_with={self.name!r}"

    def open_backend(self) -> Any:
        raise NotImplementedError

    @on_main_process
    def start(self) -> None:
        if self.backend is None:
            self.backend = self.open_backend()

    @property
    def tracker(self) -> Any:
        return None if self.backend is None else self.backend.run

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> Any:
        return self.backend.log_config(values)

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.backend.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.backend.finish()
