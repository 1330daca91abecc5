"""Accelerate's model helpers that need no big-model machinery: unwrapping a prepared model, `save` / `load`,
loading weights into a model, and the size accounting (`compute_module_sizes`, `calculate_maximum_sizes`)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from fabric_lite.strategies import registry as _strategies  # noqa: F401 (registers the strategies' checkpoint engines)

__all__ = ["extract_model_from_parallel", "save", "load", "load_state_dict", "load_checkpoint_in_model",
           "compute_module_sizes", "get_max_layer_size", "calculate_maximum_sizes", "get_module_children_bottom_up",
           "dtype_byte_size"]


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> nn.Module:
    """The user's model inside DDP (and, with ``keep_torch_compile=False``, torch.compile) wrappers: what
    `Accelerator.unwrap_model` gives for the latest Accelerator's models."""
    from fabric_lite.state import current_accelerator

    accelerator = current_accelerator()
    if accelerator is not None:
        return accelerator.unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                        keep_torch_compile=keep_torch_compile)
    while True:  # no run: peel the wrappers of torch's own classes
        inner = None if keep_torch_compile else getattr(model, "_orig_mod", None)
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


def save(obj: Any, f: Union[str, os.PathLike], save_on_each_node: bool = False,
         safe_serialization: bool = False) -> None:
    """`torch.save` (or safetensors with `safe_serialization`) on the main process only; with `save_on_each_node`,
    on the main process of each machine."""
    from fabric_lite.state import process_facts

    facts = process_facts()
    if facts["local_process_index" if save_on_each_node else "process_index"] != 0:
        return
    from fabric_lite.checkpoint.state import save_object

    save_object(obj, os.fspath(f), safe_serialization=safe_serialization)


def load(f: Union[str, os.PathLike, Any], map_location: Any = None, **kwargs: Any) -> Any:
    """`torch.load`, safe by default (``weights_only=True``, as torch's own default); pass ``weights_only=False``
    only for a file you trust."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def load_state_dict(checkpoint_file: Union[str, os.PathLike], device_map: Optional[Dict[str, Any]] = None
                    ) -> Dict[str, torch.Tensor]:
    """The weights in one file (``.safetensors``, or a torch file loaded with ``weights_only=True``), on the CPU."""
    if device_map is not None:
        from fabric_lite.big_modeling import load_checkpoint_and_dispatch

        load_checkpoint_and_dispatch()  # refuses: a device_map is big-model inference
    from fabric_lite.checkpoint.state import read_weights

    return read_weights(os.fspath(checkpoint_file))


def load_checkpoint_in_model(model: nn.Module, checkpoint: Union[str, os.PathLike],
                             device_map: Optional[Dict[str, Any]] = None, offload_folder: Any = None,
                             dtype: Union[str, torch.dtype, None] = None, offload_state_dict: bool = False,
                             offload_buffers: bool = False, keep_in_fp32_modules: Optional[List[str]] = None,
                             offload_8bit_bnb: bool = False, strict: bool = False, **kwargs: Any) -> None:
    """Load weights into `model` in place: a file, a `save_model` directory (one file or shards with an index), or
    a fabric_lite checkpoint (its model 0). `dtype` casts floating-point weights (except in
    `keep_in_fp32_modules`). A `device_map` or offloading is big-model inference, which is refused."""
    if device_map is not None or offload_folder is not None or offload_state_dict or offload_buffers:
        from fabric_lite.big_modeling import load_checkpoint_and_dispatch

        load_checkpoint_and_dispatch()  # refuses
    from fabric_lite.checkpoint.names import for_module
    from fabric_lite.checkpoint.state import read_weights

    state = read_weights(os.fspath(checkpoint))
    if dtype is not None:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        keep = tuple(keep_in_fp32_modules or ())
        state = {k: v.to(dtype) if v.is_floating_point() and not any(m in k.split(".") for m in keep) else v
                 for k, v in state.items()}
    # with a dtype the weights take it (assign: the loaded tensors become the parameters), as in Accelerate
    model.load_state_dict(for_module(state, model.state_dict()), strict=strict, assign=dtype is not None)


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of `dtype` (a bool counts 1/8, as Accelerate counts it)."""
    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


def compute_module_sizes(model: nn.Module, dtype: Union[str, torch.dtype, None] = None,
                         special_dtypes: Optional[Dict[str, Union[str, torch.dtype]]] = None,
                         buffers_only: bool = False) -> Dict[str, float]:
    """Bytes of parameters and buffers under every module name (``""``: the whole model). `dtype` counts floating
    tensors as that dtype; `special_dtypes` gives some tensors (by full name) a dtype of their own. (A bool tensor
    counts 1/8 byte an element: a size may be fractional.)"""
    def as_dtype(d: Union[str, torch.dtype]) -> torch.dtype:
        return getattr(torch, d) if isinstance(d, str) else d

    counted = as_dtype(dtype) if dtype is not None else None
    special = {k: as_dtype(v) for k, v in (special_dtypes or {}).items()}
    tensors = list(model.named_buffers()) if buffers_only else [*model.named_parameters(), *model.named_buffers()]
    sizes: Dict[str, float] = {}
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * dtype_byte_size(special[name])
        elif counted is not None and tensor.is_floating_point():
            size = tensor.numel() * min(dtype_byte_size(counted), dtype_byte_size(tensor.dtype))
        else:
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            sizes[prefix] = sizes.get(prefix, 0) + size
    return sizes


def get_max_layer_size(modules: List[Tuple[str, Any]], module_sizes: Dict[str, float],
                       no_split_module_classes: List[str]) -> Tuple[float, List[str]]:
    """The largest "layer" among `modules` (named modules or tensors) and the names that reach it: a layer is a
    module without children, a module whose class is in `no_split_module_classes`, or a tensor."""
    largest: float = 0
    names: List[str] = []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes.get(name, 0)
            if size > largest:
                largest, names = size, [name]
            elif size == largest:
                names.append(name)
        else:
            pending = [(f"{name}.{child}", m) for child, m in children] + pending
    return largest, names


def calculate_maximum_sizes(model: nn.Module) -> Tuple[float, Tuple[float, List[str]]]:
    """(bytes of the whole model, (bytes of its largest layer, that layer's names))."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = [*model.named_parameters(recurse=False), *model.named_children(), *model.named_buffers(recurse=False)]
    return sizes.get("", 0), get_max_layer_size(top, sizes, no_split)


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> List[Any]:
    """Every submodule of `model`, children before their parents (`model` itself last); with `return_fqns`,
    (name, module) pairs."""
    order: List[Tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order if return_fqns else [m for _, m in order]
