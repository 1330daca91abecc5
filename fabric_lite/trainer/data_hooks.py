"""Lightning's data hooks on a TrainModule: a module may bring its own data, as Lightning's docs teach.

The Trainer calls `prepare_data()` on the main process, then `setup(stage)` on every process, before it asks for
the stage's loaders; `teardown(stage)` when the stage ends. A loader method the module does not override is not
called: fit/validate/test/predict then need loaders or a DataModule (see `data_connector.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fabric_lite.data.transfer import move_to_device

__all__ = ["BatchTransferHooks", "ModuleDataHooks", "defines_loader", "batch_transfer"]

TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class BatchTransferHooks:
    """How a batch reaches the device (a mixin of TrainModule and DataModule). Override one, and the Trainer
    passes every batch through all three instead of placing it itself: `on_before_batch_transfer` (on the CPU),
    `transfer_batch_to_device`, `on_after_batch_transfer` (on the device: GPU augmentations go here)."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


class ModuleDataHooks(BatchTransferHooks):
    """The data hooks of a TrainModule (a mixin): no-ops, and loader methods to override."""

    def prepare_data(self) -> None:
        """Download or write files; runs on the main process only, before `setup`."""

    def setup(self, stage: str) -> None:
        """Build what `stage` ("fit", "validate", "test" or "predict") needs; runs on every process, before the
        stage's loaders are asked for and before `configure_model`."""

    def teardown(self, stage: str) -> None:
        """Free what `setup(stage)` built; runs on every process when the stage ends (also after an error)."""

    def train_dataloader(self) -> Any:
        """Override to return the training loader, and fit(module) needs no loaders."""
        raise NotImplementedError(f"{type(self).__name__} has no train_dataloader(); define it, or pass loaders "
                                  f"or a DataModule to fit().")

    def val_dataloader(self) -> Any:
        """Override to return the validation loader(s)."""
        raise NotImplementedError(f"{type(self).__name__} has no val_dataloader(); define it, or pass loaders "
                                  f"or a DataModule.")

    def test_dataloader(self) -> Any:
        """Override to return the test loader(s)."""
        raise NotImplementedError(f"{type(self).__name__} has no test_dataloader(); define it, or pass loaders "
                                  f"or a DataModule to test().")

    def predict_dataloader(self) -> Any:
        """Override to return the prediction loader(s)."""
        raise NotImplementedError(f"{type(self).__name__} has no predict_dataloader(); define it, or pass loaders "
                                  f"or a DataModule to predict().")


def defines_loader(module: Any, name: str) -> bool:
    """Whether `module` has its own `name` loader method (overridden, or set on the instance)."""
    return name in vars(module) or getattr(type(module), name, None) is not getattr(ModuleDataHooks, name)


def _overrides(obj: Any, name: str) -> bool:
    return obj is not None and (name in vars(obj) or getattr(type(obj), name, None) is not getattr(BatchTransferHooks,
                                                                                                   name))


def batch_transfer(module: Any, datamodule: Any, device: torch.device,
                   feed: Optional[Callable[[Any], Any]] = None) -> Optional[Callable[[Any, int], Any]]:
    """The three transfer hooks as one function of (batch, dataloader_idx), the DataModule's where it overrides one,
    else the module's; None where neither overrides any (the loaders then place batches themselves). Where neither
    overrides transfer_batch_to_device, `feed` (the strategy's device feed) moves the batch, as a loader would."""
    if not any(_overrides(obj, name) for obj in (module, datamodule) for name in TRANSFER_HOOKS):
        return None
    before, transfer, after = (getattr(datamodule if _overrides(datamodule, name) else module, name)
                               for name in TRANSFER_HOOKS)
    if feed is not None and not any(_overrides(obj, "transfer_batch_to_device") for obj in (module, datamodule)):
        def run_fed(batch: Any, dataloader_idx: int) -> Any:
            return after(feed(before(batch, dataloader_idx)), dataloader_idx)

        return run_fed

    def run(batch: Any, dataloader_idx: int) -> Any:
        return after(transfer(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx)

    return run
