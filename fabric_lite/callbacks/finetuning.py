"""BaseFinetuning and BackboneFinetuning: freeze parts of a model before training, unfreeze them later into
their own optimizer parameter group."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["BaseFinetuning", "BackboneFinetuning", "multiplicative"]

log = logging.getLogger(__name__)

Modules = Union[nn.Module, Iterable[Any]]


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default: the backbone's learning rate doubles each epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Subclass it: `freeze_before_training(module)` freezes (runs in setup, before the first batch), and
    `finetune_function(module, epoch, optimizer)` unfreezes at the start of each epoch, typically with
    `unfreeze_and_add_param_group`.

    The Trainer builds the optimizers before callbacks' setup, so parameters that `freeze_before_training`
    freezes are taken out of the optimizers' groups then, as a ``filter(lambda p: p.requires_grad, ...)`` in
    `configure_optimizers` would have done. The groups added later are saved with the callback's state and
    rebuilt before a checkpoint's optimizer state loads, so a resumed run goes on with them.
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: Dict[int, List[Dict[str, Any]]] = {}
        self._restore_handle: Any = None

    # -- what subclasses write ---------------------------------------------------------------------
    def freeze_before_training(self, pl_module: "TrainModule") -> None:
        """Freeze the modules that start frozen (override)."""
        raise NotImplementedError(f"{type(self).__name__} must define freeze_before_training(module).")

    def finetune_function(self, pl_module: "TrainModule", epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Unfreeze what this epoch trains (override)."""
        raise NotImplementedError(f"{type(self).__name__} must define finetune_function(module, epoch, optimizer).")

    # -- the tools ---------------------------------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> List[nn.Module]:
        """The leaf modules under `modules` (a module, a ModuleDict or nested iterables of them), and the parents
        that hold parameters of their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = list(modules.values())
        if isinstance(modules, nn.Module):
            found: Iterable[nn.Module] = modules.modules()
        else:
            found = [m for item in modules for m in BaseFinetuning.flatten_modules(item)]
        return [m for m in found if not list(m.children()) or list(m.parameters(recurse=False))]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of `modules` whose requires_grad is `requires_grad` (BatchNorm's left out unless
        `train_bn`)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):  # (each parameter once: parents hold only their own)
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of `modules` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze `module`'s own parameters (a BatchNorm layer also stops tracking running statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze `modules`; their BatchNorm layers stay trainable when `train_bn`."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
        """`params` less those `optimizer` already holds (warns when there are such: they stay in their group)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        kept = [p for p in params if id(p) not in held]
        if len(kept) != len(params):
            log.warning("%d parameter(s) to unfreeze are already in the optimizer and stay in their group; build the "
                        "optimizer over trainable parameters only: %s(filter(lambda p: p.requires_grad, "
                        "self.parameters()), ...)", len(params) - len(kept), type(optimizer).__name__)
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: torch.optim.Optimizer, lr: Optional[float] = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze `modules` and add their parameters to `optimizer` as a new group, at `lr`, or without one at
        the first group's learning rate divided by `initial_denom_lr`."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})

    # -- the hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        if trainer.strategy.engine_step is not None:
            raise RuntimeError(f"{type(self).__name__}: {type(trainer.strategy).__name__} builds its engine over the "
                               f"optimizer's parameter groups once, so groups cannot be added later. Use another "
                               f"strategy, or drop the callback.")
        wrapped = trainer.model
        if isinstance(wrapped, nn.parallel.DistributedDataParallel) and not wrapped.find_unused_parameters:
            raise ValueError(
                f"{type(self).__name__} under DDP: the frozen parameters get no gradients, which DDP refuses unless "
                f"told: Trainer(strategy='ddp_find_unused_parameters_true') (or DDPStrategy(find_unused_parameters="
                f"True)). Otherwise the layers unfrozen later would train without being averaged between processes.")
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.freeze_before_training(module)
        frozen = {id(p) for p in trainable if not p.requires_grad}
        for opt in trainer.optimizers:  # (no step taken yet: no optimizer state to move)
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in frozen]
        self._restore_handle = trainer.accelerator.register_load_state_pre_hook(
            lambda models, url: self._restore_groups(trainer, module, url))

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self._restore_handle is not None:
            self._restore_handle.remove()
            self._restore_handle = None

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            before = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, index, before, optimizer.param_groups)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._internal_optimizer_metadata = {int(k): v for k, v in state["internal_optimizer_metadata"].items()}

    def _store(self, module: nn.Module, index: int, before: int, groups: List[Dict[str, Any]]) -> None:
        """Note the groups (parameters by name) of optimizer `index`: all of them the first time, then the new ones."""
        names = {id(p): n for n, p in module.named_parameters()}
        described = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                     for g in groups]
        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = described
        elif len(groups) != before:
            self._internal_optimizer_metadata[index].extend(described[before:])

    def _restore_groups(self, trainer: "Trainer", module: nn.Module, url: str) -> None:
        """Before a checkpoint's optimizer state loads: rebuild the parameter groups it was saved with (the groups
        this callback added, their parameters trainable again)."""
        saved = _saved_callback_state(url, self.state_key)
        if saved is None:
            return
        metadata = {int(k): v for k, v in saved["internal_optimizer_metadata"].items()}
        params = dict(module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index not in metadata:
                continue
            groups = []
            for described in metadata[index]:
                group = {k: v for k, v in described.items() if k != "params"}
                group["params"] = [params[name] for name in described["params"]]
                for p in group["params"]:
                    p.requires_grad = True
                groups.append(group)
            optimizer.param_groups = groups


class BackboneFinetuning(BaseFinetuning):
    """Train `module.backbone` from epoch `unfreeze_backbone_at_epoch` on, in its own parameter group.

    Its learning rate starts at `backbone_initial_lr`, or the first group's rate times `backbone_initial_ratio_lr`,
    and is multiplied by ``lambda_func(epoch + 1)`` at each later epoch start; with `should_align` it is held at the
    first group's rate once it would pass it.
    """

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: Optional[float] = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        if not isinstance(unfreeze_backbone_at_epoch, int) or unfreeze_backbone_at_epoch < 0:
            raise ValueError(f"BackboneFinetuning(unfreeze_backbone_at_epoch={unfreeze_backbone_at_epoch!r}) must be "
                             f"an epoch number >= 0.")
        if not callable(lambda_func):
            raise TypeError(f"BackboneFinetuning(lambda_func={lambda_func!r}) must be a function of the epoch that "
                            f"returns the learning-rate factor, e.g. lambda epoch: 1.5.")
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: Optional[float] = None

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.previous_backbone_lr = state["previous_backbone_lr"]
        super().load_state_dict(state)

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage == "fit" and not isinstance(getattr(module, "backbone", None), nn.Module):
            raise ValueError(f"BackboneFinetuning needs a module with a `backbone` attribute that is an nn.Module; "
                             f"{type(module).__name__} has none. Name the part to finetune `self.backbone`, or "
                             f"subclass BaseFinetuning.")
        super().setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: "TrainModule") -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: "TrainModule", epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                           else current_lr * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = backbone_lr
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, backbone_lr, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
            self.previous_backbone_lr = backbone_lr
        else:
            return
        if self.verbose:
            log.info("Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding),
                     round(backbone_lr, self.rounding))


def _saved_callback_state(url: str, key: str) -> Optional[Dict[str, Any]]:
    """The state a callback saved under `key` in the checkpoint at `url`, or None."""
    from fabric_lite.checkpoint.files import read_manifest
    from fabric_lite.checkpoint.loading import load_file
    from fabric_lite.checkpoint.restore import TRAINING_STATE

    state = load_file(url, TRAINING_STATE, read_manifest(url))
    for entry in state.get("custom", []):
        if isinstance(entry, dict) and isinstance(entry.get("callbacks"), dict) and key in entry["callbacks"]:
            return entry["callbacks"][key]
    return None
