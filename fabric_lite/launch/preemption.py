"""Preemption: SIGTERM / SIGUSR1 set a flag, and every process agrees on the step at which to stop.

A signal reaches one process (or all, at slightly different steps). Stopping where each one
happens to notice would leave ranks waiting for each other in a collective, so processes compare
flags in one small all-reduce, taken every N steps by all of them. N adapts: the main process
proposes, inside that same all-reduce, the number of steps that take about `check_seconds`, so the
check costs one collective a second whatever the step time.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["EXIT_PREEMPTED", "PreemptionWatch"]

#: Exit status of a run that stopped because it was asked to (EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75

_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionWatch:
    """Catches SIGTERM and SIGUSR1 while installed; `should_stop(strategy)` says when every process stops."""

    def __init__(self, check_seconds: float = 1.0) -> None:
        self.check_seconds = check_seconds
        self.received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._countdown = 1
        self._interval = 1
        self._last_check: Optional[float] = None
        #: Set by `should_stop`: some process reported a failed background checkpoint save.
        self.save_failed_anywhere = False

    # -- signal handlers -----------------------------------------------------------------------------
    def install(self) -> bool:
        """Catch the signals (main thread only: Python allows handlers nowhere else). True if installed."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return bool(self._previous)
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @staticmethod
    def ignore_signals() -> None:
        """Ignore SIGTERM/SIGUSR1 from now on (a process on its way out after a preemption save)."""
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum  # only a flag: the training loop acts on it at a step boundary
        previous: Optional[Callable[..., Any]] = self._previous.get(signum)
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signum, frame)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    # -- agreement -------------------------------------------------------------------------------------
    def should_stop(self, strategy: Any, save_failed: bool = False) -> bool:
        """Call once per step on every process. True on all processes at the same step once any got a signal.

        `save_failed`: whether this process holds a failed background checkpoint save; the same all-reduce
        carries it, and `save_failed_anywhere` is then True on every process at the same step."""
        if strategy.world_size == 1:
            self.save_failed_anywhere = save_failed
            return self.received is not None
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now = time.monotonic()
        proposal = 0.0
        if strategy.is_global_zero and self._last_check is not None and now > self._last_check:
            steps_per_second = self._interval / (now - self._last_check)
            proposal = float(min(10_000, max(1, int(steps_per_second * self.check_seconds))))
        flags = torch.tensor([1.0 if self.received is not None else 0.0, proposal, 1.0 if save_failed else 0.0],
                             device=strategy.root_device)
        stop, interval, failed = strategy.all_reduce(flags, "max").tolist()
        self._interval = max(1, int(interval))
        self._countdown = self._interval
        self._last_check = now
        self.save_failed_anywhere = failed > 0
        return stop > 0
