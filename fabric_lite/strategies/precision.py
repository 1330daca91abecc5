"""Numeric precision plugins: full fp32, fp16 / bf16 autocast, pure bf16 weights, and fp8 (float8 linear layers
under bf16 autocast; the conversion is in strategies/fp8.py).

A plugin owns everything precision-specific in a step: the autocast context around the forward,
the loss scaling in backward, unscaling before clipping, and skipping an optimizer step whose
gradients overflowed. Strategies call it; the front doors never branch on the precision.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, ContextManager, Dict, Optional, Union

import torch

from fabric_lite._tree import tree_map

__all__ = ["Precision", "PrecisionForward", "resolve_precision", "PRECISION_ALIASES"]

# Canonical name <- every spelling accepted (Lightning's and Accelerate's).
PRECISION_ALIASES: Dict[str, str] = {
    "32-true": "32-true", "32": "32-true", "no": "32-true", "fp32": "32-true",
    "16-mixed": "16-mixed", "16": "16-mixed", "fp16": "16-mixed",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
    "bf16-true": "bf16-true",
    "fp8": "fp8",  # Accelerate's name; Lightning has none
}


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, data)


class Precision:
    """One precision setting, bound to a device type ("cpu", "cuda", "mps").

    `autocast_kwargs` (enabled, cache_enabled: Accelerate's `AutocastKwargs`) go to every `torch.autocast` it
    opens. "fp8" trains with `fp8_recipe` (an `FP8Recipe`; None: torchao where installed) and is refused, naming
    the reason and the fix, where the library or the GPU (`device`, else the current one) cannot run it.
    """

    def __init__(self, name: str = "32-true", device_type: str = "cpu", scaler_kwargs: Optional[dict] = None,
                 autocast_kwargs: Optional[Dict[str, Any]] = None, fp8_recipe: Any = None,
                 device: Optional[torch.device] = None):
        self.name = resolve_precision(name)
        self.device_type = device_type
        self.autocast_dtype: Optional[torch.dtype] = {
            "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp8": torch.bfloat16,
        }.get(self.name)
        self.autocast_kwargs: Dict[str, Any] = dict(autocast_kwargs or {})
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.fp8_recipe: Any = None
        if self.name == "fp8":
            from fabric_lite.strategies.fp8 import check_fp8, default_fp8_recipe

            self.fp8_recipe = fp8_recipe if fp8_recipe is not None else default_fp8_recipe()
            check_fp8(device_type, self.fp8_recipe, device)
        elif fp8_recipe is not None:
            raise ValueError(f"An fp8 recipe ({fp8_recipe!r}) was given, but precision={name!r}: pass "
                             f"mixed_precision='fp8' to train in fp8, or drop the recipe.")
        if self.name == "16-mixed":
            # (a device runtime refuses its own unsupported precisions first: Runtime.check_precision)
            if device_type not in ("cpu", "cuda"):
                raise ValueError(
                    f"precision='16-mixed' needs loss scaling, which torch supports on 'cpu' and 'cuda', "
                    f"not on {device_type!r}. Use precision='bf16-mixed' there."
                )
            self.scaler = torch.amp.GradScaler(device_type, **(scaler_kwargs or {}))
        if self.name in ("bf16-mixed", "bf16-true") and device_type == "cuda":
            if not torch.cuda.is_bf16_supported():
                raise ValueError(
                    f"precision={name!r} needs a GPU with bfloat16 support (Ampere or newer); this one has "
                    f"none. Use precision='16-mixed'."
                )

    @property
    def accelerate_name(self) -> str:
        """The same setting in Accelerate's vocabulary: 'no', 'fp16' or 'bf16'."""
        return {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp8": "fp8"}[self.name]

    @property
    def is_mixed(self) -> bool:
        return self.autocast_dtype is not None

    def autocast(self, autocast_kwargs: Optional[Dict[str, Any]] = None) -> ContextManager:
        """The context the forward pass runs in (autocast for mixed precision, else a no-op).

        `autocast_kwargs` replace this precision's own for this block (`enabled=False` turns autocast off in it);
        without mixed precision there is no autocast to change, and the block runs as it is."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        kwargs = self.autocast_kwargs if autocast_kwargs is None else autocast_kwargs
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype, **kwargs)

    def convert_module(self, module: torch.torch.nn.Module) -> torch.torch.nn.Module:
        if self.name == "bf16-true":
            return module.to(torch.bfloat16)
        if self.name == "fp8":
            from fabric_lite.strategies.fp8 import convert_model_to_fp8

            return convert_model_to_fp8(module, self.fp8_recipe)
        return module

    def convert_input(self, data: Any) -> Any:
        """Cast floating inputs to the weights' dtype where weights are not fp32."""
        if self.name == "bf16-true":
            return _cast_floating(data, torch.bfloat16)
        return data

    @property
    def converts_input(self) -> bool:
        """Whether floating inputs must be cast to the weights' dtype before the forward."""
        return self.name == "bf16-true"

    @property
    def wraps_forward(self) -> bool:
        """Whether a prepared model's forward needs wrapping (autocast, input casting)."""
        return self.autocast_dtype is not None or self.converts_input

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping); idempotent within a step."""
        if self.scaler is None:
            return
        state = self.scaler._per_optimizer_states[id(optimizer)]  # read-only peek to avoid a double unscale
        if state["stage"].name != "UNSCALED":
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Union[bool, torch.Tensor]:
        """Step the optimizer; the result is falsy when the step was skipped for inf/NaN gradients.

        Under fp16 the result is a 0-dim bool tensor on the device, so nothing waits for the GPU
        unless someone asks whether the step happened.
        """
        if self.scaler is None:
            optimizer.step(**kwargs)
            return True
        self.scaler.step(optimizer, **kwargs)
        found_inf = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # reset by update()
        stepped = sum(found_inf.values()) == 0 if found_inf else True
        self.scaler.update()
        return stepped

    def state_dict(self) -> Dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def resolve_precision(name: Any) -> str:
    """Map any accepted spelling to its canonical name, or raise naming the allowed values."""
    key = str(name).lower() if name is not None else "32-true"
    if key not in PRECISION_ALIASES:
        allowed = ", ".join(repr(k) for k in PRECISION_ALIASES)
        raise ValueError(
            f"Unknown precision {name!r}. Allowed values: {allowed}. "
            f"For mixed precision on a GPU use 'bf16-mixed' (or 'fp16'; 'fp8' on H100-class GPUs); on CPU use "
            f"'bf16-mixed'."
        )
    return PRECISION_ALIASES[key]


class PrecisionForward:
    """The function behind a prepared model's `forward`: inputs converted, autocast on, fp32 outputs.

    It is bound to the module with MethodType (not a closure over the module), so `copy.deepcopy`
    of a prepared model gives a copy that runs its own weights.
    """

    def __init__(self, func: Callable, precision: Any, previous: Any) -> None:
        self.func = func
        self.precision = precision
        self.previous = previous  # an instance-level forward the user had set, restored by remove()
        functools.update_wrapper(self, func)

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        precision = self.precision
        if precision.converts_input:
            args, kwargs = precision.convert_input(args), precision.convert_input(kwargs)
        with precision.autocast():
            out = self.func(module, *args, **kwargs)
        return tree_map(lambda t: t.float() if t.is_floating_point() else t, out)

    @classmethod
    def install(cls, module: torch.nn.Module, precision: Any) -> None:
        previous = module.__dict__.get("forward")
        current = module.forward
        func = getattr(current, "__func__", None)
        if func is None or getattr(current, "__self__", None) is not module:
            func = lambda _module, *a, **k: current(*a, **k)  # noqa: E731 (a plain callable set by the user)
        module.forward = types.MethodType(cls(func, precision, previous), module)

    @staticmethod
    def remove(module: torch.nn.Module) -> None:
        bound = module.__dict__.get("forward")
        wrapper = getattr(bound, "__func__", None)
        if isinstance(wrapper, PrecisionForward):
            del module.forward
            if wrapper.previous is not None:
                module.forward = wrapper.previous
