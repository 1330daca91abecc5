"""ONE step engine under both doors: the accumulation window, no-sync, loss scaling by the window,
backward, unscale, clipping, optimizer step (with the strategy's step marker), scheduler step, zero_grad.

`StepEngine` is the part of the `Accelerator` that runs a micro-step; the `Trainer` drives the same
object (``trainer.accelerator``), so a fix to the step lands in both doors at once. The only place
the doors differ is `divide_loss_by`:

* ``"gradient_accumulation_steps"`` (the Accelerator's default, as Hugging Face Accelerate documents
  it): every micro-step's loss is divided by the configured number of steps, also in the last,
  shorter window of an epoch.
* ``"window"`` (the Trainer's): the loss is divided by the real length of its window, so a shorter
  last window averages its micro-batches as a longer one does. The window's length is known when
  the loader's length is; without one (an iterable dataset) the last window still closes at the
  loader's end, its micro-steps divided by the configured number of steps.

A window is counted in one of two ways. The Accelerator counts calls of `accumulate()` (Accelerate's
`accelerator.step`), and a window also ends at the last batch of the active prepared loader. The
Trainer knows each batch's index in the epoch and the epoch's batch limit and passes them, so a
window also ends at `limit_train_batches` and a resumed epoch keeps its windows where they were.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, List, Optional, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from fabric_lite.strategies.base import Strategy

__all__ = ["GradientState", "StepEngine", "LOSS_DIVISIONS"]

LOSS_DIVISIONS = ("gradient_accumulation_steps", "window")

# The micro-step that closes a window syncs as usual: one reusable do-nothing context.
_SYNCS = contextlib.nullcontext()


@dataclass
class GradientState:
    """What the step needs to know now: do gradients sync on this micro-step, is the active loader at
    its last batch? Prepared loaders report entering, reaching their last batch and leaving."""

    sync_gradients: bool = True
    end_of_dataloader: bool = False
    remainder: int = -1
    active: List[Any] = field(default_factory=list)

    def enter(self, loader: Any) -> None:
        self.active.append(loader)
        self.end_of_dataloader = False
        self.remainder = loader.remainder

    def mark_last(self) -> None:
        self.end_of_dataloader = True

    def leave(self, loader: Any) -> None:
        if loader in self.active:
            self.active.remove(loader)
        outer = self.active[-1] if self.active else None
        self.end_of_dataloader = outer.end_of_dataloader if outer is not None else False
        self.remainder = outer.remainder if outer is not None else -1


class StepEngine:
    """Micro-steps for one set of prepared models and optimizers (mixed into `Accelerator`).

    Holds the prepared objects (`models`, `optimizers`, `schedulers`) and the window state; every
    device, precision and communication decision goes to `strategy`.
    """

    strategy: "Strategy"

    def init_engine(self, strategy: "Strategy", accumulation: Any, divide_loss_by: str) -> None:
        """`accumulation` has `num_steps`, `sync_with_dataloader` and `sync_each_batch` (Accelerate's
        GradientAccumulationPlugin)."""
        if divide_loss_by not in LOSS_DIVISIONS:
            raise ValueError(f"divide_loss_by={divide_loss_by!r} is not valid: allowed values are "
                             f"{', '.join(map(repr, LOSS_DIVISIONS))}.")
        self.strategy = strategy
        self.gradient_accumulation_plugin = accumulation
        self.divide_loss_by = divide_loss_by
        self.gradient_state = GradientState()
        self.step = 0  # micro-steps counted by accumulate() since the last window closed at a loader's end
        self.loss_divisor = 1  # under divide_loss_by="window": what backward() divides this micro-step's loss by
        self.models: List[nn.Module] = []
        self.optimizers: List[Any] = []
        self.schedulers: List[Any] = []

    # -- the window --------------------------------------------------------------------------------
    def begin_micro_step(self, index: Optional[int] = None, length: Optional[int] = None,
                         models: Sequence[nn.Module] = ()) -> ContextManager:
        """Start a micro-step; returns the context its forward and backward run in (no gradient sync
        unless it closes the window). Whether it closes the window (gradients sync, optimizers step)
        is `gradient_state.sync_gradients` from here on.

        `index` is the batch's place in the epoch and `length` the epoch's number of batches (None:
        unknown), when the caller knows them; without them micro-steps are counted here.
        """
        n = self.gradient_accumulation_plugin.num_steps
        state = self.gradient_state
        if index is None:  # counted here: the window's own position, and what the loader has left
            position = self.step % n  # this micro-step's place in its window
            if self.gradient_accumulation_plugin.sync_with_dataloader and state.end_of_dataloader:
                closes = True
                self.step = 0
            else:
                self.step += 1
                closes = self.step % n == 0
            left = None
            if n > 1 and self.divide_loss_by == "window" and self.gradient_accumulation_plugin.sync_with_dataloader:
                left = self._batches_left()
            # (a window that a loader's end closes early holds this micro-step, the ones before it and what is left)
            self.loss_divisor = n if left is None else max(1, min(n, position + 1 + left))
        else:
            closes = (index + 1) % n == 0 or (length is not None and index + 1 >= length) \
                or state.end_of_dataloader
            if length is not None and self.divide_loss_by == "window":
                self.loss_divisor = max(1, min(n, length - (index - index % n)))
            else:
                self.loss_divisor = n
        state.sync_gradients = closes
        return _SYNCS if closes else self.sync_context(models)

    def _batches_left(self) -> Optional[int]:
        """Batches the active prepared loader has left in this epoch after the current one, if known."""
        state = self.gradient_state
        return state.active[-1].batches_left() if state.active else None

    def sync_context(self, models: Sequence[nn.Module] = ()) -> ContextManager:
        """No gradient all-reduce on a micro-step that does not close its window (the current one)."""
        strategy = self.strategy
        if self.gradient_state.sync_gradients:
            return _SYNCS
        # An engine that owns the window (DeepSpeed) must always hear that a micro-step does not end it;
        # otherwise sync_each_batch all-reduces every micro-step (saves memory) but still steps every N.
        engine_step = strategy.engine_step
        if engine_step is not None:
            return engine_step.micro_step()
        if self.gradient_accumulation_plugin.sync_each_batch:
            return _SYNCS
        if len(models) == 1:
            return strategy.no_backward_sync(models[0])
        stack = contextlib.ExitStack()
        for m in models:
            stack.enter_context(strategy.no_backward_sync(m))
        return stack

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients sync (and the optimizers step) only every N-th time, and at the
        last batch of the dataloader."""
        with self.begin_micro_step(models=models):
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce for backward passes inside this context."""
        with self.strategy.no_backward_sync(model):
            yield

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Inside `no_sync`, make the next backward all-reduce gradients after all."""
        return self.strategy.force_backward_sync(model)

    # -- backward ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        """`loss.backward()` with loss scaling, divided as `divide_loss_by` says on accumulation steps.

        Under "gradient_accumulation_steps" the loss is divided whether or not `accumulate()` is used
        (scripts that accumulate with `no_sync` themselves), as in Accelerate.
        """
        divisor = self.loss_divisor if self.divide_loss_by == "window" else self.gradient_accumulation_plugin.num_steps
        if divisor > 1:
            loss = loss / divisor
        if self.loss_watch is not None:  # (watch_losses(): note a non-finite loss for step_is_finite)
            loss = self.note_loss(loss)
        try:
            self.strategy.backward(loss, model if model is not None else (self.models[0] if self.models else None),
                                   **kwargs)
        except (RuntimeError, AttributeError, AssertionError) as err:  # checked only on failure: not on the hot path
            if not isinstance(loss, torch.Tensor) or (loss.numel() != 1 and "gradient" not in kwargs):
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(
                    f"backward() needs a scalar loss tensor, got {shape}. Reduce it first, e.g. loss.mean() "
                    f"or loss.sum()."
                ) from err
            raise

    # -- non-finite losses, decided by every process together ----------------------------------------
    #: Whether a loss noted by backward() since the last `step_is_finite()` was non-finite (a bool tensor on the
    #: device, no host read); None: backward() notes nothing (`watch_losses()` turns it on).
    loss_watch: Optional[torch.Tensor] = None

    def watch_losses(self, enabled: bool = True) -> None:
        """From now on backward() notes whether each loss is finite, for `step_is_finite()` (off by default: it
        costs a few operations per backward)."""
        self.loss_watch = torch.zeros((), dtype=torch.bool, device=self.strategy.root_device) if enabled else None

    def note_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Note whether `loss` is finite; the loss to run backward on. Where the gradients are averaged in backward
        (DDP) a non-finite loss is multiplied by NaN, so that every process's averaged gradients carry it."""
        finite = torch.isfinite(loss.detach()).all()
        watch = self.loss_watch
        self.loss_watch = ~finite if watch is None else watch | ~finite
        if self.decides_in_backward():
            loss = loss * torch.where(finite, torch.ones((), device=loss.device),
                                      torch.full((), float("nan"), device=loss.device)).to(loss.dtype)
        return loss

    def decides_in_backward(self) -> bool:
        """Whether the gradient all-reduce of backward carries a process's non-finite loss to every process: DDP
        models (gradients replicated) without a loss scaler (whose own skip would see the NaN first)."""
        models = self.models
        return bool(models) and self.strategy.precision.scaler is None and self.strategy.world_size > 1 and all(
            isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in models)

    def step_is_finite(self, optimizers: Optional[Sequence[Any]] = None) -> bool:
        """Whether every process may take this optimizer step, decided by all of them alike: False where a loss
        noted by backward() (`watch_losses()`) or a gradient of the prepared models is non-finite on any process.
        Then every process has dropped its gradients (`zero_grad` of `optimizers`, all prepared ones by default):
        skip `optimizer.step()`, `scheduler.step()` (and so the scaler's update) on every process::

            accelerator.watch_losses()
            for batch in loader:
                accelerator.backward(model(batch))
                if accelerator.step_is_finite():
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad()

        Under DDP the gradient all-reduce backward makes carries the decision (no collective of its own); elsewhere
        one all-reduce of one flag decides. Under a loss scaler the (scaled) gradients are the scaler's to judge:
        only the losses count."""
        strategy = self.strategy
        device = strategy.root_device
        watch = self.loss_watch
        fused = self.decides_in_backward()
        bad = torch.zeros((), dtype=torch.bool, device=device) if watch is None or fused else watch.to(device)
        if strategy.precision.scaler is None:
            for model in self.models:
                for p in model.parameters():
                    if p.grad is not None:
                        bad = bad | ~torch.isfinite(p.grad.detach()).all().to(device)
        if watch is not None:
            self.loss_watch = torch.zeros((), dtype=torch.bool, device=device)
        if strategy.world_size > 1 and not fused:
            bad = strategy.collectives.all_reduce(bad.float().reshape(1), "max")[0] > 0
        if not bool(bad):
            return True
        for opt in (self.optimizers if optimizers is None else optimizers):
            opt.zero_grad(set_to_none=True)
        return False

    # -- unscale and clip --------------------------------------------------------------------------
    def unscale_gradients(self, optimizer: Optional[Any] = None) -> None:
        """Bring fp16 gradients back to their true scale (all prepared optimizers by default)."""
        for opt in ([optimizer] if optimizer is not None else self.optimizers):
            self.strategy.precision.unscale_gradients(getattr(opt, "optimizer", opt))

    def clip_gradients(self, parameters: Any, max_norm: Optional[float] = None, norm_type: float = 2.0,
                       clip_value: Optional[float] = None, optimizer: Optional[Any] = None) -> Optional[torch.Tensor]:
        """Clip by norm (`max_norm`) or by value (`clip_value`) after unscaling; the norm, or None.

        On a micro-step that does not close its window the gradients are incomplete: nothing is clipped.
        """
        if not self.gradient_state.sync_gradients:
            return None
        self.unscale_gradients(optimizer)
        params = list(parameters)
        if clip_value is None and max_norm is None:
            raise TypeError("clip_gradients() needs max_norm or clip_value.")
        return self.strategy.clip_gradients(params, None, max_norm=max_norm, norm_type=norm_type, clip_value=clip_value)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """Clip the gradient norm (after unscaling fp16 gradients); returns the total norm.

        On an accumulation micro-step the gradients are incomplete, so nothing is clipped and None is
        returned; clipping happens on the step whose gradients the optimizer uses.
        """
        return self.clip_gradients(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.clip_gradients(parameters, clip_value=clip_value)

    # -- the optimizer step ------------------------------------------------------------------------
    def step_optimizers(self, optimizers: Sequence[Any], clip_val: Optional[float] = None,
                        clip_algorithm: str = "norm", before_step: Optional[Callable[[Any], None]] = None,
                        before_zero_grad: Optional[Callable[[Any], None]] = None) -> None:
        """Close a window: for each optimizer clip (optionally), call `before_step(opt)`, step,
        `before_zero_grad(opt)`, zero_grad."""
        for opt in optimizers:
            if clip_val is not None:
                params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
                if clip_algorithm == "norm":
                    self.clip_gradients(params, clip_val, optimizer=opt)
                else:
                    self.clip_gradients(params, clip_value=clip_val, optimizer=opt)
            if before_step is not None:
                before_step(opt)
            opt.step()
            if before_zero_grad is not None:
                before_zero_grad(opt)
            opt.zero_grad(set_to_none=True)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self.optimizers)
