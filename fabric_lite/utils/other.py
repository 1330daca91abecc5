"""Small Accelerate utilities: `tqdm` on the main process, `get_active_deepspeed_plugin`."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["tqdm", "get_active_deepspeed_plugin", "get_grad_scaler", "get_mixed_precision_context_manager"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm`, shown on the local main process only (`main_process_only=False`: on every process)."""
    from tqdm.auto import tqdm as progress_bar

    if args and isinstance(args[0], bool):  # the older signature: tqdm(main_process_only, iterable, ...)
        main_process_only, args = args[0], args[1:]
    if main_process_only and not kwargs.get("disable", False):
        from fabric_lite.state import process_facts

        kwargs["disable"] = process_facts()["local_process_index"] != 0
    return progress_bar(*args, **kwargs)


def get_active_deepspeed_plugin(state: Any) -> Any:
    """The DeepSpeedPlugin of `state` (an AcceleratorState); ValueError where the run does not use DeepSpeed."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("get_active_deepspeed_plugin: this run does not use DeepSpeed; pass a DeepSpeedPlugin to "
                         "Accelerator(deepspeed_plugin=...) or launch with --use_deepspeed.")
    return plugin


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A `torch.amp.GradScaler` for this machine's device (CUDA where there is one, else the CPU); `kwargs` go to
    its constructor (``init_scale=``, ``growth_interval=``, ...)."""
    return torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Optional[Any] = None) -> Any:
    """`torch.autocast` in the current run's mixed precision (fp16 / bf16) on its device, or a context that does
    nothing where `native_amp` is false or the run is in full precision. `autocast_kwargs` (an AutocastKwargs)
    adds its changed fields."""
    if not native_amp:
        return contextlib.nullcontext()
    from fabric_lite.state import AcceleratorState

    state = AcceleratorState()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(state.mixed_precision))
    if dtype is None:
        return contextlib.nullcontext()
    kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
    return torch.autocast(device_type=state.device.type, dtype=dtype, **kwargs)
