"""Lightning's data hooks on a TrainModule: a module may bring its own data, as Lightning's docs teach.

The Trainer calls `prepare_data()` on the main process, then `setup(stage)` on every process, before it asks for
the stage's loaders; `teardown(stage)` when the stage ends. A loader method the module does not override is not
called: fit/validate/test/predict then need loaders or a DataModule (see `data_connector.py`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ModuleDataHooks", "defines_loader"]


class ModuleDataHooks:
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
