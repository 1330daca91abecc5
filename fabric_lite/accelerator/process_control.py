"""Collectives and process control of the raw door (gather, reduce, main_process_first, ...).

`ProcessFacts` answers where this process is and runs the collectives over `self.strategy` alone; it is
shared by `Accelerator` and by `fabric_lite.state.PartialState`, so both give the same answers.
`ProcessControl` (a mixin of `Accelerator`) adds what needs more of it: `self.gradient_state`,
`self.dataloader_config` and `self.flag_tensor`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from fabric_lite._tree import tree_map
from fabric_lite.accelerator.enums import DistributedType

__all__ = ["ProcessFacts", "ProcessControl"]

# Accelerate's names of multi-process runs, by device type (others: "MULTI_" + the type in capitals).
_MULTI_TYPES = {"cuda": "MULTI_GPU", "cpu": "MULTI_CPU"}


class ProcessFacts:
    """Where this process is and the collectives between processes, read from `self.strategy` only."""

    strategy: Any

    # -- where this process is ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    @property
    def num_processes(self) -> int:
        return self.strategy.world_size

    @property
    def process_index(self) -> int:
        return self.strategy.global_rank

    @property
    def local_process_index(self) -> int:
        return self.strategy.process.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def is_local_main_process(self) -> bool:
        return self.strategy.process.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name of this kind of run: the strategy's own (`accelerate_type`), else NO for one
        process, else `MULTI_<device>` (MULTI_GPU on CUDA)."""
        if self.strategy.traits.accelerate_type is not None:
            return DistributedType(self.strategy.traits.accelerate_type)
        if self.num_processes == 1:
            return DistributedType.NO
        kind = self.device.type
        name = _MULTI_TYPES.get(kind, f"MULTI_{kind.upper()}")
        return DistributedType(name) if name in DistributedType.__members__ else DistributedType.MULTI_GPU

    # -- collectives -------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (or nested structures of tensors) from all processes along dim 0."""
        return tree_map(self.strategy.collectives.all_gather, tensor, _reject_non_tensor("gather"))

    def gather_object(self, obj: Any) -> List[Any]:
        """Gather picklable objects; lists from each process are concatenated."""
        return _joined(self.strategy.collectives.all_gather_object(obj))

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors across processes with "sum", "mean" or "none"."""
        if reduction == "none":
            return tensor

        def one(t: torch.Tensor) -> torch.Tensor:
            out = self.strategy.collectives.all_reduce(t, reduction)
            return out * scale if scale != 1.0 else out

        return tree_map(one, tensor, _reject_non_tensor("reduce"))

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad each tensor along `dim` to the largest size any process has, so it can be gathered."""

        def one(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or not -t.dim() <= dim < t.dim():
                return t
            d = dim % t.dim()
            sizes = self.strategy.collectives.all_gather(torch.tensor([t.shape[d]], device=t.device))
            longest = int(sizes.max())
            if longest == t.shape[d]:
                return t
            shape = list(t.shape)
            shape[d] = longest
            out = t.new_full(shape, pad_index)
            index = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
            out[(slice(None),) * d + (index,)] = t
            return out

        return tree_map(one, tensor)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        return tree_map(lambda t: self.strategy.collectives.broadcast(t, from_process), tensor, _reject_non_tensor("broadcast"))

    def broadcast_object_list(self, object_list: List[Any], from_process: int = 0) -> List[Any]:
        """Replace the list's items, on every process, with those of process `from_process`; returns the list."""
        object_list[:] = self.strategy.collectives.broadcast_object(list(object_list), from_process)
        return object_list

    def wait_for_everyone(self) -> None:
        self.strategy.barrier()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, tensor or dict of those."""
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to download or cache), then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def on_main_process(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on global process `process_index`."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.process_index == process_index else None

        return wrapper

    def on_local_process(self, function: Optional[Callable] = None,
                         local_process_index: Optional[int] = None) -> Callable:
        """Decorator: run only on the process whose index on its machine is `local_process_index` (on every
        machine)."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise TypeError(f"on_local_process({function.__qualname__}) needs local_process_index=<int>, e.g. "
                            "@accelerator.on_local_process(local_process_index=0).")

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.local_process_index == local_process_index else None

        return wrapper

    def on_last_process(self, function: Callable) -> Callable:
        return self.on_process(function, process_index=self.num_processes - 1)

    def on_local_main_process(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper


class ProcessControl(ProcessFacts):
    """The Accelerator's process control beyond `ProcessFacts`: metrics gathering, triggers, uneven inputs."""

    # set by the Accelerator that mixes this in
    gradient_state: Any
    flag_tensor: torch.Tensor
    dataloader_config: Any

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation, dropping the samples that even-batch padding repeated at the end."""
        leaves: List[bool] = []

        def tensor_leaf(t: Any) -> Any:
            leaves.append(True)
            return t

        def other_leaf(o: Any) -> Any:
            leaves.append(False)
            return o

        tree_map(tensor_leaf, input_data, other_leaf)
        dp = self.strategy.collectives.over("dp")  # (the evaluation data is sharded over the data-parallel group)
        if use_gather_object or not all(leaves):
            data = _joined(dp.all_gather_object(input_data))
        else:
            data = tree_map(dp.all_gather, input_data, _reject_non_tensor("gather"))
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if isinstance(data, list):
                return data[: state.remainder]
            return tree_map(lambda t: t[: state.remainder], data)
        return data

    def set_trigger(self) -> None:
        """Raise a flag on this process that `check_trigger` will see on every process (e.g. early stop)."""
        self.flag_tensor.fill_(1)

    def check_trigger(self) -> bool:
        """True on every process if any process called `set_trigger` since the last check (one all-reduce)."""
        raised = bool(self.strategy.collectives.all_reduce(self.flag_tensor, "sum").item() > 0)
        if raised:
            self.flag_tensor.zero_()
        return raised

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: Optional[bool] = None) -> Iterator[None]:
        """Let processes with fewer batches finish without hanging (torch's Join), for even_batches=False."""
        if self.num_processes == 1 or not all(hasattr(j, "join_hook") for j in joinables):
            yield
            return
        from torch.distributed.algorithms.join import Join

        saved = self.dataloader_config.even_batches
        if even_batches is not None:
            self.dataloader_config.even_batches = even_batches
        try:
            with Join(list(joinables)):
                yield
        finally:
            self.dataloader_config.even_batches = saved


def _joined(parts: List[Any]) -> List[Any]:
    """Gathered objects: lists from each process concatenated, anything else one item per process."""
    if all(isinstance(p, (list, tuple)) for p in parts):
        return [x for p in parts for x in p]
    return parts


def _reject_non_tensor(verb: str) -> Callable[[Any], Any]:
    def reject(obj: Any) -> Any:
        if obj is None or isinstance(obj, (int, float, bool, str)):
            raise TypeError(
                f"{verb}() works on tensors (or nested lists/dicts of tensors), got {type(obj).__name__}. "
                f"Wrap numbers in torch.tensor(...) or use gather_object() for Python objects."
            )
        return obj

    return reject


def _split(inputs: Any, world: int, rank: int, apply_padding: bool) -> Any:
    if isinstance(inputs, dict):
        return {k: _split(v, world, rank, apply_padding) for k, v in inputs.items()}
    n = len(inputs)
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    part = inputs[start:end]
    if apply_padding and extra and len(part) < per + 1 and n:
        last = inputs[-1:]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part
