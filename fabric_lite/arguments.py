"""Checks for the front doors' constructor arguments (`Trainer`, `Accelerator`).

Each check returns the value it was given (numbers normalized to plain `int` / `float`) or raises at
construction, before anything happens, with a message that names the door, the argument, the value
given and what is allowed, e.g. ``Trainer(gradient_clip_val=-1.0): must be a number >= 0.``
A wrong type is a TypeError, a value out of range a ValueError. `bool` is never taken for a number.

Importing this module costs nothing measurable (standard library only); the checks of what the connector
takes (accelerator, devices, strategy, precision) import their lists of names when called.
"""

from __future__ import annotations

import builtins
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any, List, Literal, NoReturn, Optional, Sequence, Tuple, Type, Union, overload

__all__ = ["ArgumentCheck", "fail", "is_int", "is_number", "check_bool", "check_int", "check_number",
           "check_choice", "check_path", "check_instance", "check_instances", "check_accelerator", "check_devices",
           "check_strategy", "check_precision"]


def _repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ArgumentCheck:
    """The checks for one door: `ArgumentCheck("Trainer").int("max_epochs", value, minimum=-1)`.

    (`bool`, `int` and `number` return None only where `allow_none=True`; their annotations say so. The builtins
    are spelled `builtins.bool`/`builtins.int` in this class, where the method names hide them.)"""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def fail(self, name: str, value: Any, rule: str, error: Type[Exception] = ValueError) -> NoReturn:
        fail(self.owner, name, value, rule, error)

    @overload
    def bool(self, name: str, value: Any, allow_none: Literal[False] = ..., hint: str = ...) -> builtins.bool: ...
    @overload
    def bool(self, name: str, value: Any, allow_none: builtins.bool, hint: str = ...) -> Optional[builtins.bool]: ...

    def bool(self, name: str, value: Any, allow_none: builtins.bool = False, hint: str = "") -> Optional[builtins.bool]:
        return check_bool(self.owner, name, value, allow_none=allow_none, hint=hint)

    @overload
    def int(self, name: str, value: Any, minimum: Optional[builtins.int] = ..., allow_none: Literal[False] = ...,
            hint: str = ...) -> builtins.int: ...
    @overload
    def int(self, name: str, value: Any, minimum: Optional[builtins.int] = ..., *, allow_none: builtins.bool,
            hint: str = ...) -> Optional[builtins.int]: ...

    def int(self, name: str, value: Any, minimum: Optional[builtins.int] = None, allow_none: builtins.bool = False,
            hint: str = "") -> Optional[builtins.int]:
        return check_int(self.owner, name, value, minimum=minimum, allow_none=allow_none, hint=hint)

    @overload
    def number(self, name: str, value: Any, minimum: Optional[float] = ..., maximum: Optional[float] = ...,
               above: builtins.bool = ..., allow_none: Literal[False] = ..., hint: str = ...) -> float: ...
    @overload
    def number(self, name: str, value: Any, minimum: Optional[float] = ..., maximum: Optional[float] = ...,
               above: builtins.bool = ..., *, allow_none: builtins.bool, hint: str = ...) -> Optional[float]: ...

    def number(self, name: str, value: Any, minimum: Optional[float] = None, maximum: Optional[float] = None,
               above: builtins.bool = False, allow_none: builtins.bool = False, hint: str = "") -> Optional[float]:
        return check_number(self.owner, name, value, minimum=minimum, maximum=maximum, above=above,
                            allow_none=allow_none, hint=hint)

    def choice(self, name: str, value: Any, choices: Sequence[Any], allow_none: builtins.bool = False,
               ignore_case: builtins.bool = False, hint: str = "") -> Any:
        return check_choice(self.owner, name, value, choices, allow_none=allow_none, ignore_case=ignore_case,
                            hint=hint)

    def path(self, name: str, value: Any, allow_none: builtins.bool = True) -> Optional[Union[str, os.PathLike]]:
        return check_path(self.owner, name, value, allow_none=allow_none)

    def instance(self, name: str, value: Any, cls: Union[type, Tuple[type, ...]], allow_none: builtins.bool = True,
                 what: str = "") -> Any:
        return check_instance(self.owner, name, value, cls, allow_none=allow_none, what=what)

    def instances(self, name: str, value: Any, cls: Union[type, Tuple[type, ...]], what: str,
                  single: builtins.bool = False) -> List[Any]:
        return check_instances(self.owner, name, value, cls, what=what, single=single)

    def accelerator(self, name: str, value: Any) -> str:
        return check_accelerator(self.owner, name, value)

    def devices(self, name: str, value: Any) -> Union[builtins.int, str, None]:
        return check_devices(self.owner, name, value)

    def strategy(self, name: str, value: Any) -> Any:
        return check_strategy(self.owner, name, value)

    def precision(self, name: str, value: Any, allow_none: builtins.bool = False,
                  fp8_emulated: builtins.bool = False) -> Any:
        return check_precision(self.owner, name, value, allow_none=allow_none, fp8_emulated=fp8_emulated)


def fail(owner: str, name: str, value: Any, rule: str, error: Type[Exception] = ValueError) -> NoReturn:
    """Raise `error` saying `owner(name=value): rule`."""
    raise error(f"{owner}({name}={_repr(value)}): {rule}")


def _type_rule(rule: str, value: Any) -> str:
    return f"{rule.rstrip('.')}; got {type(value).__name__}."


def _with_hint(rule: str, hint: str) -> str:
    return f"{rule} ({hint})." if hint else f"{rule}."


def is_int(value: Any) -> bool:
    """An integer, and not a bool (numpy integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number, and not a bool (numpy scalars count)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_bool(owner: str, name: str, value: Any, allow_none: bool = False, hint: str = "") -> Optional[bool]:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        fail(owner, name, value, _type_rule(_with_hint("must be True or False" + (", or None" if allow_none else ""),
                                                       hint), value), TypeError)
    return value


def check_int(owner: str, name: str, value: Any, minimum: Optional[int] = None, allow_none: bool = False,
              hint: str = "") -> Optional[int]:
    """An integer (not a bool) >= `minimum`, or None where `allow_none`."""
    if value is None and allow_none:
        return None
    rule = _with_hint("must be an integer" + (f" >= {minimum}" if minimum is not None else "")
                      + (", or None" if allow_none else ""), hint)
    if not is_int(value):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    if minimum is not None and value < minimum:
        fail(owner, name, value, rule)
    return int(value)


def check_number(owner: str, name: str, value: Any, minimum: Optional[float] = None, maximum: Optional[float] = None,
                 above: bool = False, allow_none: bool = False, hint: str = "") -> Optional[float]:
    """A real number (not a bool, not NaN) >= `minimum` (> with `above`) and <= `maximum`, or None where
    `allow_none`. Ints stay ints; other numbers become floats."""
    if value is None and allow_none:
        return None
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if above else '>='} {minimum}")
    if maximum is not None:
        bounds.append(f"<= {maximum}")
    rule = _with_hint("must be a number" + (" " + " and ".join(bounds) if bounds else "")
                      + (", or None" if allow_none else ""), hint)
    if not is_number(value):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    if math.isnan(number) or (minimum is not None and (number <= minimum if above else number < minimum)) \
            or (maximum is not None and number > maximum):
        fail(owner, name, value, rule)
    return number


def check_choice(owner: str, name: str, value: Any, choices: Sequence[Any], allow_none: bool = False,
                 ignore_case: bool = False, hint: str = "") -> Any:
    """One of `choices` (strings compared without case where `ignore_case`), or None where `allow_none`."""
    if value is None and allow_none:
        return None
    allowed = ", ".join(_repr(c) for c in choices) + (", or None" if allow_none else "")
    rule = _with_hint(f"must be one of {allowed}", hint)
    if all(isinstance(c, str) for c in choices) and not isinstance(value, str):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    key = value.lower() if ignore_case and isinstance(value, str) else value
    keys = [c.lower() if ignore_case and isinstance(c, str) else c for c in choices]
    if key not in keys:
        fail(owner, name, value, rule)
    return value


def check_path(owner: str, name: str, value: Any, allow_none: bool = True) -> Optional[Union[str, os.PathLike]]:
    """A non-empty str or os.PathLike, or None where `allow_none`."""
    if value is None and allow_none:
        return None
    rule = "must be a directory path (str or os.PathLike)" + (", or None" if allow_none else "")
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    if os.fspath(value) == "":
        fail(owner, name, value, f"{rule}; an empty path is not one.")
    return value


def _names(cls: Union[type, Tuple[type, ...]]) -> str:
    classes = cls if isinstance(cls, tuple) else (cls,)
    return " or ".join(c.__name__ for c in classes)


def check_instance(owner: str, name: str, value: Any, cls: Union[type, Tuple[type, ...]], allow_none: bool = True,
                   what: str = "") -> Any:
    """An instance of `cls` (described as `what`), or None where `allow_none`."""
    if value is None and allow_none:
        return None
    if not isinstance(value, cls):
        rule = f"must be {what or 'a ' + _names(cls)}" + (", or None" if allow_none else "")
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    return value


def check_instances(owner: str, name: str, value: Any, cls: Union[type, Tuple[type, ...]], what: str,
                    single: bool = False) -> List[Any]:
    """None (an empty list) or a list/tuple (any iterable but a str or a mapping) of `cls` instances; a lone
    instance too where `single`. Returns a new list; an item of another type is named by its position."""
    if value is None:
        return []
    if single and isinstance(value, cls):
        return [value]
    rule = f"must be a list of {what}" + (" (or a single one)" if single else "") + ", or None"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    items = list(value)
    shown = value if isinstance(value, (list, tuple)) else items
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            fail(owner, name, shown,
                 f"{rule}; item {i} ({_repr(item, 60)}) has type {type(item).__name__}, not {_names(cls)}.", TypeError)
    return items


# -- what both doors hand to the connector (strategies/connector.py): the names are checked here, before
# anything starts; what depends on the machine (is CUDA there, enough devices, the launch) stays there.

def check_accelerator(owner: str, name: str, value: Any) -> str:
    """An accelerator name, any case; returned in lower case."""
    from fabric_lite.strategies.connector import ACCELERATORS

    return check_choice(owner, name, value, ACCELERATORS, ignore_case=True).lower()


def check_devices(owner: str, name: str, value: Any) -> Union[int, str, None]:
    """A positive integer, "auto" or None (both: what the launch says, else one device)."""
    if value is None or value == "auto":
        return value
    rule = "must be a positive integer (the number of devices of this node), 'auto' or None"
    if not is_int(value) and not isinstance(value, str):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    if not is_int(value) or value < 1:
        fail(owner, name, value, rule + ".")
    return int(value)


def check_strategy(owner: str, name: str, value: Any) -> Any:
    """A registered strategy name, any case (returned in lower case), or a Strategy instance."""
    from fabric_lite.strategies.base import Strategy
    from fabric_lite.strategies.registry import available_strategies

    if isinstance(value, Strategy):
        return value
    allowed = available_strategies()
    rule = (f"must be a strategy name ({', '.join(map(repr, allowed))}) or a Strategy instance such as "
            f"DDPStrategy(find_unused_parameters=True)")
    if not isinstance(value, str):
        fail(owner, name, value, _type_rule(rule, value), TypeError)
    if value.lower() not in allowed:
        fail(owner, name, value, f"unknown strategy; {rule}.")
    return value.lower()


def check_precision(owner: str, name: str, value: Any, allow_none: bool = False, fp8_emulated: bool = False) -> Any:
    """A precision any door accepts ("bf16-mixed", "fp16", "no", "fp8", 32, 16, ...: PRECISION_ALIASES, any case).

    "fp8" is refused here, naming the machine, where no GPU of it can compute in fp8 (unless `fp8_emulated`:
    torchao's emulation, for tests); the run's own device and the fp8 library are checked by the connector."""
    from fabric_lite.strategies.precision import PRECISION_ALIASES

    if value is None and allow_none:
        return None
    rule = f"Allowed values: {', '.join(map(repr, PRECISION_ALIASES))} (any case), or the integers 16 and 32" + \
        (", or None" if allow_none else "")
    if not isinstance(value, str) and not is_int(value):
        fail(owner, name, value, _type_rule(f"must be a precision name or 16/32. {rule}", value), TypeError)
    if str(value).lower() not in PRECISION_ALIASES:
        fail(owner, name, value, f"unknown precision. {rule}. For mixed precision on a GPU use 'bf16-mixed' (or "
                                 f"'16-mixed'); on CPU 'bf16-mixed'.")
    if PRECISION_ALIASES[str(value).lower()] == "fp8" and not fp8_emulated:
        from fabric_lite.strategies.fp8 import machine_problem

        problem = machine_problem()
        if problem is not None:
            fail(owner, name, value, problem)
    return value
