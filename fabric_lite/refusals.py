"""Names of Accelerate that fabric_lite does not do: they import (a script that merely imports them runs), and
using one raises `NotSupportedError`, one sentence naming the feature and what to do instead.

    dispatch_model = refused("dispatch_model", "big-model inference (spreading a model over devices)",
                             "load the model whole, then accelerator.prepare(model)")
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["NotSupportedError", "refused", "refused_class", "message"]

# The path users import these from (fabric_lite.utils.refusals re-exports this module, which sits in the lowest
# layer so that every layer may refuse a name): tracebacks and reprs keep naming it.
PUBLIC_MODULE = "fabric_lite.utils.refusals"


class NotSupportedError(NotImplementedError):
    """An Accelerate feature fabric_lite does not have (a NotImplementedError, as scripts may expect)."""


NotSupportedError.__module__ = PUBLIC_MODULE


def message(name: str, feature: str, instead: str) -> str:
    return f"{name}: {feature} is not supported by fabric_lite; {instead}."


def refused(name: str, feature: str, instead: str) -> Callable[..., Any]:
    """A function that raises NotSupportedError, whatever it is given."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(message(name, feature, instead))

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not supported: {feature}. Instead: {instead}."
    refuse.refusal = (feature, instead)  # type: ignore[attr-defined]
    return refuse


def refused_class(name: str, feature: str, instead: str, base: type = object) -> type:
    """A class that can be named (``isinstance`` checks, type hints, subclassing) but not instantiated."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(message(name, feature, instead))

    return type(name, (base,), {"__init__": __init__, "__doc__": f"Not supported: {feature}. Instead: {instead}.",
                                "refusal": (feature, instead), "__module__": PUBLIC_MODULE})
