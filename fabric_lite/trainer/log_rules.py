"""Which hooks may call `self.log`, with which `on_step`/`on_epoch`, and how a logged value is checked.

The rules are Lightning's: per-batch training hooks log per step by default, per-batch evaluation
hooks per epoch, epoch-level hooks only per epoch, and the rest (fit start/end, predict, checkpoint
hooks, ...) not at all.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Optional, Tuple

import torch

from fabric_lite._tree import batch_size_of, first_tensor

__all__ = ["HookRule", "hook_rule", "check_levels", "STEP_HOOKS", "parse_reduce_fx", "as_scalar_tensor",
           "infer_batch_size", "is_metric", "DATALOADER_SUFFIX"]

DATALOADER_SUFFIX = "/dataloader_idx_"
REDUCTIONS = ("mean", "sum", "max", "min")


class HookRule:
    """What `self.log` may do inside one hook: the allowed and default `on_step`/`on_epoch`."""

    __slots__ = ("step_allowed", "epoch_allowed", "step_default", "epoch_default")

    def __init__(self, step_allowed: Tuple[bool, ...], epoch_allowed: Tuple[bool, ...], step_default: bool,
                 epoch_default: bool) -> None:
        self.step_allowed, self.epoch_allowed = step_allowed, epoch_allowed
        self.step_default, self.epoch_default = step_default, epoch_default


_TRAIN_BATCH = HookRule((False, True), (False, True), True, False)
_EVAL_BATCH = HookRule((False, True), (False, True), False, True)
_EPOCH = HookRule((False,), (True,), False, True)

_RULES: Dict[str, Optional[HookRule]] = {}
for _name in ("training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "backward",
              "on_after_backward", "on_before_optimizer_step", "optimizer_step", "configure_gradient_clipping",
              "clip_gradients", "on_before_zero_grad", "optimizer_zero_grad"):
    _RULES[_name] = _TRAIN_BATCH
for _name in ("validation_step", "test_step", "on_validation_batch_start", "on_validation_batch_end",
              "on_test_batch_start", "on_test_batch_end"):
    _RULES[_name] = _EVAL_BATCH
for _name in ("on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_validation_start",
              "on_validation_epoch_start", "on_validation_epoch_end", "on_test_start", "on_test_epoch_start",
              "on_test_epoch_end"):
    _RULES[_name] = _EPOCH


def hook_rule(name: str, fx: Optional[str]) -> HookRule:
    """The rule of hook `fx` for a `self.log(name)` call; a clear error where logging is not allowed."""
    rule = _RULES.get(fx) if fx is not None else None
    if rule is not None:
        return rule
    if fx is None:
        raise RuntimeError(
            f"self.log({name!r}) was called outside the Trainer's loops; log from training_step, validation_step, "
            f"test_step or their batch/epoch hooks while trainer.fit/validate/test runs.")
    if fx.startswith("predict") or "_predict_" in fx:
        raise RuntimeError(
            f"self.log({name!r}) was called in {fx}: prediction does not log (as in Lightning). Return the value "
            f"from predict_step (trainer.predict collects it), or write it yourself with a prediction writer callback.")
    raise RuntimeError(
        f"self.log({name!r}) was called in {fx}, where logging is not allowed (as in Lightning). Log from "
        f"training_step, validation_step, test_step, their batch hooks, or on_train_epoch_end / "
        f"on_validation_epoch_end / on_test_epoch_end; or write to the logger directly.")


#: The hooks that run once per batch (their step values are current while they run).
STEP_HOOKS = frozenset(name for name, rule in _RULES.items() if rule is not _EPOCH)


def check_levels(name: str, fx: str, rule: HookRule, on_step: bool, on_epoch: bool) -> None:
    """Refuse an `on_step`/`on_epoch` that hook `fx` does not allow, and the pair (False, False)."""
    if on_step not in rule.step_allowed:
        raise ValueError(f"self.log({name!r}, on_step={on_step}) is not allowed in {fx}: an epoch-level hook logs "
                         f"once per epoch. Drop on_step (or pass on_step=False).")
    if on_epoch not in rule.epoch_allowed:
        raise ValueError(f"self.log({name!r}, on_epoch={on_epoch}) is not allowed in {fx}: an epoch-level hook "
                         f"logs once per epoch. Drop on_epoch (or pass on_epoch=True).")
    if not on_step and not on_epoch:
        raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) records nothing; set on_step=True "
                         f"(a value per step) and/or on_epoch=True (one aggregate per epoch).")


_CALLABLE_REDUCTIONS: Dict[Any, str] = {torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max",
                                        max: "max", torch.min: "min", min: "min"}


def parse_reduce_fx(name: str, reduce_fx: Any) -> str:
    """`reduce_fx` as one of mean/sum/max/min: a string (any case, "avg" = "mean") or torch.mean/sum/max/min."""
    found: Optional[str]
    if isinstance(reduce_fx, str):
        found = "mean" if reduce_fx.lower() == "avg" else reduce_fx.lower()
        if found in REDUCTIONS:
            return found
    else:
        try:
            found = _CALLABLE_REDUCTIONS.get(reduce_fx)
        except TypeError:  # unhashable
            found = None
        if found is not None:
            return found
    shown = getattr(reduce_fx, "__name__", None) or repr(reduce_fx)
    raise ValueError(
        f"self.log({name!r}, reduce_fx={shown}): allowed reductions are 'mean', 'sum', 'max', 'min' (or torch.mean, "
        f"torch.sum, torch.max, torch.min). For another reduction, log a torchmetrics Metric that computes it.")


def is_metric(value: Any) -> bool:
    """A torchmetrics Metric (told by its methods, so torchmetrics is imported only by the user)."""
    return callable(getattr(value, "compute", None)) and callable(getattr(value, "reset", None)) \
        and callable(getattr(value, "update", None)) and isinstance(value, torch.nn.Module)


def as_scalar_tensor(name: str, value: Any, device: torch.device, enable_graph: bool) -> torch.Tensor:
    """A logged number or one-element tensor as a 0-dim floating tensor (detached unless `enable_graph`)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; a logged tensor must have one "
                f"element. Reduce it first, e.g. self.log({name!r}, value.mean()), or log a torchmetrics Metric.")
        if not enable_graph:
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        return value if value.dtype in (torch.float32, torch.float64) else value.float()
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        # (typeshed's Number has no __float__; every Number but complex has one: int, float, Fraction, Decimal, numpy's)
        return torch.tensor(float(value), device=device)  # type: ignore[arg-type]
    if isinstance(value, dict):
        raise ValueError(f"self.log({name!r}) got a dict; log several values with self.log_dict({{...}}).")
    raise ValueError(
        f"self.log({name!r}) got a {type(value).__name__}; log a number, a one-element tensor or a torchmetrics "
        f"Metric.")


def infer_batch_size(name: str, batch: Any) -> int:
    """The current batch's size for weighting an epoch mean: the first dimension of its first tensor."""
    if batch is None:
        return 1  # (outside a batch, e.g. an epoch-end hook)
    size = batch_size_of(batch)
    if size is not None:
        return size
    tensor = first_tensor(batch)
    if tensor is not None:  # a 0-dim tensor is one sample
        return 1
    raise ValueError(
        f"self.log({name!r}) needs the batch size to weigh the epoch mean, and the batch ({type(batch).__name__}) "
        f"holds no tensor to read it from. Pass it: self.log({name!r}, value, batch_size=...).")

