"""Lightning's spellings on the Trainer, TrainModule and DataModule that are other names for what they already hold
(`trainer.lightning_module`, `module.global_rank`, `toggle_optimizer`, ...), and Lightning's members fabric_lite
does not have: those raise `NotSupportedError` naming the feature and what to do instead, when a script uses them.

The Trainer, TrainModule and DataModule inherit these small mixins; the refusal tables are read only where a name
is missing (`__getattr__`), a Trainer argument is unknown, or fit starts, so a run that uses none of them pays
nothing per step.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from fabric_lite.refusals import NotSupportedError, message, refused

if TYPE_CHECKING:
    from fabric_lite.callbacks.base import Callback

__all__ = ["NotSupportedAttributeError", "TrainerLightningNames", "ModuleLightningNames", "DataModuleLightningNames",
           "REFUSED_TRAINER_ARGUMENTS", "REFUSED_TRAINER_MEMBERS", "check_refused_arguments", "check_refused_overrides"]

_STAGE_INSTEAD = "know the stage from the hook you are in (on_train_*, on_validation_*, on_test_*, on_predict_*)"
_LOOPS_INSTEAD = "read trainer.current_epoch, trainer.global_step and trainer.should_stop"

#: Trainer arguments of Lightning that fabric_lite does not have: name -> (Lightning's default, feature, instead).
#: Lightning's default is accepted (it changes nothing); any other value is refused.
REFUSED_TRAINER_ARGUMENTS: Dict[str, Tuple[Any, str, str]] = {
    "enable_autolog_hparams": (True, "turning off the logging of hyperparameters at the start of fit",
                               "log them or not from the logger itself; the module's hparams are sent to the "
                               "loggers once when fit starts"),
}

#: Trainer members of Lightning that fabric_lite does not have: name -> (feature, instead).
REFUSED_TRAINER_MEMBERS: Dict[str, Tuple[str, str]] = {
    "state": ("Lightning's TrainerState object", _STAGE_INSTEAD),
    "fit_loop": ("Lightning's loop objects (fit_loop)", _LOOPS_INSTEAD),
    "validate_loop": ("Lightning's loop objects (validate_loop)", _LOOPS_INSTEAD),
    "test_loop": ("Lightning's loop objects (test_loop)", _LOOPS_INSTEAD),
    "training": ("the running-stage flag trainer.training", _STAGE_INSTEAD),
    "validating": ("the running-stage flag trainer.validating", _STAGE_INSTEAD),
    "testing": ("the running-stage flag trainer.testing", _STAGE_INSTEAD),
    "predicting": ("the running-stage flag trainer.predicting", _STAGE_INSTEAD),
    "evaluating": ("the running-stage flag trainer.evaluating", _STAGE_INSTEAD),
    "interrupted": ("the trainer.interrupted flag", "catch KeyboardInterrupt around fit(), or write "
                                                    "Callback.on_exception"),
    "received_sigterm": ("the trainer.received_sigterm flag", "let the Trainer handle SIGTERM: every process "
                         "saves checkpoints/preempted and exits with status 75; fit(ckpt_path='last') resumes"),
    "ckpt_path": ("setting trainer.ckpt_path", "pass ckpt_path= to fit()"),
    "device_ids": ("trainer.device_ids", "read trainer.device and trainer.num_devices"),
    "distributed_sampler_kwargs": ("trainer.distributed_sampler_kwargs", "the Trainer shards every loader over "
                                   "the processes itself; read trainer.world_size and trainer.global_rank"),
    "enable_validation": ("trainer.enable_validation", "pass val_dataloaders to fit() to validate"),
    "is_last_batch": ("trainer.is_last_batch", "compare batch_idx with len(dataloader) - 1"),
    "num_training_batches": ("trainer.num_training_batches", "use len(train_dataloader) and limit_train_batches"),
    "num_sanity_val_batches": ("trainer.num_sanity_val_batches", "read trainer.num_sanity_val_steps"),
    "num_val_batches": ("trainer.num_val_batches", "use len() of the validation dataloaders"),
    "num_test_batches": ("trainer.num_test_batches", "use len() of the test dataloader"),
    "num_predict_batches": ("trainer.num_predict_batches", "use len() of the predict dataloader"),
    "test_dataloaders": ("trainer.test_dataloaders", "keep the loader you pass to test()"),
    "predict_dataloaders": ("trainer.predict_dataloaders", "keep the loader you pass to predict()"),
    "estimated_stepping_batches": ("trainer.estimated_stepping_batches", "compute it from your loader: "
                                   "max_epochs * ceil(len(train_loader) / accumulate_grad_batches)"),
    "val_check_batch": ("trainer.val_check_batch", "read trainer.val_check_interval"),
    "enable_autolog_hparams": REFUSED_TRAINER_ARGUMENTS["enable_autolog_hparams"][1:],
}


class NotSupportedAttributeError(NotSupportedError, AttributeError):
    """Reading a refused attribute: a NotSupportedError naming the feature, and an AttributeError, so that
    hasattr() and tools that walk a module's attributes (torch.jit, copy, inspect) see the name as absent."""


class fallback_property:
    """A read-only property that an instance attribute of the same name replaces (no __set__): the class that
    inherits the mixin may assign the name itself and then owns it."""

    def __init__(self, fget: Any) -> None:
        self.fget = fget
        self.__doc__ = fget.__doc__

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else self.fget(obj)


class fixed_property:
    """A setting of Lightning's that fabric_lite has at one value only: it reads that value, setting the same value
    is fine, and setting another raises NotSupportedError."""

    def __init__(self, name: str, value: Any, feature: str, instead: str) -> None:
        self.value, self.text, self.refusal = value, message(name, feature, instead), (feature, instead)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else self.value

    def __set__(self, obj: Any, value: Any) -> None:
        if value != self.value:
            raise NotSupportedError(self.text)


def check_refused_arguments(unknown: Dict[str, Any]) -> None:
    """Drop Lightning's Trainer arguments given at Lightning's default; raise NotSupportedError for another value."""
    for name in [n for n in unknown if n in REFUSED_TRAINER_ARGUMENTS]:
        default, feature, instead = REFUSED_TRAINER_ARGUMENTS[name]
        value = unknown.pop(name)
        if value != default:
            raise NotSupportedError(message(f"Trainer({name}={value!r})", feature, instead))


class TrainerLightningNames:
    """Lightning's names for what the Trainer already holds, and its refused members (see the module docstring)."""

    callbacks: List["Callback"]
    module: Any
    limits: Dict[str, Any]
    strategy: Any

    def __getattr__(self, name: str) -> Any:
        refusal = REFUSED_TRAINER_MEMBERS.get(name)
        if refusal is not None:
            raise NotSupportedAttributeError(message(f"Trainer.{name}", *refusal))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @fallback_property
    def lightning_module(self) -> Any:
        """The TrainModule being run (Lightning's name; `trainer.module` here)."""
        return self.module

    @fallback_property
    def precision(self) -> str:
        """The precision in Lightning's spelling ("32-true", "16-mixed", "bf16-mixed", ...)."""
        return str(self.strategy.precision.name)

    @fallback_property
    def precision_plugin(self) -> Any:
        """The Precision plugin the strategy trains with."""
        return self.strategy.precision

    @fallback_property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        """The gradient scaler of "16-mixed", None otherwise."""
        return self.strategy.precision.scaler

    @fallback_property
    def early_stopping_callbacks(self) -> List["Callback"]:
        from fabric_lite.callbacks.early_stopping import EarlyStopping

        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @fallback_property
    def early_stopping_callback(self) -> Optional["Callback"]:
        found = self.early_stopping_callbacks
        return found[0] if found else None

    @fallback_property
    def checkpoint_callbacks(self) -> List["Callback"]:
        from fabric_lite.callbacks.checkpoint import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @fallback_property
    def progress_bar_callback(self) -> Optional["Callback"]:
        from fabric_lite.callbacks.progress import ProgressBarBase

        return next((c for c in self.callbacks if isinstance(c, ProgressBarBase)), None)

    @fallback_property
    def train_dataloader(self) -> Any:
        """None until fit() sets the training loader it runs."""
        return None

    @fallback_property
    def val_dataloaders(self) -> Any:
        """None until fit() sets the validation loaders it runs."""
        return None

    @fallback_property
    def limit_train_batches(self) -> Any:
        return self.limits["train"]

    @fallback_property
    def limit_val_batches(self) -> Any:
        return self.limits["validate"]

    @fallback_property
    def limit_test_batches(self) -> Any:
        return self.limits["test"]

    @fallback_property
    def limit_predict_batches(self) -> Any:
        return self.limits["predict"]

    def init_module(self, empty_init: Optional[bool] = None) -> Any:
        """Build the model inside this context: on the meta device under a strategy that shards parameters (or with
        empty_init=True), else on this process's device (the Accelerator's init_module)."""
        return self.accelerator.init_module(empty_init=empty_init)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the first process of each machine only."""
        if self.strategy.process.local_rank == 0:
            print(*args, **kwargs)


# -- TrainModule ---------------------------------------------------------------------------------------

_NO_LOOP_HOOK = "write the step in training_step/validation_step, or a Callback for what happens around it"
_STEP_OWNED = ("fabric_lite's step engine runs backward, clipping, the optimizer and scheduler steps and "
               "zero_grad in one order for every strategy")

#: TrainModule hooks and methods of Lightning that fabric_lite does not have: name -> (feature, instead). Calling
#: one raises; a module that overrides one is refused when fit, validate, test or predict starts.
REFUSED_MODULE_MEMBERS: Dict[str, Tuple[str, str]] = {
    "backward": (f"overriding LightningModule.backward ({_STEP_OWNED})", "use on_before_backward/on_after_backward, "
                 "or automatic_optimization = False and self.manual_backward(loss)"),
    "optimizer_step": (f"overriding optimizer_step ({_STEP_OWNED})", "use on_before_optimizer_step, or "
                       "automatic_optimization = False and step the optimizers yourself"),
    "optimizer_zero_grad": (f"overriding optimizer_zero_grad ({_STEP_OWNED})", "use automatic_optimization = False "
                            "and call zero_grad yourself"),
    "lr_scheduler_step": (f"overriding lr_scheduler_step ({_STEP_OWNED})", "give the scheduler's interval and "
                          "frequency in configure_optimizers, or step it yourself under manual optimization"),
    "configure_gradient_clipping": (f"overriding configure_gradient_clipping ({_STEP_OWNED})",
                                    "pass gradient_clip_val/gradient_clip_algorithm to the Trainer, or clip with "
                                    "self.clip_gradients under manual optimization"),
    "configure_sharded_model": ("configure_sharded_model (removed in Lightning 2)", "build the layers in "
                                "configure_model"),
    "on_validation_model_zero_grad": ("the on_validation_model_zero_grad hook", _NO_LOOP_HOOK),
    "to_onnx": ("LightningModule.to_onnx", "call torch.onnx.export(module, example_input, path) yourself"),
    "to_torchscript": ("LightningModule.to_torchscript", "call torch.jit.script(module.eval()) or torch.jit.trace"),
    "load_from_checkpoint": ("LightningModule.load_from_checkpoint", "build the module (Module(**hparams)) and "
                             "resume with trainer.fit(module, ckpt_path=...), or load exported weights with "
                             "module.load_state_dict"),
}


class ModuleLightningNames:
    """Lightning's names on TrainModule for what its Trainer holds, and the refused members (a mixin).

    No property here raises when read: `hasattr` and what walks a module's attributes (torch.jit.trace, which
    TensorBoardLogger(log_graph=True) runs) read every one of them."""

    _trainer: Any
    #: Properties torch.jit leaves alone when it scripts or traces the module (they read the Trainer).
    __jit_unused_properties__: List[str] = ["global_rank", "local_rank", "logger", "loggers", "on_gpu", "dtype",
                                            "fabric", "strict_loading", "hparams_initial", "prepare_data_per_node",
                                            "allow_zero_length_dataloader_with_multiple_devices"]

    @fallback_property
    def fabric(self) -> None:
        """None: the Trainer, not Lightning Fabric, runs this module (Lightning's value under its Trainer)."""
        return None

    @fallback_property
    def hparams_initial(self) -> Any:
        """The hyperparameters as `save_hyperparameters` recorded them (later changes to `hparams` not included);
        empty before it is called."""
        from fabric_lite.trainer.module import AttributeDict

        return AttributeDict()

    @fallback_property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @fallback_property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer is not None else 0

    @fallback_property
    def logger(self) -> Any:
        return self._trainer.logger if self._trainer is not None else None

    @fallback_property
    def loggers(self) -> List[Any]:
        return self._trainer.loggers if self._trainer is not None else []

    @fallback_property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"  # type: ignore[attr-defined]

    @fallback_property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter (float32 for a module without one)."""
        params = (p for p in self.parameters() if p.is_floating_point())  # type: ignore[attr-defined]
        first = next(params, None)
        return first.dtype if first is not None else torch.get_default_dtype()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode."""
        for param in self.parameters():  # type: ignore[attr-defined]
            param.requires_grad = False
        self.eval()  # type: ignore[attr-defined]

    def unfreeze(self) -> None:
        """Gradients for every parameter again, and train mode."""
        for param in self.parameters():  # type: ignore[attr-defined]
            param.requires_grad = True
        self.train()  # type: ignore[attr-defined]

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every process's tensors (in dicts, lists, tuples) stacked along a new first dimension of size
        world_size; on one process the data comes back as it is, as in Lightning."""
        if group is not None or sync_grads:
            raise NotSupportedError(message("all_gather", "gathering over a process subgroup or with gradients",
                                            "gather over every process without sync_grads"))
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return data
        return _map_tensors(data, lambda t: trainer.strategy.collectives.all_gather(t.detach().unsqueeze(0)))

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only `optimizer`'s parameters require gradients until `untoggle_optimizer` (for alternating optimizers,
        as a GAN's generator and discriminator steps)."""
        mine = {id(p) for group in _param_groups(optimizer) for p in group["params"]}
        saved: Dict[int, bool] = self.__dict__.setdefault("_toggled_requires_grad", {})
        for param in self.parameters():  # type: ignore[attr-defined]
            if id(param) not in mine:
                saved.setdefault(id(param), param.requires_grad)
                param.requires_grad = False

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give back each parameter the requires_grad it had before `toggle_optimizer`."""
        saved: Dict[int, bool] = self.__dict__.get("_toggled_requires_grad", {})
        for param in self.parameters():  # type: ignore[attr-defined]
            if id(param) in saved:
                param.requires_grad = saved.pop(id(param))

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[Any]:
        """`toggle_optimizer` for the block, `untoggle_optimizer` after it."""
        self.toggle_optimizer(optimizer)
        try:
            yield optimizer
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: Optional[float] = None,
                       gradient_clip_algorithm: Optional[str] = None) -> None:
        """Clip the gradients of `optimizer`'s parameters by norm (default) or value, through the Accelerator
        (it unscales mixed-precision gradients first); for manual optimization."""
        if gradient_clip_val is None:
            return
        if gradient_clip_algorithm not in (None, "norm", "value"):
            raise ValueError(f"clip_gradients(gradient_clip_algorithm={gradient_clip_algorithm!r}): use 'norm' or "
                             f"'value'.")
        params = [p for group in _param_groups(optimizer) for p in group["params"]]
        accelerator = self._trainer.accelerator
        if gradient_clip_algorithm == "value":
            accelerator.clip_grad_value_(params, gradient_clip_val)
        else:
            accelerator.clip_grad_norm_(params, gradient_clip_val)


#: Lightning's settings that hold one value here (prepare_data runs once, on the main process; a loader with no
#: batches on some process is refused): setting the other value raises.
_FIXED = {"prepare_data_per_node": False, "allow_zero_length_dataloader_with_multiple_devices": False,
          "strict_loading": True}
_FIXED_REFUSALS = {
    "strict_loading": ("checkpoints that load with missing or unexpected keys (strict_loading=False)",
                       "checkpoints always load strictly, every key matching; load partial weights with "
                       "module.load_state_dict(state, strict=False)"),
    "prepare_data_per_node": ("prepare_data on the first process of every machine (prepare_data_per_node=True)",
                              "prepare_data runs once, on the main process: write its files where every machine "
                              "reads them"),
    "allow_zero_length_dataloader_with_multiple_devices": (
        "loaders with no batches on some processes (allow_zero_length_dataloader_with_multiple_devices=True)",
        "give every process at least one batch (a smaller batch size or more samples)"),
}
REFUSED_MODULE_MEMBERS.update(_FIXED_REFUSALS)


def _add_refusals(mixin: type, owner: str, table: Dict[str, Tuple[str, str]]) -> None:
    for name, (feature, instead) in table.items():
        if name in _FIXED:
            member: Any = fixed_property(f"{owner}.{name}", _FIXED[name], feature, instead)
        else:
            member = refused(f"{owner}.{name}", feature, instead)
        setattr(mixin, name, member)


_add_refusals(ModuleLightningNames, "LightningModule", REFUSED_MODULE_MEMBERS)


# -- DataModule ----------------------------------------------------------------------------------------

REFUSED_DATAMODULE_MEMBERS: Dict[str, Tuple[str, str]] = {
    "from_datasets": ("LightningDataModule.from_datasets", "write a DataModule whose train_dataloader() and "
                      "val_dataloader() return DataLoaders over your datasets"),
    "load_from_checkpoint": ("LightningDataModule.load_from_checkpoint", "build the DataModule with its "
                             "arguments"),
    "on_exception": ("DataModule.on_exception", "write Callback.on_exception"),
    **_FIXED_REFUSALS,
}


class DataModuleLightningNames:
    """Lightning's names on DataModule, and the refused members (a mixin)."""

    #: Lightning's optional name of a DataModule.
    name: Optional[str] = None

    @fallback_property
    def trainer(self) -> Any:
        """None until a Trainer runs this DataModule (it sets itself here, as Lightning's does)."""
        return None

    hparams_initial = ModuleLightningNames.hparams_initial


_add_refusals(DataModuleLightningNames, "LightningDataModule", REFUSED_DATAMODULE_MEMBERS)


#: Hooks of automatic optimization: Lightning never calls them for a module that steps itself (manual optimization),
#: so overriding them there is harmless (Lightning's PPO template does).
_AUTOMATIC_ONLY = ("optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping")


def check_refused_overrides(*objects: Any) -> None:
    """Raise NotSupportedError when a module or datamodule overrides a member fabric_lite refuses (the Trainer
    would never call it)."""
    for obj in objects:
        for mixin, table in ((ModuleLightningNames, REFUSED_MODULE_MEMBERS),
                             (DataModuleLightningNames, REFUSED_DATAMODULE_MEMBERS)):
            if not isinstance(obj, mixin):
                continue
            # the library's own class (TrainModule, DataModule): a member it defines itself is not refused
            library = next(c for c in type(obj).__mro__ if c.__module__.startswith("fabric_lite."))
            manual = getattr(obj, "automatic_optimization", True) is False
            for name, (feature, instead) in table.items():
                default = getattr(library, name)
                if getattr(default, "refusal", None) is None or name in _FIXED:
                    continue
                if manual and name in _AUTOMATIC_ONLY:
                    continue  # (the module steps its optimizers itself: Lightning never calls these then)
                if getattr(type(obj), name) is not getattr(library, name):
                    raise NotSupportedError(message(f"{type(obj).__name__}.{name}", feature, instead))


def _param_groups(optimizer: Any) -> List[Mapping[str, Any]]:
    return list(getattr(optimizer, "param_groups", []))


def _map_tensors(data: Any, fn: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: _map_tensors(v, fn) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(v, fn) for v in data)
    return data

