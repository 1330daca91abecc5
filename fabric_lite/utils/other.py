"""Small Accelerate utilities: `tqdm` on the main process, `get_active_deepspeed_plugin`."""

from __future__ import annotations

from typing import Any

__all__ = ["tqdm", "get_active_deepspeed_plugin"]


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
