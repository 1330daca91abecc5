"""Where the Trainer's dataloaders come from, and how they are prepared.

A stage's loaders come from the arguments of fit/validate/test/predict, else from a DataModule, else from the
TrainModule's own `train_dataloader()`/`val_dataloader()`/... (as Lightning's docs teach). `prepare_data()` runs
first on the main process, then `setup(stage)` on every process, the DataModule's before the module's; when the
stage ends, `teardown(stage)` in the same order. A loader that came from a method can be asked for again
(`reload_dataloaders_every_n_epochs`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sized, Tuple, cast

from fabric_lite.trainer.data_hooks import defines_loader

if TYPE_CHECKING:
    from fabric_lite.trainer.module import DataModule, TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["STAGE_LOADERS", "LoaderSource", "connect_data", "teardown_data", "as_list", "sequential_loader",
           "datamodule_given_as_loaders", "prepare_unsharded", "prepare_train_loader", "prepare_eval_loader",
           "reload_loaders"]

#: the loader methods each stage asks for, in order
STAGE_LOADERS = {"fit": ("train_dataloader", "val_dataloader"), "validate": ("val_dataloader",),
                 "test": ("test_dataloader",), "predict": ("predict_dataloader",)}


class LoaderSource:
    """One stage's loaders: the objects given, or the method that returns them (called again on a reload)."""

    def __init__(self, given: Any = None, method: Optional[Callable[[], Any]] = None, origin: str = "") -> None:
        self.given = given
        self.method = method
        #: where the loaders come from, in words ("given to fit()", "from MyModule.train_dataloader()")
        self.origin = origin

    @property
    def reloadable(self) -> bool:
        return self.method is not None

    def request(self) -> Any:
        return self.method() if self.method is not None else self.given




def datamodule_given_as_loaders(stage: str, loaders: Any, datamodule: Any) -> Tuple[Any, Any]:
    """Lightning's `trainer.fit(model, dm)`: a DataModule passed where the loaders go is the datamodule."""
    from fabric_lite.trainer.module import DataModule

    if not isinstance(loaders, DataModule):
        return loaders, datamodule
    if datamodule is not None:
        raise ValueError(f"{stage}() got a {type(loaders).__name__} in place of the dataloaders and datamodule="
                         f"{type(datamodule).__name__}; pass one DataModule.")
    return None, loaders


def connect_data(trainer: "Trainer", module: "TrainModule", datamodule: Optional["DataModule"], stage: str,
                 given: Tuple[Any, ...]) -> List[LoaderSource]:
    """Run the data hooks for `stage` and say where each of its loaders comes from (one source per loader kind)."""
    if datamodule is not None and any(g is not None for g in given):
        raise ValueError(f"Pass dataloaders or a datamodule to {stage}(), not both.")
    module.trainer = trainer  # (the module's setup and loader methods may read it, as in Lightning)
    if datamodule is not None:
        trainer.datamodule = datamodule
        datamodule.trainer = trainer  # (Lightning's DataModules may read their trainer)
    with trainer.accelerator.main_process_first():
        if trainer.is_global_zero:
            if datamodule is not None:
                datamodule.prepare_data()
            module.prepare_data()
    if datamodule is not None:
        datamodule.setup(stage)
        if datamodule.hparams:
            module.hparams.setdefault("datamodule", dict(datamodule.hparams))
    module.setup(stage)
    sources = []
    for name, value in zip(STAGE_LOADERS[stage], given):
        if datamodule is not None:
            sources.append(LoaderSource(method=getattr(datamodule, name),
                                        origin=f"from {type(datamodule).__name__}.{name}()"))
        elif value is not None:
            sources.append(LoaderSource(given=value, origin=f"given to {stage}()"))
        else:
            own = getattr(module, name) if defines_loader(module, name) else None
            sources.append(LoaderSource(method=own, origin=f"from {type(module).__name__}.{name}()"))
    return sources


def teardown_data(module: Optional["TrainModule"], datamodule: Optional["DataModule"], stage: str) -> None:
    """`teardown(stage)` on the DataModule, then on the module (after a failure too: their setup ran)."""
    if datamodule is not None:
        datamodule.teardown(stage)
    if module is not None:
        module.teardown(stage)


def as_list(loaders: Any) -> List[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def sequential_loader(loader: Any, stage: str, overfit_batches: Any) -> Any:
    """`overfit_batches`: `loader` reading its samples in order (a shuffling loader is rebuilt without shuffling)."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader  # (an iterable dataset has no sampler to replace: it yields in its own order)
    batches = loader.batch_sampler
    sampler = loader.sampler if batches is None or type(batches) is BatchSampler else None
    if batches is not None and type(batches) is BatchSampler:
        sampler = batches.sampler
    if sampler is None:
        raise ValueError(
            f"Trainer(overfit_batches={overfit_batches!r}) reads the same first batches every epoch, but the {stage} "
            f"dataloader draws its batches from a {type(batches).__name__}, which it cannot put in order. Give it a "
            f"loader with batch_size=... and shuffle=False (or a batch sampler that does not shuffle).")
    if isinstance(sampler, SequentialSampler):
        return loader
    warnings.warn(f"Trainer(overfit_batches={overfit_batches!r}): the {stage} dataloader shuffles "
                  f"({type(sampler).__name__}); it now reads its samples in order, so every epoch sees the same "
                  f"batches.", UserWarning, stacklevel=4)
    kwargs = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                  worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
                  generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    dataset = cast(Sized, loader.dataset)  # (map-style here: its samplers read indices below its length)
    return DataLoader(loader.dataset, sampler=SequentialSampler(dataset), **kwargs)


def prepare_unsharded(trainer: "Trainer", loader: Any, even_batches: Optional[bool] = None,
                      place: Optional[bool] = None) -> Any:
    """`use_distributed_sampler=False`: every process reads `loader` whole, in its own order (the user shards it,
    e.g. with their own DistributedSampler); batches are still placed on the device and the position is kept."""
    from fabric_lite.data.loader import shard_dataloader

    acc = trainer.accelerator
    config = acc.dataloader_config
    place = acc.device_placement if place is None else place
    prepared = shard_dataloader(
        loader, num_replicas=1, rank=0, device=acc.device if place and acc.device.type != "cpu" else None,
        gradient_state=acc.gradient_state, split_batches=config.split_batches,
        even_batches=config.even_batches if even_batches is None else even_batches,
        non_blocking=config.non_blocking, device_feed=acc.strategy.runtime.device_feed(config.non_blocking) if place else None,
    )
    acc.dataloaders.append(prepared)
    return prepared


def prepare_train_loader(trainer: "Trainer", loader: Any) -> Any:
    """The training loader as the Trainer reads it: in order under overfit_batches, sharded unless
    use_distributed_sampler=False."""
    if trainer.overfit_batches:
        loader = sequential_loader(loader, "training", trainer.overfit_batches)
    # the user's loader and where it came from, named if it yields no batches (loops.empty_loader_warning)
    trainer.train_dataloader_source = (loader, trainer.train_source.origin)
    return _prepared(trainer, loader, None, 0)


def _prepared(trainer: "Trainer", loader: Any, even: Optional[bool], dataloader_idx: int) -> Any:
    # (with batch-transfer hooks the loops move each batch through them, and the loader leaves it where it loads it)
    place = None if trainer.batch_transfer is None else False
    if not trainer.settings.use_distributed_sampler:
        return prepare_unsharded(trainer, loader, even_batches=even, place=place)
    return trainer.accelerator.prepare_data_loader(loader, device_placement=place, even_batches=even)


def prepare_eval_loader(trainer: "Trainer", loader: Any, stage: str = "validate", dataloader_idx: int = 0) -> Any:
    """An evaluation loader as the Trainer reads it: every sample once (see below), in order under overfit_batches."""
    if trainer.overfit_batches and stage == "validate":
        loader = sequential_loader(loader, "validation", trainer.overfit_batches)
    # Every sample exactly once (no even-batch padding), so metrics over the whole set are exact;
    # unless each forward is a collective (ZeRO-3), where a process that ran out would hang the rest:
    # then the last step is padded as in training, and its repeated samples count in epoch means.
    return _prepared(trainer, loader, trainer.strategy.traits.forward_is_collective, dataloader_idx)


def reload_loaders(trainer: "Trainer") -> None:
    """`reload_dataloaders_every_n_epochs`: ask the loader methods again (at an epoch start, every N epochs)."""
    acc = trainer.accelerator
    if trainer.train_source.reloadable:
        old, new = trainer.train_dataloader, prepare_train_loader(trainer, trainer.train_source.request())
        # the new loader takes the old one's place (its checkpoint slot)
        old_inner, new_inner = old, new
        acc.dataloaders.remove(new_inner)
        acc.dataloaders[acc.dataloaders.index(old_inner)] = new_inner
        new.set_epoch(trainer.current_epoch)
        trainer.train_dataloader = new
    if trainer.val_source.reloadable:
        for old in trainer.val_dataloaders:
            acc.dataloaders.remove(old)
        trainer.val_dataloaders = [prepare_eval_loader(trainer, v, "validate", i)
                                   for i, v in enumerate(as_list(trainer.val_source.request()))]
    trainer.loaded_epoch = trainer.current_epoch
