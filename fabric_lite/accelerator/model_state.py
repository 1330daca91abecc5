"""Saving and loading of the raw door: weights, whole-run checkpoints, big-model set-up.

A mixin of `Accelerator`: it needs `self.strategy`, `self.device`, `self.is_main_process` (from
`ProcessFacts`) and the checkpoint lists (`save_state_pre_hooks`, `load_state_pre_hooks`, `registered_objects`,
`per_process_objects`); the files are written and read by `checkpoint/state.py`.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, Iterator, List, Optional, Union, cast

import torch
from torch import nn

from fabric_lite.accelerator.process_control import ProcessFacts
from fabric_lite.accelerator.wrappers import HookHandle
from fabric_lite.checkpoint import names
from fabric_lite.checkpoint import state as state_io

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator
    from fabric_lite.checkpoint.saver import CheckpointSaver

__all__ = ["ModelState", "init_empty_weights", "init_on_device"]


@contextlib.contextmanager
def init_on_device(device: Union[str, torch.device], include_buffers: bool = False) -> Iterator[None]:
    """Build modules inside this context with their parameters on `device` (and their buffers too with
    `include_buffers`; then every tensor created inside lands there). On the meta device nothing is allocated
    to stay: parameters are made where torch makes them, then moved (a meta tensor holds no memory); with
    `include_buffers`, a parameter registered with values made outside (a real tensor) keeps them.

    Examples:
        >>> with init_on_device("meta"):
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.device.type
        'meta'
    """
    device = torch.device(device)
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter_on_device(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register_parameter(module, name, param)
        if param is None or param.device == device:
            return
        if include_buffers and device.type == "meta":
            # inside torch.device("meta") every new tensor is already there: a real one registered here holds values
            # made before (e.g. tensor parallelism distributing weights built earlier); moving it would wipe them
            return
        module._parameters[name] = _moved_parameter(param, device)

    def buffer_on_device(module: nn.Module, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        if tensor is not None:
            tensor = tensor.to(device)
        register_buffer(module, name, tensor, persistent=persistent)

    setattr(nn.Module, "register_parameter", parameter_on_device)  # patched for this context only
    if include_buffers:
        setattr(nn.Module, "register_buffer", buffer_on_device)
    try:
        with torch.device(device) if include_buffers else contextlib.nullcontext():
            yield
    finally:
        setattr(nn.Module, "register_parameter", register_parameter)
        setattr(nn.Module, "register_buffer", register_buffer)


def init_empty_weights(include_buffers: bool = False) -> ContextManager[None]:
    """Build a model without allocating its weights: parameters are created on the meta device (buffers too
    with `include_buffers`; by default they stay real, as small state that is not loaded). Load weights into
    it afterwards, e.g. `model.to_empty(device=...)` then `load_state_dict`, or build it under
    `Accelerator.init_module()` to let FSDP materialize each process's shards.

    Examples:
        >>> with init_empty_weights():
        ...     model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        >>> model[0].weight.is_meta, model[1].running_mean.is_meta
        (True, False)
    """
    return init_on_device(torch.device("meta"), include_buffers=include_buffers)


def _moved_parameter(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """`param` on `device`, of the same Parameter class, with its attributes."""
    data = param.data.to(device)
    cls = type(param)
    try:
        moved = cls(data, requires_grad=param.requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        moved = nn.Parameter(data, requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    return moved


class ModelState(ProcessFacts):
    """Accelerate's save/load names (`save_model`, `save_state`, `load_state`, ...) plus `init_module` and
    `load_model_weights` for models too big for one process."""

    # set by the Accelerator that mixes this in
    save_state_pre_hooks: Dict[int, Callable]
    load_state_pre_hooks: Dict[int, Callable]
    registered_objects: List[Any]
    per_process_objects: List[Any]
    checkpoint_saver: "CheckpointSaver"

    # -- checkpoint hooks ---------------------------------------------------------------------------
    def register_save_state_pre_hook(self, hook: Callable) -> Any:
        """`hook(models, weights, output_dir)` runs before `save_state` writes; weights may be edited."""
        return HookHandle(self.save_state_pre_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable) -> Any:
        """`hook(models, input_dir)` runs before `load_state` reads."""
        return HookHandle(self.load_state_pre_hooks, hook)

    # -- weights -----------------------------------------------------------------------------------
    def save(self, obj: Any, f: Union[str, os.PathLike], safe_serialization: bool = False) -> None:
        """Save `obj` from the main process only, atomically (any fsspec URL). No collective inside,
        so ``if accelerator.is_main_process: accelerator.save(...)`` is fine."""
        if self.is_main_process:
            state_io.save_object(self.strategy.checkpoint_format.to_host(obj), os.fspath(f), safe_serialization)

    def save_model(
        self, model: nn.Module, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str] = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model's weights (safetensors by default), sharded above `max_shard_size`.

        The main process writes; no collective is involved for unsharded strategies.
        """
        state = self.get_state_dict(model)
        if self.is_main_process:
            state_io.save_model_weights(state, os.fspath(save_directory), max_shard_size, safe_serialization)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> Dict[str, torch.Tensor]:
        return names.canonical_state(self.strategy.checkpoint_format.module_state_dict(model))

    @contextlib.contextmanager
    def init_module(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Build a model inside this context: on the meta device (no memory; `prepare` materializes each
        process's shards and runs every submodule's `reset_parameters`) when `empty_init` is True, or by
        default under a strategy that shards parameters (FSDP); else on this process's device.

        Examples:
            >>> with accelerator.init_module():                     # doctest: +SKIP
            ...     model = GPT(config)        # on FSDP: nothing allocated until prepare()
        """
        meta = self.strategy.traits.initializes_on_meta if empty_init is None else bool(empty_init)
        if meta and not self.strategy.traits.initializes_on_meta:
            raise ValueError(f"init_module(empty_init=True) builds the model on the meta device, which "
                             f"{type(self.strategy).__name__} cannot materialize. Use strategy='fsdp', or "
                             f"empty_init=False.")
        with init_on_device(torch.device("meta") if meta else self.device, include_buffers=True):
            yield

    def load_model_weights(self, model: nn.Module, source: Any, strict: bool = True) -> None:
        """Load full weights (a state dict, a .safetensors/.pt/.bin file, or a `save_model` directory) into a
        prepared model. Under FSDP only the main process reads them, and each tensor is scattered to the shards."""
        one_reader = self.strategy.checkpoint_format.weights_on_rank_zero
        state: Dict[str, Any] = {}
        error = None
        if isinstance(source, dict):
            state = source
        elif self.is_main_process or not one_reader:
            try:
                state = state_io.read_weights(os.fspath(source))
            except Exception as err:  # the other processes must hear of it, not wait for a scatter
                error = f"{type(err).__name__}: {err}"
        if one_reader and not isinstance(source, dict):
            error = self.strategy.collectives.broadcast_object(error)
        if error is not None:
            raise ValueError(f"load_model_weights could not read {source}: {error}")
        state = names.for_module(state, self.strategy.unwrap_module(model).state_dict())
        self.strategy.checkpoint_format.load_module_state_dict(model, state, strict=strict)

    # -- whole-run checkpoints ---------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any, per_process: bool = False) -> None:
        """Objects with `state_dict`/`load_state_dict` that `save_state`/`load_state` should include.

        By default the main process's state is saved and every process loads it. `per_process=True`
        saves each process's own state (running totals, per-rank accumulators) and gives it back to
        the same rank.
        """
        bad = [o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ValueError(f"register_for_checkpointing needs state_dict/load_state_dict; these lack them: {bad}.")
        (self.per_process_objects if per_process else self.registered_objects).extend(objects)

    def save_state(self, output_dir: Optional[Union[str, os.PathLike]] = None, blocking: bool = True,
                   if_busy: str = "wait", durable: bool = False, **kwargs: Any) -> Optional[str]:
        """Save everything needed to continue exactly; returns the checkpoint's location.

        `blocking=False` returns as soon as the state is copied (to host memory); writing, checksums and
        publishing go on in the background, one save at a time. A save asked for while one is still in flight
        waits for it (`if_busy="wait"`) or is skipped (`"skip"`: returns None, on every process). A failed
        background save is raised by the next `save_state`, `wait_for_checkpoint`, `check_preemption` or
        `end_training`. `durable=True` fsyncs files and directories before publishing (local disks).

        Examples:
            >>> accelerator.save_state("ckpt/step_100", blocking=False)   # doctest: +SKIP
        """
        return state_io.save_state(cast("Accelerator", self), output_dir, blocking=blocking, if_busy=if_busy, durable=durable)

    def wait_for_checkpoint(self) -> None:
        """Wait until the background save in flight (if any) is published; raise its error if it failed."""
        self.checkpoint_saver.wait()

    def load_state(self, input_dir: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> str:
        """Restore what `save_state` wrote: weights, optimizers, schedulers, scaler, RNGs, loader positions."""
        self.checkpoint_saver.wait()  # a checkpoint still being written is not yet there to be found
        return state_io.load_state(cast("Accelerator", self), input_dir, **kwargs)
