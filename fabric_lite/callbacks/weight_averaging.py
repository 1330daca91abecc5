"""Weight averaging through both doors: an averaged copy of a module's weights (EMA, SWA or a function of your own),
updated after optimizer steps, used for validation and copied into the module when fit ends, and saved with the
checkpoint so that a resumed run goes on exactly.

Trainer door (Lightning's callbacks and their semantics): `WeightAveraging(avg_fn=..., multi_avg_fn=..., device=...,
use_buffers=True)`, `EMAWeightAveraging(decay=0.999, update_every_n_steps=1, update_starting_at_step=None,
update_starting_at_epoch=None)` and `StochasticWeightAveraging(swa_lrs=...)`.

Raw door: `WeightAverage(model, ...)` and `ExponentialMovingAverage(model, decay=...)` (`averaged_weights.py`, also
importable from here and from `fabric_lite.utils`).

The average is kept like the model: where the parameters are sharded (FSDP2's DTensors), each process averages its
own local shards (foreach ops on the shards, no gathering), holds half of the average on 2 processes and saves its
own part in its own file of the checkpoint; elsewhere the average is one copy, saved once. DeepSpeed ZeRO stage 3
(partitioned parameters) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

from fabric_lite.callbacks.averaged_weights import AvgFn, ExponentialMovingAverage, WeightAverage
from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["WeightAverage", "ExponentialMovingAverage", "WeightAveraging", "EMAWeightAveraging",
           "StochasticWeightAveraging"]

# -- the Trainer's callbacks -----------------------------------------------------------------------------------


class WeightAveraging(Callback):
    """Keep an averaged copy of the module's weights, updated after optimizer steps (Lightning's `WeightAveraging`).

    The arguments are those of torch's `AveragedModel`: `avg_fn` or `multi_avg_fn` (none: the equal average, SWA),
    `device` (default: beside the weights) and `use_buffers` (True here, as in Lightning: buffers are averaged too).
    Override `should_update(step_idx=None, epoch_idx=None)` to choose when to update: it is asked after each
    optimizer step (zero-based `step_idx`) and at each training epoch's end (`epoch_idx`); by default every step.

    Validation (and test) runs with the averaged weights; when fit ends they are copied into the module. The
    average is part of the checkpoint (its own entry: the module's weights in the checkpoint stay the ones being
    trained, so a resumed run goes on exactly), sharded like the model under FSDP.
    """

    def __init__(self, device: Union[torch.device, str, int, None] = None, use_buffers: bool = True,
                 **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - {"avg_fn", "multi_avg_fn"})
        if unknown:
            raise TypeError(f"{type(self).__name__} got {unknown}: besides device and use_buffers it takes torch's "
                            f"AveragedModel arguments avg_fn and multi_avg_fn.")
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self.average: Optional[WeightAverage] = None
        # optimizer steps taken when the average was last updated, and the epoch of the latest epoch-end update
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """Whether to update the average after optimizer step `step_idx` or training epoch `epoch_idx`
        (zero-based; the other is None). The default: after every step."""
        return step_idx is not None

    def _make_average(self, module: "TrainModule") -> WeightAverage:
        return WeightAverage(module, device=self._device, use_buffers=self._use_buffers, **self._kwargs)

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        # (the module is prepared by now: configure_model ran under the strategy, and a sharded module's average
        # is sharded like it)
        self.average = self._make_average(module)
        self._latest_update_step, self._latest_update_epoch = 0, -1
        trainer.accelerator.register_for_checkpointing(self.average, per_process=self.average.sharded)

    def on_train_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        # a resume from a checkpoint that held no average: start it from the restored weights
        if self.average is not None and int(self.average.n_averaged) == 0:
            self.average.reset()

    def _update_after_step(self, trainer: "Trainer", module: "TrainModule") -> None:
        average = self.average
        if average is None or average.swapped or trainer.global_step <= self._latest_update_step:
            return
        if self.should_update(step_idx=trainer.global_step - 1):
            average.update()
            self._latest_update_step = trainer.global_step

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._update_after_step(trainer, module)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        average = self.average
        if average is None or average.swapped or trainer.current_epoch <= self._latest_update_epoch:
            return
        if self.should_update(epoch_idx=trainer.current_epoch):
            average.update()
            self._latest_update_epoch = trainer.current_epoch

    def on_train_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.average is not None:
            self.average.copy_to()

    def on_validation_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.average is not None and not self.average.swapped:
            self.average.swap()

    def on_validation_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.average is not None and self.average.swapped:
            self.average.swap()

    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    def on_save_checkpoint(self, trainer: "Trainer", module: "TrainModule", checkpoint: Dict[str, Any]) -> None:
        # A checkpoint taken at a step's end by a callback that runs before this one (a ModelCheckpoint listed
        # first) holds this step's update: the average is saved after this hook, and the update is not repeated.
        self._update_after_step(trainer, module)

    def state_dict(self) -> Dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._latest_update_step = int(state["latest_update_step"])
        self._latest_update_epoch = int(state.get("latest_update_epoch", -1))


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights (Lightning's `EMAWeightAveraging`): `average = decay * average
    + (1 - decay) * weights` after every `update_every_n_steps`-th optimizer step (zero-based index divisible by
    it) from step `update_starting_at_step` on, and at the end of every epoch from `update_starting_at_epoch` on."""

    def __init__(self, device: Union[torch.device, str, int, None] = None, use_buffers: bool = True,
                 decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: Optional[int] = None,
                 update_starting_at_epoch: Optional[int] = None, **kwargs: Any) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay={decay!r} must be in [0, 1] (the weight the average keeps at each update).")
        if isinstance(update_every_n_steps, bool) or not isinstance(update_every_n_steps, int) \
                or update_every_n_steps < 1:
            raise ValueError(f"update_every_n_steps={update_every_n_steps!r} must be an integer >= 1.")
        kwargs.setdefault("multi_avg_fn", get_ema_multi_avg_fn(float(decay)))
        super().__init__(device=device, use_buffers=use_buffers, **kwargs)
        self.decay = float(decay)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        if step_idx is not None and (self.update_starting_at_step is None or step_idx >= self.update_starting_at_step) \
                and step_idx % self.update_every_n_steps == 0:
            return True
        return epoch_idx is not None and self.update_starting_at_epoch is not None \
            and epoch_idx >= self.update_starting_at_epoch


class StochasticWeightAveraging(WeightAveraging):
    """Stochastic Weight Averaging (Lightning's `StochasticWeightAveraging`): from epoch `swa_epoch_start` (an int
    >= 1, one-based; or a fraction of `max_epochs`) the learning rate follows torch's `SWALR` towards `swa_lrs`
    (annealed over `annealing_epochs` with `annealing_strategy` "cos" or "linear"; it replaces the configured
    scheduler), the parameters are averaged at the start of every epoch from then on (`avg_fn`; none: the equal
    average), and when the last epoch ends the average is copied into the module. A module with batch norm then
    has its running statistics recomputed with the averaged weights, in one pass of `training_step` over the
    training loader without gradients. One optimizer, at most one scheduler. Validation uses the weights trained.
    """

    def __init__(self, swa_lrs: Union[float, Sequence[float]], swa_epoch_start: Union[int, float] = 0.8,
                 annealing_epochs: int = 10, annealing_strategy: str = "cos", avg_fn: Optional[AvgFn] = None,
                 device: Union[torch.device, str, None] = torch.device("cpu")) -> None:
        bad_start = (isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float))
                     or (isinstance(swa_epoch_start, int) and swa_epoch_start < 1)
                     or (isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1))
        if bad_start:
            raise ValueError(f"swa_epoch_start={swa_epoch_start!r} must be an integer >= 1 (one-based epoch) or a "
                             f"float in [0, 1] (a fraction of max_epochs).")
        lrs = [swa_lrs] if isinstance(swa_lrs, (int, float)) and not isinstance(swa_lrs, bool) else swa_lrs
        if not isinstance(lrs, (list, tuple)) or not lrs or not all(
                isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 for lr in lrs):
            raise ValueError(f"swa_lrs={swa_lrs!r} must be a positive float or a list of positive floats (one per "
                             f"parameter group).")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(f"annealing_strategy={annealing_strategy!r} must be 'cos' or 'linear'.")
        if avg_fn is not None and not callable(avg_fn):
            raise TypeError(f"avg_fn={avg_fn!r} must be a function (averaged, current, n_averaged) -> tensor.")
        super().__init__(device=device, use_buffers=False, **({"avg_fn": avg_fn} if avg_fn is not None else {}))
        self._swa_lrs: Any = swa_lrs
        self._swa_epoch_start = swa_epoch_start
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._swa_scheduler: Any = None
        self._scheduler_state: Optional[Dict[str, Any]] = None
        self._max_epochs = 0

    @property
    def swa_start(self) -> int:
        """The first SWA epoch, zero-based."""
        start = self._swa_epoch_start
        if isinstance(start, float):
            start = int(self._max_epochs * start)
        return max(int(start) - 1, 0)

    @property
    def swa_end(self) -> int:
        return self._max_epochs - 1

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        return False  # (updates happen at epoch starts, below)

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"StochasticWeightAveraging works with one optimizer; configure_optimizers returned "
                             f"{len(trainer.optimizers)}.")
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(f"StochasticWeightAveraging replaces one learning-rate scheduler with SWALR; "
                             f"configure_optimizers returned {len(trainer.lr_scheduler_configs)}.")
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise ValueError("StochasticWeightAveraging counts epochs: give the Trainer max_epochs.")
        self._max_epochs = int(trainer.max_epochs)

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        epoch = trainer.current_epoch
        if not self.swa_start <= epoch <= self.swa_end:
            return
        if self._swa_scheduler is None:
            from torch.optim.swa_utils import SWALR

            optimizer = trainer.optimizers[0]
            optimizer = getattr(optimizer, "optimizer", optimizer)  # (the prepared wrapper's torch optimizer)
            groups = optimizer.param_groups
            lrs = [float(lr) for lr in self._swa_lrs] if isinstance(self._swa_lrs, (list, tuple)) else \
                [float(self._swa_lrs)] * len(groups)
            for lr, group in zip(lrs, groups):
                group["initial_lr"] = lr
            self._swa_scheduler = SWALR(optimizer, swa_lr=lrs,  # type: ignore[arg-type]
                                        anneal_epochs=self._annealing_epochs,
                                        anneal_strategy=self._annealing_strategy,  # type: ignore[arg-type]
                                        last_epoch=self._max_epochs if self._annealing_strategy == "cos" else -1)
            if self._scheduler_state is not None:
                self._swa_scheduler.load_state_dict(self._scheduler_state)
        # SWALR takes the configured scheduler's place: this callback steps it at each epoch's end, where the
        # loop steps epoch schedulers
        trainer.lr_scheduler_configs.clear()
        assert self.average is not None
        if epoch > self._latest_update_epoch:
            self.average.update()
            self._latest_update_epoch = epoch

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._swa_scheduler is not None:
            self._swa_scheduler.step()

    def on_train_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        # (the loop counted the last epoch before this hook)
        if self.average is None or trainer.current_epoch - 1 != self.swa_end or int(self.average.n_averaged) == 0:
            return
        self.average.copy_to()
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            _recompute_batch_norm(trainer, module, norms)

    def on_validation_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        pass

    def on_validation_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        pass

    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    def on_save_checkpoint(self, trainer: "Trainer", module: "TrainModule", checkpoint: Dict[str, Any]) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(),
                "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._scheduler_state = state.get("scheduler_state")
        self._swa_scheduler = None  # (built again, with this state, at the next epoch's start)


@torch.no_grad()
def _recompute_batch_norm(trainer: "Trainer", module: "TrainModule", norms: Sequence[Any]) -> None:
    """Batch norm's running statistics for the averaged weights: reset, then the cumulative average over one pass
    of `training_step` on the training loader (torch's `update_bn`, with the module's own step)."""
    momenta: Dict[Any, Any] = {}
    for norm in norms:
        norm.reset_running_stats()
        momenta[norm] = norm.momentum
        norm.momentum = None
    was_training = module.training
    module.train()
    quiet = {"log": lambda *a, **k: None, "log_dict": lambda *a, **k: None}
    module.__dict__.update(quiet)  # (what training_step logs in this pass is not a training metric)
    try:
        for batch_idx, batch in enumerate(trainer.train_dataloader):
            if trainer.batch_transfer is not None:
                batch = trainer.batch_transfer(batch, 0)
            module.training_step(batch, batch_idx)
    finally:
        for name in quiet:
            module.__dict__.pop(name, None)
        for norm, momentum in momenta.items():
            norm.momentum = momentum
        module.train(was_training)
