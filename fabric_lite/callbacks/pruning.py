"""ModelPruning: prune weights with torch.nn.utils.prune at epoch ends, optionally resetting the survivors to
their initial values (lottery ticket), and make the pruning permanent when training ends and in checkpoints."""

from __future__ import annotations

import copy
import inspect
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import prune

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ModelPruning"]

log = logging.getLogger(__name__)

_FUNCTIONS: Dict[str, Callable[..., Any]] = {"ln_structured": prune.ln_structured, "l1_unstructured": prune.l1_unstructured,
              "random_structured": prune.random_structured, "random_unstructured": prune.random_unstructured}
_METHODS = {"ln_structured": prune.LnStructured, "l1_unstructured": prune.L1Unstructured,
            "random_structured": prune.RandomStructured, "random_unstructured": prune.RandomUnstructured}

ParamList = Sequence[Tuple[nn.Module, str]]
Amount = Union[int, float, Callable[[int], Union[int, float]]]
EpochFlag = Union[bool, Callable[[int], bool]]


class ModelPruning(Callback):
    """Prune `parameters_to_prune` (``[(module, "weight"), ...]``; every weight and bias of the model by default)
    at each train epoch end (or validation epoch end with ``prune_on_train_epoch_end=False``).

    `pruning_fn`: "l1_unstructured", "random_unstructured", "ln_structured" (needs `pruning_dim` and
    `pruning_norm`), "random_structured" (needs `pruning_dim`), or a `prune.BasePruningMethod` subclass (global
    only). `amount`: a fraction, a count, or a function of the epoch. With `use_global_unstructured` the amount
    counts over all the parameters together. `apply_pruning` and `use_lottery_ticket_hypothesis` may be functions
    of the epoch; the lottery ticket resets the surviving weights to their values when fit started (or to fresh
    ones with `resample_parameters`). `make_pruning_permanent` removes the masks when training ends and writes
    plain weights into checkpoints, so they load into a module that was never pruned. `verbose` 1 logs the
    overall sparsity, 2 also each parameter's.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(self, pruning_fn: Union[Callable, str], parameters_to_prune: ParamList = (),
                 parameter_names: Optional[List[str]] = None, use_global_unstructured: bool = True,
                 amount: Amount = 0.5, apply_pruning: EpochFlag = True, make_pruning_permanent: bool = True,
                 use_lottery_ticket_hypothesis: EpochFlag = True, resample_parameters: bool = False,
                 pruning_dim: Optional[int] = None, pruning_norm: Optional[int] = None, verbose: int = 0,
                 prune_on_train_epoch_end: bool = True) -> None:
        self._parameter_names = list(parameter_names or self.PARAMETER_NAMES)
        bad = [n for n in self._parameter_names if n not in self.PARAMETER_NAMES]
        if bad:
            raise ValueError(f"ModelPruning(parameter_names={parameter_names!r}): {bad} are not prunable here; allowed "
                             f"names are 'weight' and 'bias'.")
        self._use_global_unstructured = use_global_unstructured
        self._global_kwargs: Dict[str, Any] = {}
        if isinstance(pruning_fn, str):
            name = pruning_fn.lower()
            if name not in _FUNCTIONS:
                raise ValueError(f"ModelPruning(pruning_fn={pruning_fn!r}): allowed names are "
                                 f"{', '.join(map(repr, _FUNCTIONS))}, or pass a prune.BasePruningMethod subclass.")
            kwargs: Dict[str, Any] = {}
            if name.endswith("_structured"):
                if pruning_dim is None:
                    raise ValueError(f"ModelPruning(pruning_fn={pruning_fn!r}) prunes whole slices: pass "
                                     f"pruning_dim (e.g. 0: output units of a Linear).")
                if name == "ln_structured":
                    if pruning_norm is None:
                        raise ValueError("ModelPruning(pruning_fn='ln_structured') ranks slices by a norm: pass "
                                         "pruning_norm (e.g. 1 or 2).")
                    kwargs["n"] = pruning_norm
                kwargs["dim"] = pruning_dim
            self._method_name = name
            if use_global_unstructured:
                self._global_kwargs = kwargs
                method: Any = _METHODS[name]
            else:
                method = partial(_FUNCTIONS[name], **kwargs)
        elif inspect.isclass(pruning_fn) and issubclass(pruning_fn, prune.BasePruningMethod):
            if not use_global_unstructured:
                raise ValueError(f"ModelPruning(pruning_fn={pruning_fn.__name__}): a BasePruningMethod class prunes "
                                 f"globally only; pass use_global_unstructured=True.")
            self._method_name = pruning_fn.__name__
            method = pruning_fn
        else:
            raise TypeError(f"ModelPruning(pruning_fn={pruning_fn!r}) must be one of "
                            f"{', '.join(map(repr, _FUNCTIONS))} "
                            f"or a prune.BasePruningMethod subclass (the class, not an instance).")
        if use_global_unstructured and getattr(method, "PRUNING_TYPE", None) != "unstructured":
            raise ValueError(f"ModelPruning(pruning_fn={self._method_name!r}, use_global_unstructured=True): global "
                             f"pruning takes unstructured methods only; pass use_global_unstructured=False.")
        if not (callable(amount) or (isinstance(amount, (int, float)) and not isinstance(amount, bool))):
            raise TypeError(f"ModelPruning(amount={amount!r}) must be a fraction (float), a count (int), or a "
                            f"function of the epoch returning one.")
        if verbose not in (0, 1, 2):
            raise ValueError(f"ModelPruning(verbose={verbose!r}): allowed values are 0, 1 and 2.")
        self.pruning_fn = method
        self.amount = amount
        self._parameters_to_prune: ParamList = parameters_to_prune
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        self._verbose = verbose
        self._original_layers: Optional[Dict[int, Dict[str, Any]]] = None
        self._save_hook: Any = None

    # -- which parameters ----------------------------------------------------------------------------
    def filter_parameters_to_prune(self, parameters_to_prune: ParamList = ()) -> ParamList:
        """Override to choose among the parameters to prune."""
        return parameters_to_prune

    @staticmethod
    def sanitize_parameters_to_prune(module: nn.Module, parameters_to_prune: ParamList = (),
                                     parameter_names: Sequence[str] = ()) -> ParamList:
        """`parameters_to_prune` checked against `module`, or, when empty, each layer's `parameter_names`."""
        names = list(parameter_names or ModelPruning.PARAMETER_NAMES)
        containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
        layers = [m for m in module.modules() if m is not module and not isinstance(m, containers)]
        if not parameters_to_prune:
            return [(m, n) for n in names for m in layers if isinstance(getattr(m, n, None), nn.Parameter)]
        if not isinstance(parameters_to_prune, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], nn.Module) and isinstance(p[1], str)
                for p in parameters_to_prune):
            raise TypeError(f"ModelPruning(parameters_to_prune=...) must be a list of (module, parameter name) "
                            f"pairs such as [(model.fc1, 'weight')]; got {parameters_to_prune!r}.")
        known = {id(m) for m in layers}
        missing = [f"{type(m).__name__}.{n}" for m, n in parameters_to_prune
                   if id(m) not in known or not hasattr(m, n)]
        if missing:
            raise ValueError(f"ModelPruning(parameters_to_prune=...): {missing} are not parameters of "
                             f"{type(module).__name__}; name layers of the module given to fit().")
        return list(parameters_to_prune)

    # -- pruning -------------------------------------------------------------------------------------
    def apply_pruning(self, amount: Union[int, float]) -> None:
        """Prune `parameters_to_prune` by `amount` now (on top of earlier pruning)."""
        before = [_pruned(m, n) for m, n in self._parameters_to_prune] if self._verbose else []
        if self._use_global_unstructured:
            kwargs = {**self._global_kwargs, "amount": amount}
            accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
            prune.global_unstructured(self._parameters_to_prune, pruning_method=self.pruning_fn,
                                      **{k: v for k, v in kwargs.items() if k in accepted})
        else:
            for module, name in self._parameters_to_prune:
                self.pruning_fn(module, name=name, amount=amount)
        if self._verbose:
            self._log_sparsity(before, [_pruned(m, n) for m, n in self._parameters_to_prune], amount)

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Reset the surviving weights to their values when fit started (fresh ones with `resample_parameters`)."""
        assert self._original_layers is not None
        for entry in self._original_layers.values():
            source = entry["data"]
            if self._resample_parameters and callable(getattr(source, "reset_parameters", None)):
                source = copy.deepcopy(source)
                source.reset_parameters()
            for index, name in entry["names"]:
                target, _ = self._parameters_to_prune[index]
                live = getattr(target, f"{name}_orig", None)
                if live is None:
                    live = getattr(target, name)
                with torch.no_grad():
                    live.copy_(getattr(source, name).to(live.device))

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Fold each mask into its weight and remove the pruning hooks (plain parameters again)."""
        pruned = self._parameters_to_prune or self.sanitize_parameters_to_prune(module, (), self._parameter_names)
        for layer, name in pruned:
            if hasattr(layer, f"{name}_orig"):
                prune.remove(layer, name)

    def _run(self, epoch: int) -> None:
        wanted = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not wanted or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        if lottery(epoch) if callable(lottery) else lottery:
            self.apply_lottery_ticket_hypothesis()

    # -- hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        chosen = self.sanitize_parameters_to_prune(module, self._parameters_to_prune, self._parameter_names)
        self._parameters_to_prune = self.filter_parameters_to_prune(chosen)
        if self._use_lottery_ticket_hypothesis:
            self._original_layers = {}
            for index, (layer, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(layer), {"data": _copy_layer(layer), "names": []})
                entry["names"].append((index, name))
        if self._make_pruning_permanent and self._save_hook is None:
            self._save_hook = trainer.accelerator.register_save_state_pre_hook(_fold_masks_in_saved_weights)

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self._save_hook is not None:
            self._save_hook.remove()
            self._save_hook = None

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._prune_on_train_epoch_end:
            self._run(trainer.current_epoch)

    def on_validation_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not trainer.sanity_checking and not self._prune_on_train_epoch_end:
            with torch.inference_mode(False):  # validation may run under inference mode: masks must train on
                self._run(trainer.current_epoch)

    def on_train_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(module)

    def _log_sparsity(self, before: List[Tuple[int, int]], after: List[Tuple[int, int]], amount: Any) -> None:
        total = sum(n for _, n in after)
        was, now = sum(z for z, _ in before), sum(z for z, _ in after)
        log.info("Applied `%s`. Pruned: %d/%d (%.2f%%) -> %d/%d (%.2f%%)", self._method_name, was, total,
                 100 * was / total, now, total, 100 * now / total)
        if self._verbose == 2:
            for (module, name), (z0, n0), (z1, n1) in zip(self._parameters_to_prune, before, after):
                log.info("Applied `%s` to `%r.%s` with amount=%s. Pruned: %d (%.2f%%) -> %d (%.2f%%)",
                         self._method_name, module, name, amount, z0, 100 * z0 / n0, z1, 100 * z1 / n1)


def _pruned(module: nn.Module, name: str) -> Tuple[int, int]:
    """(zeros in the mask, its size); (0, 1) where the parameter has no mask yet."""
    mask = getattr(module, f"{name}_mask", None)
    return (0, 1) if mask is None else (int((mask == 0).sum()), mask.numel())


def _copy_layer(layer: nn.Module) -> nn.Module:
    """A deep copy of `layer`; the pruned weight a forward left on it (not a leaf tensor) is copied detached."""
    computed = {k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and not v.is_leaf}
    for k, v in computed.items():
        vars(layer)[k] = v.detach()
    try:
        return copy.deepcopy(layer)
    finally:
        vars(layer).update(computed)


def _fold_masks_in_saved_weights(models: Any, weights: List[Any], output_dir: str) -> None:
    """A save_state pre-hook: in the weights being saved, `x_orig` * `x_mask` becomes `x`, so the checkpoint holds
    plain weights (training goes on with its masks)."""
    for state in weights:
        if not isinstance(state, dict):
            continue
        for key in [k for k in state if k.endswith("_mask")]:
            base = key[:-len("_mask")]
            if f"{base}_orig" in state:
                orig, mask = state.pop(f"{base}_orig"), state.pop(key)
                state[base] = orig * mask.to(orig.dtype)
