"""The trainer door's model: `TrainModule` (an nn.Module with step methods) and `DataModule`.

A TrainModule says *what* a step computes; the Trainer decides when it runs, on which device,
in which precision and how gradients move.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from fabric_lite.trainer.data_hooks import BatchTransferHooks, ModuleDataHooks
from fabric_lite.trainer.lightning_surface import DataModuleLightningNames, ModuleLightningNames

if TYPE_CHECKING:
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["TrainModule", "DataModule", "AttributeDict"]


class AttributeDict(Dict[str, Any]):
    """`hparams`: a dict whose keys read and write as attributes too (``self.hparams.lr``), as in Lightning."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; it holds: {sorted(self)}. Record it with "
                                 f"self.save_hyperparameters() in __init__, or set self.hparams.{name} = ...") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None


class TrainModule(ModuleDataHooks, ModuleLightningNames, nn.Module):
    """Subclass it, write `training_step` and `configure_optimizers`, and pass it to `Trainer.fit`.

    Examples:
        >>> class Classifier(TrainModule):
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         loss = torch.nn.functional.cross_entropy(self.net(x), y)
        ...         self.log("train/loss", loss)
        ...         return loss
    """

    #: Set to False to call `self.manual_backward` and step `self.optimizers()` yourself.
    automatic_optimization: bool = True
    #: An input to trace the model with (`TensorBoardLogger(log_graph=True)`): a tensor or a tuple of tensors.
    example_input_array: Optional[Any] = None

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Optional["Trainer"] = None
        self.hparams: AttributeDict = AttributeDict()

    # -- what the user writes ----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} has no training_step(self, batch, batch_idx); Trainer.fit needs one that "
            f"returns the loss (a scalar tensor) or a dict with a 'loss' key."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return None

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch)

    def configure_model(self) -> None:
        """Build the layers here (not in __init__) for models too big for one process: the Trainer calls it
        once, inside `init_module()`, so under strategy='fsdp' they are created on the meta device and each
        process materializes only its shards. Give every module holding parameters a reset_parameters()."""

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} has no configure_optimizers(self); return an optimizer, a list of them, "
            f"or {{'optimizer': ..., 'lr_scheduler': {{'scheduler': ..., 'interval': 'step'}}}}."
        )

    # -- hooks (no-ops by default; the loops call only those a subclass overrides, see callbacks.base.overrides) ---
    def prepare_data(self) -> None:
        """Download or write files: runs on the main process only, before `setup`."""

    def setup(self, stage: str) -> None:
        """Build what `stage` ("fit", "validate", "test", "predict") needs; runs on every process, after the
        callbacks' `setup`."""

    def teardown(self, stage: str) -> None:
        """Free what `setup(stage)` built; runs on every process when the stage ends, after an error too."""

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs (a callback or a list): they join the Trainer's at every stage, and
        replace the Trainer's callbacks of the same type (or a parent type); checkpoint callbacks go last."""
        return []

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    # (evaluation and prediction batch hooks get `dataloader_idx` only when there are several loaders)
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_validation_model_eval(self) -> None:
        """Put the module in evaluation mode before validation (override to keep some layers training)."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """Put the module back in training mode after validation (called only when overridden: otherwise each
        layer's mode from before validation is restored)."""
        self.train()

    def on_test_model_eval(self) -> None:
        """Put the module in evaluation mode before testing."""
        self.eval()

    def on_test_model_train(self) -> None:
        """Called after testing only when overridden (otherwise each layer's earlier mode is restored)."""
        self.train()

    def on_predict_model_eval(self) -> None:
        """Put the module in evaluation mode before predicting."""
        self.eval()

    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...

    # -- what the module can ask -------------------------------------------------------------------
    @property
    def trainer(self) -> "Trainer":
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call trainer.fit(module) first.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Optional["Trainer"]) -> None:
        self._trainer = trainer

    @property
    def device_mesh(self) -> Any:
        """torch's DeviceMesh of an N-D strategy, for `configure_model` to parallelize over (ModelParallelStrategy:
        dimensions "data_parallel" and "tensor_parallel"); None with any other strategy or without a Trainer."""
        return None if self._trainer is None else self._trainer.strategy.device_mesh.torch

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def log(
        self, name: str, value: Any, prog_bar: bool = False, logger: Optional[bool] = None,
        on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, reduce_fx: Any = "mean",
        enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
        add_dataloader_idx: bool = True, batch_size: Optional[int] = None, metric_attribute: Optional[str] = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a value per step and/or as an epoch aggregate (kept on the device), with Lightning's rules.

        Defaults follow the hook it is called from: per step in training hooks, per epoch in
        validation/test hooks and epoch-level hooks. Logged both ways, a value comes out as
        `name_step` and `name_epoch`. `reduce_fx` is mean (weighted by `batch_size`, read from the batch
        when not given), sum, max or min; `sync_dist` reduces across processes. A torchmetrics Metric
        gives its forward value per step and is computed, synced and reset at the epoch end.
        """
        if self._trainer is None:
            warnings.warn(f"self.log({name!r}) was called on a {type(self).__name__} that is not attached to a "
                          f"Trainer; the value is dropped. Run it through trainer.fit/validate/test.", UserWarning,
                          stacklevel=2)
            return
        self._trainer.metric_store.log(
            self, name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
            reduce_fx=reduce_fx, enable_graph=enable_graph, sync_dist=sync_dist, sync_dist_group=sync_dist_group,
            add_dataloader_idx=add_dataloader_idx, batch_size=batch_size, metric_attribute=metric_attribute,
            rank_zero_only=rank_zero_only,
        )

    def log_dict(
        self, dictionary: Mapping[str, Any], prog_bar: bool = False, logger: Optional[bool] = None,
        on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, reduce_fx: Any = "mean",
        enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
        add_dataloader_idx: bool = True, batch_size: Optional[int] = None, rank_zero_only: bool = False,
    ) -> None:
        """`self.log` for each item of a dict of values, or of a torchmetrics MetricCollection (its metrics
        under their prefixed names)."""
        torchmetrics = sys.modules.get("torchmetrics")  # (a MetricCollection exists only if the user imported it)
        if torchmetrics is not None and isinstance(dictionary, torchmetrics.MetricCollection):
            items = dictionary.items(keep_base=False, copy_state=False)
        else:
            items = dictionary.items()
        for name, value in items:
            self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                     reduce_fx=reduce_fx, enable_graph=enable_graph, sync_dist=sync_dist,
                     sync_dist_group=sync_dist_group, add_dataloader_idx=add_dataloader_idx, batch_size=batch_size,
                     rank_zero_only=rank_zero_only)

    def save_hyperparameters(self, *names: str, ignore: Sequence[str] = ()) -> None:
        """Record the caller's __init__ arguments in `self.hparams` (saved with every checkpoint)."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return
        code = caller.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        params = list(code.co_varnames[:n])
        if code.co_flags & inspect.CO_VARKEYWORDS:
            params.append(code.co_varnames[n + (1 if code.co_flags & inspect.CO_VARARGS else 0)])
        local = caller.f_locals
        args = {}
        for p in params:
            if p in ("self", "__class__") or p not in local:
                continue
            if code.co_flags & inspect.CO_VARKEYWORDS and p == params[-1] and isinstance(local[p], dict):
                args.update(local[p])  # **kwargs are recorded by their own names
            else:
                args[p] = local[p]
        if names:
            args = {k: v for k, v in args.items() if k in names}
        self.hparams.update({k: v for k, v in args.items() if k not in set(ignore)})
        try:  # (Lightning's hparams_initial: a copy, which later changes to hparams leave as it is)
            self.hparams_initial = AttributeDict(copy.deepcopy(dict(self.hparams)))
        except Exception:  # an argument that cannot be copied (an open file, a lock) is kept as it is
            self.hparams_initial = AttributeDict(self.hparams)

    # -- manual optimization -----------------------------------------------------------------------
    def optimizers(self) -> Union[torch.optim.Optimizer, List[torch.optim.Optimizer]]:
        opts = self.trainer.optimizers
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        scheds = [s.scheduler for s in self.trainer.lr_scheduler_configs]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()` through the strategy (loss scaling, DDP sync), for manual optimization."""
        self.trainer.backward(loss, **kwargs)


class DataModule(BatchTransferHooks, DataModuleLightningNames):
    """Dataloaders in one place: `setup(stage)` then `train_dataloader()` / `val_dataloader()` / ..."""

    #: Record the caller's __init__ arguments in `self.hparams`, as TrainModule's does.
    save_hyperparameters = TrainModule.save_hyperparameters
    #: The Trainer that last ran with this DataModule (set when fit/validate/test/predict is given it).
    trainer: Optional["Trainer"] = None

    def __init__(self) -> None:
        self.hparams: AttributeDict = AttributeDict()

    def prepare_data(self) -> None:
        """Download or write files; runs on the main process only, before `setup`."""

    def setup(self, stage: str) -> None:
        """Build datasets for `stage` ("fit", "validate", "test" or "predict"); runs on every process."""

    def teardown(self, stage: str) -> None:
        """Free what `setup(stage)` built; runs on every process when fit/validate/test/predict ends (also after
        an error)."""

    def state_dict(self) -> Dict[str, Any]:
        """What this DataModule keeps in a fit's checkpoints (Lightning's hook; nothing by default). The Trainer saves
        it with its own state, under the class's name, and hands it back to `load_state_dict` on resume."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take back what `state_dict` returned when the checkpoint being resumed was saved."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no train_dataloader().")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no test_dataloader().")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no predict_dataloader().")
