"""Preemption: SIGTERM / SIGUSR1 set a flag, and every process agrees on the step at which to stop.

A signal reaches one process (or all, at slightly different steps). Stopping where each one
happens to notice would leave ranks waiting for each other in a collective, so processes compare
flags in one small all-reduce, taken every N steps by all of them. N adapts: the main process
proposes, inside that same all-reduce, the number of steps that take about `check_seconds`, so the
check costs one collective a second whatever the step time.

`PreemptionWatch` is what `Accelerator.check_preemption` runs; `TrainerPreemption` observes the Trainer's events
(`fabric_lite.events`) and, once every process agrees, saves a `preempted` checkpoint and exits `EXIT_PREEMPTED`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import torch

if TYPE_CHECKING:
    from fabric_lite.events import EventBus
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["EXIT_PREEMPTED", "PreemptionWatch", "TrainerPreemption"]

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
    def should_stop(self, strategy: Any, save_failed: bool = False, world_size: Optional[int] = None) -> bool:
        """Call once per step on every process. True on all processes at the same step once any got a signal.

        `save_failed`: whether this process holds a failed background checkpoint save; the same all-reduce
        carries it, and `save_failed_anywhere` is then True on every process at the same step. `world_size`:
        the strategy's, where the caller holds it already."""
        if (strategy.world_size if world_size is None else world_size) == 1:
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
        stop, interval, failed = strategy.collectives.all_reduce(flags, "max").tolist()
        self._interval = max(1, int(interval))
        self._countdown = self._interval
        self._last_check = now
        self.save_failed_anywhere = failed > 0
        return stop > 0


class TrainerPreemption:
    """The Trainer's observer of SIGTERM / SIGUSR1: caught from the start of training to its end; checked at every
    step (`PreemptionWatch.should_stop`) and at each epoch end (in the collective that agrees on `should_stop`).
    Every process then saves ``{checkpoint_dir}/preempted`` at the same step and exits with `EXIT_PREEMPTED`.
    The watch of the latest fit is `trainer.preemption`."""

    def __init__(self, trainer: "Trainer") -> None:
        trainer.preemption = self.watch = PreemptionWatch()
        self.saver: Any = None
        self.strategy: Any = None
        self.world_size = 1

    def subscribe(self, events: "EventBus") -> None:
        events.train_start.append(self.start)
        events.step.append(self.step)
        events.epoch_end.append(self)
        events.fit_end.append(self.end)

    def start(self, trainer: "Trainer") -> None:
        trainer.preemption = self.watch = PreemptionWatch()
        self.watch.install()
        self.saver, self.strategy = trainer.accelerator.checkpoint_saver, trainer.strategy
        self.world_size = self.strategy.world_size

    def step(self, trainer: "Trainer", batch_idx: int) -> None:
        saver = self.saver
        if self.watch.should_stop(self.strategy, saver.failed, self.world_size):
            self.act(trainer)
        if self.watch.save_failed_anywhere:
            saver.raise_failure()  # every process at this same step

    def flag(self, trainer: "Trainer") -> bool:
        """At an epoch end: whether this process got a signal (every process learns whether any did)."""
        return self.watch.received is not None

    def act(self, trainer: "Trainer") -> None:
        """Every process got here at the same step: save one checkpoint together, then exit."""
        path = f"{trainer.checkpoint_dir().rstrip('/')}/preempted"
        earlier = None
        try:
            trainer.accelerator.wait_for_checkpoint()  # (every process waits: the outcome is the same everywhere)
        except Exception as err:  # the preemption checkpoint matters more: save it, then say what failed before
            earlier = err
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            reason = self.watch.signal_name or "a signal on another process"
            if earlier is not None:
                print(f"fabric_lite: an earlier background checkpoint save failed: {earlier}", file=sys.stderr,
                      flush=True)
            print(f"fabric_lite: {reason} received; saved {path} at step {trainer.global_step}. Exiting with status "
                  f"{EXIT_PREEMPTED}; fit(..., ckpt_path='last') resumes from there.", file=sys.stderr, flush=True)
        # From here on the job is leaving on purpose: a launcher's SIGTERM to the other ranks must not
        # turn their clean exit into a signal death.
        self.watch.uninstall()
        self.watch.ignore_signals()
        raise SystemExit(EXIT_PREEMPTED)

    def end(self, trainer: "Trainer") -> None:
        self.watch.uninstall()
