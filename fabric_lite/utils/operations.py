"""Accelerate's data operations (``accelerate.utils.operations``): walking nested batches of tensors, and the
collectives as free functions.

The collectives (`gather`, `gather_object`, `reduce`, `broadcast`, `broadcast_object_list`,
`pad_across_processes`, `wait_for_everyone`) work on the current state, with no Accelerator object at hand: the
latest `Accelerator`, or the process group a `PartialState()` started (the first call starts it, from the launch
environment, if nothing has).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, List, Mapping, Optional, Union

import torch

__all__ = [
    "is_torch_tensor", "is_tensor_information", "is_namedtuple", "honor_type", "recursively_apply",
    "send_to_device", "find_batch_size", "listify", "concatenate", "slice_tensors", "convert_to_fp32",
    "convert_outputs_to_fp32", "ConvertOutputsToFp32", "gather", "gather_object", "reduce", "broadcast",
    "broadcast_object_list", "pad_across_processes", "wait_for_everyone",
]


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether `tensor_info` describes a tensor (has a shape and a dtype) without being one."""
    return hasattr(tensor_info, "shape") and hasattr(tensor_info, "dtype") and not isinstance(tensor_info,
                                                                                             torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether `data` is an instance of a `collections.namedtuple` / `typing.NamedTuple` class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """The items of `generator` in a container of `obj`'s type (a namedtuple is rebuilt field by field)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(func: Callable[..., Any], data: Any, *args: Any,
                      test_type: Callable[[Any], bool] = is_torch_tensor, error_on_other_type: bool = False,
                      **kwargs: Any) -> Any:
    """`data` (nested lists, tuples, namedtuples, mappings) with ``func(leaf, *args, **kwargs)`` applied to every leaf
    for which `test_type` is true; other leaves are kept, or with `error_on_other_type` a TypeError names them."""
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, d, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for d in data))
    if isinstance(data, Mapping):
        kind: Callable[..., Any] = type(data)  # the concrete mapping class, called with its items
        return kind({k: recursively_apply(func, v, *args, test_type=test_type,
                                                error_on_other_type=error_on_other_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported type {type(data).__name__} passed to {getattr(func, '__name__', func)}: "
                        f"only nested lists, tuples and dicts of objects that pass {test_type.__name__} are handled.")
    return data


def send_to_device(tensor: Any, device: Union[str, int, torch.device], non_blocking: bool = False,
                   skip_keys: Union[None, str, Iterable[str]] = None) -> Any:
    """Move every tensor of a nested structure (and any object with a ``.to`` method) to `device`. In every mapping
    the values under `skip_keys` stay where they are."""
    skip = set() if skip_keys is None else {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
    device = torch.device(device) if not isinstance(device, torch.device) else device

    def move(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data.to(device, non_blocking=non_blocking)
        if isinstance(data, (tuple, list)):
            return honor_type(data, (move(d) for d in data))
        if isinstance(data, Mapping):
            items = {k: v if k in skip else move(v) for k, v in data.items()}
            kind: Callable[..., Any] = type(data)  # the concrete mapping class, called with its items
            try:
                return kind(items)
            except TypeError:  # a Mapping whose constructor takes something else
                return items
        to = getattr(data, "to", None)
        if callable(to) and not isinstance(data, (str, bytes, type)):
            try:
                return to(device, non_blocking=non_blocking)
            except TypeError:  # a .to without non_blocking (e.g. a BatchEncoding of older transformers)
                return to(device)
        return data

    return move(tensor)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in `data` (in lists, tuples and mappings, the first item's)."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size of an empty {type(data).__name__}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors, got {type(data).__name__}.")
    if data.dim() == 0:
        raise TypeError("Cannot find the batch size of a 0-dimensional tensor.")
    return data.shape[0]


def _to_list(tensor: torch.Tensor) -> list:
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()


def listify(data: Any) -> Any:
    """`data` with each tensor replaced by its values as (nested) Python lists or numbers."""
    return recursively_apply(_to_list, data)


def concatenate(data: List[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-shaped nested structures of tensors, leaf by leaf, along `dim`."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        kind: Callable[..., Any] = type(first)  # the concrete mapping class, called with its items
        return kind({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"Can only concatenate tensors, got {type(first).__name__}.")
    return torch.cat(data, dim=dim)


def slice_tensors(data: Any, tensor_slice: Any, process_index: Optional[int] = None,
                  num_processes: Optional[int] = None) -> Any:
    """`data` with every tensor indexed by `tensor_slice` (``tensor[tensor_slice]``)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def _is_half(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """`tensor` (nested) with every float16 / bfloat16 tensor cast to float32; other tensors unchanged."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """A forward function whose outputs come back in float32 (picklable, unlike a closure)."""

    def __init__(self, model_forward: Callable[..., Any]):
        self._wrap(model_forward)

    def _wrap(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        return {"model_forward": self.model_forward}

    def __setstate__(self, state: Any) -> None:
        self._wrap(state["model_forward"])


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its half-precision outputs are returned as float32."""
    return ConvertOutputsToFp32(model_forward)


# -- collectives on the current state --------------------------------------------------------------
def _state() -> Any:
    from fabric_lite.state import PartialState

    return PartialState()


def gather(tensor: Any) -> Any:
    """Concatenate tensors (or nested structures of tensors) from all processes along dim 0."""
    return _state().gather(tensor)


def gather_object(obj: Any) -> List[Any]:
    """Gather picklable objects from all processes: a list from each (concatenated, in rank order), or one
    object each (a list of them)."""
    return _state().gather_object(obj)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce tensors across processes: "mean" (the default here, as Accelerate's function), "sum" or
    "none"."""
    return _state().reduce(tensor, reduction=reduction, scale=scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process gets process `from_process`'s tensors (nested structures too)."""
    return _state().broadcast(tensor, from_process=from_process)


def broadcast_object_list(object_list: List[Any], from_process: int = 0) -> List[Any]:
    """Replace the list's items, on every process, with those of process `from_process` (in place)."""
    return _state().broadcast_object_list(object_list, from_process=from_process)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` to the largest size any process has, so it can be gathered."""
    return _state().pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def wait_for_everyone() -> None:
    """Wait until every process reaches this point."""
    _state().wait_for_everyone()
