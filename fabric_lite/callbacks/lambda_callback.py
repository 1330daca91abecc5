"""`LambdaCallback(on_train_start=fn, ...)`: a callback made of functions, for a hook or two without a class."""

from __future__ import annotations

from typing import Any, Callable

from fabric_lite.callbacks.base import Callback

__all__ = ["LambdaCallback"]


def _hook_names() -> list:
    return sorted(n for n in vars(Callback) if (n.startswith("on_") and n != "on_log" and n != "on_hyperparameters")
                  or n in ("setup", "teardown"))


class LambdaCallback(Callback):
    """Each keyword names a Callback hook and gives the function to run there, called as the hook is
    (``fn(trainer, module, ...)``). Examples: ``LambdaCallback(on_train_epoch_end=lambda t, m: print(t.current_epoch))``.
    """

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        allowed = _hook_names()
        for name, fn in hooks.items():
            if name not in allowed:
                raise TypeError(f"LambdaCallback got {name}={fn!r}, which is not a Callback hook. Hooks: "
                                f"{', '.join(allowed)}.")
            if not callable(fn):
                raise TypeError(f"LambdaCallback({name}=...) needs a function called as the hook is "
                                f"(fn(trainer, module, ...)); got a {type(fn).__name__}.")
            setattr(self, name, fn)  # (held by the instance: the loops find it as an overridden hook)
