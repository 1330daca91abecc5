"""Accelerate's ``accelerate.data_loader`` module path, so ``from fabric_lite.data_loader import ...`` works as the
script's ``from accelerate.data_loader import ...`` did.

`prepare_data_loader`, `BatchSamplerShard`, `IterableDatasetShard`, `DataLoaderShard` and `DataLoaderDispatcher`
take Accelerate's arguments. A prepared loader is always fabric_lite's own (`fabric_lite.data.DataLoaderShard`,
built by `shard_dataloader`: it keeps the user's order, resumes exactly and answers `state_dict`); the two loader
classes here are the kinds of prepared loader a script's `isinstance` asks about: a loader whose main process reads
and hands each process its part (`dispatch_batches`) is a `DataLoaderDispatcher`, any other a `DataLoaderShard`.
Other names (`skip_first_batches`, ...) come from `fabric_lite.data`, imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch.utils.data import DataLoader, IterableDataset

from fabric_lite.data.accelerate_shards import (
    AcceptingType, BatchSamplerShard, IterableDatasetShard, check_processes,
)
from fabric_lite.data.loader import DataLoaderShard as PreparedLoader
from fabric_lite.data.loader import shard_dataloader, skip_first_batches
from fabric_lite.module_alias import forward_names

__all__ = ["prepare_data_loader", "BatchSamplerShard", "IterableDatasetShard", "DataLoaderShard",
           "DataLoaderDispatcher", "skip_first_batches"]

__getattr__, __dir__ = forward_names("fabric_lite.data", globals())


def _identity(obj: Any) -> Any:
    return obj


def _refuse_device_mesh(caller: str, torch_device_mesh: Any) -> None:
    if torch_device_mesh is not None:
        from fabric_lite.utils import NotSupportedError

        raise NotSupportedError(
            f"{caller}(torch_device_mesh=...): sharding a loader built outside the Accelerator by a device mesh of "
            f"the script's own is not supported by fabric_lite; build the Accelerator with parallelism_config="
            f"ParallelismConfig(...) and pass the loader to accelerator.prepare, which shards it over the "
            f"data-parallel ranks (or leave torch_device_mesh=None: sharded over every process).")


def _check_rng_types(caller: str, rng_types: Any) -> None:
    """Accelerate's `rng_types` are accepted: fabric_lite's loaders draw the same order on every process without
    them (see `fabric_lite.data.order`). Names that are not RNGs are refused."""
    if rng_types is None:
        return
    from fabric_lite.utils.dataclasses import RNGType

    known = {kind.value for kind in RNGType}
    names = [rng_types] if isinstance(rng_types, str) else list(rng_types)
    bad = [name for name in names if not isinstance(name, str) or str(name) not in known]
    if bad:
        raise ValueError(f"{caller}(rng_types={rng_types!r}): {bad} are not random number generators; use names of "
                         f"RNGType: {sorted(known)}.")


def _gradient_state() -> Any:
    """The latest Accelerator's gradient state (its accumulation sees the loader end), else a new one."""
    from fabric_lite.state import GradientState, current_accelerator

    accelerator = current_accelerator()
    return accelerator.gradient_state if accelerator is not None else GradientState()


def _processes(caller: str, num_processes: Optional[int],
               process_index: Optional[int]) -> Tuple[int, int, Callable[[Any], Any], bool]:
    """(num_processes, process_index, broadcast, live): a value not given is this process's (the process group is
    started as `PartialState()` starts it); `live`: they are this run's, whose processes agree through `broadcast`.
    Otherwise (a shard computed for another process) the broadcast hands the object back unchanged."""
    from fabric_lite.state import PartialState, current_strategy

    if num_processes is None or process_index is None:
        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    check_processes(caller, num_processes, process_index, default="None: this run's")
    strategy = current_strategy()
    live = strategy is not None and strategy.world_size == num_processes and strategy.global_rank == process_index
    broadcast = strategy.collectives.broadcast_object if live and num_processes > 1 else _identity
    return num_processes, process_index, broadcast, live


def prepare_data_loader(
    dataloader: DataLoader, device: Optional[Union[str, torch.device]] = None, num_processes: Optional[int] = None,
    process_index: Optional[int] = None, split_batches: bool = False, put_on_device: bool = False,
    rng_types: Optional[List[str]] = None, dispatch_batches: Optional[bool] = None, even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable[..., Any]] = None, use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None, non_blocking: bool = False, use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedLoader:
    """`dataloader` rebuilt to yield process `process_index`'s batches of `num_processes` (Accelerate's
    `prepare_data_loader`), as `fabric_lite.data.shard_dataloader` builds it.

    `num_processes`/`process_index` default to this run's. Without `split_batches`, the processes take turns at
    the loader's batches; with it, each takes its piece of every batch. The last global step is completed with
    samples from the start of the epoch (`even_batches`) unless the loader drops its last batch. `put_on_device`:
    batches are moved to `device` (`non_blocking`: asynchronously). `dispatch_batches` (default: True for an
    IterableDataset when `put_on_device`, else False; True needs `put_on_device`): process 0 alone reads, and each
    process gets its part of every global batch, cut by `slice_fn_for_dispatch` if given
    (``slice_fn(batch, slice, process_index=..., num_processes=...)``). `use_seedable_sampler`: a RandomSampler's
    order comes from `data_seed` (default: process 0's ``torch.initial_seed()``) and the epoch. `rng_types` is
    accepted (every process draws the same order without it); `use_stateful_dataloader` too (every prepared loader
    has `state_dict`/`load_state_dict`). `torch_device_mesh` is refused.
    """
    caller = "prepare_data_loader"
    _refuse_device_mesh(caller, torch_device_mesh)
    _check_rng_types(caller, rng_types)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"{caller} shards a torch.utils.data.DataLoader, got {type(dataloader).__name__}.")
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device) and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError(f"{caller}(dispatch_batches=True) hands each process its part of every batch on its "
                         f"device, and needs put_on_device=True (with device=...); or use dispatch_batches=False.")
    num_processes, process_index, broadcast, live = _processes(caller, num_processes, process_index)
    if dispatch_batches and num_processes > 1 and not live:
        raise ValueError(
            f"{caller}(dispatch_batches=True, num_processes={num_processes}, process_index={process_index}): process "
            f"0 hands every batch to the others, so those {num_processes} processes must be this run's, launched "
            f"together (fabric-lite launch). To compute one process's shard here, use dispatch_batches=False.")
    if isinstance(dataloader, PreparedLoader):
        return dataloader
    loader = shard_dataloader(
        dataloader, num_replicas=num_processes, rank=process_index,
        device=torch.device(device) if put_on_device and device is not None else None,
        gradient_state=_gradient_state(), split_batches=split_batches, even_batches=even_batches,
        broadcast_seed=broadcast, non_blocking=non_blocking, dispatch_batches=bool(dispatch_batches),
        use_seedable_sampler=use_seedable_sampler, data_seed=data_seed)
    if dispatch_batches:
        # (on one process nothing is handed out, yet the loader is the dispatching kind the script asked for)
        loader.dispatch_batches = True
        if loader.dispatch is not None and slice_fn_for_dispatch is not None:
            loader.dispatch.slice_fn = slice_fn_for_dispatch
    return loader


def _started(loader: PreparedLoader, skip_batches: int, iteration: int) -> PreparedLoader:
    """`loader` numbering its next epoch `iteration`, each epoch starting after `skip_batches` batches."""
    if iteration:
        loader.set_epoch(iteration)
    return skip_first_batches(loader, skip_batches) if skip_batches else loader


def _dispatches(obj: Any) -> bool:
    return obj.dispatch is not None or getattr(obj, "dispatch_batches", False) is True


class _LoaderKind(AcceptingType):
    """The metaclass of the loader kinds below: calling the class builds a prepared loader (`build`)."""

    build: Callable[..., Any]  # each loader kind's classmethod

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.build(*args, **kwargs)


class DataLoaderShard(PreparedLoader, metaclass=_LoaderKind):
    """A prepared loader that reads its own batches (Accelerate's `DataLoaderShard`): every loader prepared
    without `dispatch_batches` is an instance.

    ``DataLoaderShard(dataset, device=None, rng_types=None, synchronized_generator=None, skip_batches=0,
    use_stateful_dataloader=False, torch_device_mesh=None, iteration=0, **kwargs)`` builds one over
    ``DataLoader(dataset, **kwargs)`` without sharding it further (give it a `BatchSamplerShard` or an
    `IterableDatasetShard` to read one process's share), moving batches to `device`, its next epoch numbered
    `iteration`, each epoch starting after `skip_batches` batches.
    `rng_types` and `synchronized_generator` are accepted (a prepared loader keeps its generator itself).
    """

    @classmethod
    def build(cls, dataset: Any, device: Optional[Union[str, torch.device]] = None, rng_types: Any = None,
              synchronized_generator: Optional[torch.Generator] = None, skip_batches: int = 0,
              use_stateful_dataloader: bool = False, torch_device_mesh: Any = None, iteration: int = 0,
              **kwargs: Any) -> PreparedLoader:
        _refuse_device_mesh(cls.__name__, torch_device_mesh)
        _check_rng_types(cls.__name__, rng_types)
        loader = shard_dataloader(DataLoader(dataset, **kwargs), num_replicas=1, rank=0,
                                  device=torch.device(device) if device is not None else None,
                                  gradient_state=_gradient_state())
        return _started(loader, skip_batches, iteration)

    @staticmethod
    def accepts(obj: Any) -> bool:
        return isinstance(obj, PreparedLoader) and not _dispatches(obj)


class DataLoaderDispatcher(PreparedLoader, metaclass=_LoaderKind):
    """A prepared loader whose main process alone reads, handing every process its part of each global batch
    (Accelerate's `DataLoaderDispatcher`): every loader prepared with `dispatch_batches` is an instance.

    ``DataLoaderDispatcher(dataset, split_batches=False, skip_batches=0, use_stateful_dataloader=False,
    slice_fn=None, torch_device_mesh=None, iteration=0, **kwargs)`` builds one over ``DataLoader(dataset,
    **kwargs)`` for this run's processes, as ``prepare_data_loader(..., put_on_device=True, dispatch_batches=True)``
    does, on this process's device.
    """

    @classmethod
    def build(cls, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
              use_stateful_dataloader: bool = False, slice_fn: Optional[Callable[..., Any]] = None,
              torch_device_mesh: Any = None, iteration: int = 0, **kwargs: Any) -> PreparedLoader:
        from fabric_lite.state import PartialState

        _refuse_device_mesh(cls.__name__, torch_device_mesh)
        loader = prepare_data_loader(DataLoader(dataset, **kwargs), device=PartialState().device, put_on_device=True,
                                     split_batches=split_batches, dispatch_batches=True, slice_fn_for_dispatch=slice_fn)
        return _started(loader, skip_batches, iteration)

    @staticmethod
    def accepts(obj: Any) -> bool:
        return isinstance(obj, PreparedLoader) and _dispatches(obj)
