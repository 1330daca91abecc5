"""The doors' events, which the features that watch a run subscribe to (explain, the profiler, preemption, Ray).

Each door (`Accelerator`, `Trainer`) holds an `EventBus` in `door.events`, given to it before its `__init__` runs
by `announces_construction`, which also hands the new door and the arguments its caller gave to every function
registered with `on_construction`: those subscribe the observers a feature needs (see
`fabric_lite/integrations.py`). The doors never import a feature. Each event is a plain list: the training loop
binds those of each step and epoch end once per epoch and loops over them, so an event nobody observes costs no call
per step; fit(), validate(), ... and prepare() call `emit` once per event.

Events, each with what its observers are called with:

================  =================================================================================================
`configured`      ``(door, run_config)`` once the door resolved its `RunConfig` (the launch environment read once),
                  before it builds its strategy: an observer that depends on the launch (explain, Ray) reads it
                  there and subscribes what it needs.
`prepared`        Accelerator: ``(accelerator, objects)`` once `prepare(*objects)` prepared them. Trainer:
                  ``(trainer, run)`` once fit() set up model, optimizers and loaders; an observer may set
                  ``run.train = False`` (fit then returns without training: the plan of `explain` was printed).
`stage_start`     ``(trainer, stage)``: fit/validate/test/predict begins, before the callbacks' `setup`.
`fit_start`       ``(trainer, run)``: the callbacks are set up, the checkpoint to resume from is not read yet; an
                  observer may set ``run.ckpt_path`` (the checkpoint Ray hands the run).
`train_start`     ``(trainer)``: the training loop starts (the checkpoint is restored).
`step`            ``(trainer, batch_idx)`` after each training batch (its hooks ran, metrics are written).
`epoch_end`       Objects with ``flag(trainer) -> bool`` and ``act(trainer)``: at the end of each training epoch
                  the processes agree on every flag in the one collective that agrees on `should_stop`; an
                  observer whose flag is up on any process has `act` called on every process.
`fit_end`         ``(trainer)``: the training loop ended or failed (before the callbacks' `teardown`).
`stage_end`       ``(trainer, stage)``: the stage ended or failed, after the callbacks' `teardown`.
================  =================================================================================================

An `instrument` (the Trainer's profiler) may also sit on the bus: an object with ``wrap(action, fn)``,
``iterate(action, iterable)`` and ``timed(owner, kind, base)``; the Trainer's loops then call what it returns in
place of their steps, hooks and loaders, looked up once per epoch. None: they call them as they are.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

__all__ = ["EVENTS", "EventBus", "FitRun", "WIRING_MODULES", "announces_construction", "on_construction"]

#: The events a door emits, in the order it emits them (construction, then a fit()).
EVENTS = ("configured", "prepared", "stage_start", "fit_start", "train_start", "step", "epoch_end", "fit_end",
          "stage_end")


class EventBus:
    """A door's observers, one list per event of `EVENTS` (an attribute of that name), and its instrument."""

    __slots__ = EVENTS + ("instrument",)

    def __init__(self) -> None:
        # (one list per event of EVENTS, written out: a bus is made per door, and loops read these lists)
        self.configured: List[Any] = []
        self.prepared: List[Any] = []
        self.stage_start: List[Any] = []
        self.fit_start: List[Any] = []
        self.train_start: List[Any] = []
        self.step: List[Any] = []
        self.epoch_end: List[Any] = []
        self.fit_end: List[Any] = []
        self.stage_end: List[Any] = []
        #: The object that times the Trainer's calls (its profiler), or None.
        self.instrument: Optional[Any] = None

    def subscribe(self, event: str, observer: Any) -> None:
        """Add `observer` to `event`'s list (called after those subscribed before it)."""
        self.observers(event).append(observer)

    def unsubscribe(self, event: str, observer: Any) -> None:
        self.observers(event).remove(observer)

    def observers(self, event: str) -> List[Any]:
        """The list of `event`'s observers (the list itself)."""
        if event not in EVENTS:
            raise ValueError(f"Unknown event {event!r}; the doors emit {', '.join(EVENTS)}.")
        return getattr(self, event)

    def emit(self, event: str, *args: Any) -> None:
        """Call each observer of `event` with `args`."""
        for observer in getattr(self, event):
            observer(*args)


class FitRun:
    """What a `prepared` or `fit_start` observer of the Trainer may change about the fit() under way."""

    def __init__(self, module: Any, ckpt_path: Optional[str]) -> None:
        self.module = module
        #: The checkpoint fit() resumes from (None: a fresh start, "last": the newest one).
        self.ckpt_path = ckpt_path
        #: False once an observer has handled the fit itself: fit() returns without training.
        self.train = True


#: Per door class name ("Accelerator", "Trainer"): the functions `on_construction` registered.
_WIRING: Dict[str, List[Callable[[Any, Dict[str, Any]], None]]] = {}
#: The modules that register wiring with `on_construction` (fabric_lite's own features: integrations.py), imported
#: when the first door is built, so that `import fabric_lite` imports nothing else; a plugin may add its module.
WIRING_MODULES: List[str] = ["fabric_lite.integrations"]
_loaded: List[str] = []


def _load_wiring() -> None:
    import importlib

    for name in WIRING_MODULES:
        if name not in _loaded:
            importlib.import_module(name)
            _loaded.append(name)


def on_construction(door: str, wire: Callable[[Any, Dict[str, Any]], None]) -> None:
    """Call `wire(door, arguments)` for each door of class `door` built from now on, before its `__init__` runs:
    `door.events` exists, `arguments` are those its caller gave, as given (defaults left out). The modules of
    `WIRING_MODULES` are imported (and so register theirs) when the first door is built."""
    _WIRING.setdefault(door, []).append(wire)


def announces_construction(init: Callable[..., None]) -> Callable[..., None]:
    """For a door's `__init__`: give the door its `EventBus` and hand it to the functions `on_construction`
    registered for its class (with the arguments given), then run `__init__`."""
    import inspect

    params = list(inspect.signature(init).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    rest = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)  # (`**unknown`: its own entry)
    door = init.__qualname__.rsplit(".", 2)[-2]  # (the class the decorated __init__ belongs to, subclasses too)

    @functools.wraps(init)
    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        self.events = EventBus()
        if len(_loaded) != len(WIRING_MODULES):
            _load_wiring()
        wiring = _WIRING.get(door)
        if wiring:
            # (bound by hand, as inspect's Signature.bind would, at a tenth of its calls)
            if len(args) > len(positional):
                return init(self, *args, **kwargs)  # a mistake the door reports itself
            arguments = dict(zip(positional, args))
            extra = {}
            for name, value in kwargs.items():
                if name in arguments or (name not in named and rest is None):
                    return init(self, *args, **kwargs)
                if name in named:
                    arguments[name] = value
                else:
                    extra[name] = value
            if extra and rest is not None:
                arguments[rest] = extra
            for wire in wiring:
                wire(self, arguments)
        return init(self, *args, **kwargs)

    return construct
