"""Logging that knows about processes (Accelerate's `accelerate.logging`).

>>> from fabric_lite.logging import get_logger
>>> logger = get_logger(__name__, log_level="INFO")
>>> logger.info("once, from the main process")                        # doctest: +SKIP
>>> logger.info("from every process", main_process_only=False)        # doctest: +SKIP
>>> logger.info("every process, rank by rank", main_process_only=False, in_order=True)  # doctest: +SKIP

Which process this is comes from the current `PartialState` / `Accelerator` when there is one, else from
the launch environment, so a logger works at import time, before anything is started.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, MutableMapping, Optional, Tuple, Union

__all__ = ["get_logger", "MultiProcessAdapter"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A `logging.LoggerAdapter` whose calls take two more keywords: `main_process_only` (default True: only
    the main process emits the record) and `in_order` (default False: with True, every process emits in turn,
    rank 0 first; all processes must make the call, as it waits for each other)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 1)  # (1: the caller; _emit skips this adapter's own frames)
        if not self.isEnabledFor(level):
            return
        if in_order:
            from fabric_lite.state import PartialState

            state = PartialState()  # waiting for each other needs the process group
            for turn in range(state.num_processes):
                if turn == state.process_index and (not main_process_only or state.is_main_process):
                    self._emit(level, msg, args, kwargs)
                state.wait_for_everyone()
            return
        if not main_process_only or _process_index() == 0:
            self._emit(level, msg, args, kwargs)

    def _emit(self, level: int, msg: Any, args: Tuple[Any, ...], kwargs: MutableMapping[str, Any]) -> None:
        msg, kwargs = self.process(msg, kwargs)
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2  # (log, _emit)
        self.logger.log(level, msg, *args, **kwargs)

    # The level methods of LoggerAdapter call self.log; each adds its own frame to skip.
    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **_deeper(kwargs))

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **_deeper(kwargs))

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **_deeper(kwargs))

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **_deeper(kwargs))

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, **_deeper(kwargs))

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **_deeper(kwargs))

    @functools.lru_cache(None)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, emitted once for the same arguments (a warning inside a loop)."""
        self.warning(*args, **_deeper(dict(kwargs)))


def _deeper(kwargs: dict) -> dict:
    kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
    return kwargs


def _process_index() -> int:
    from fabric_lite.state import process_facts

    return process_facts()["process_index"]


def get_logger(name: str, log_level: Optional[Union[str, int]] = None) -> MultiProcessAdapter:
    """The logger `name` (e.g. ``__name__``), whose calls log on the main process only unless given
    ``main_process_only=False``; `log_level` (e.g. "INFO") sets the level of this logger and of the root
    logger (whose handlers print the records)."""
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level.upper() if isinstance(log_level, str) else log_level
        logger.setLevel(level)
        logger.root.setLevel(level)
    return MultiProcessAdapter(logger, {})
