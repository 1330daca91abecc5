"""The Trainer's loops: fit (train epochs with validation) and evaluation (prediction: `predict_loop.py`).

A training micro-step runs through the step engine (`trainer.accelerator`, see `engine.py`), the same
code the raw door runs; device, precision and gradient decisions go to the strategy beneath it. These
functions only decide *when* things happen. What watches them observes `trainer.events` (`events.py`): the
observers of each step and epoch end, and the instrument (a profiler) whose timed calls stand in for the steps,
hooks and loaders, are looked up once per epoch.
"""

from __future__ import annotations

import inspect
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from fabric_lite.data.limits import batch_limit, loader_length
from fabric_lite.trainer.data_connector import reload_loaders
from fabric_lite.trainer.module import TrainModule

if TYPE_CHECKING:
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["run_fit", "run_evaluation", "batch_limit", "loader_length", "empty_loader_warning", "may_stop",
           "takes_dataloader_idx"]


def takes_dataloader_idx(fn: Any) -> bool:
    """Whether a step method accepts `dataloader_idx` (passed only with several loaders, and only to a step
    that takes it: a step written for one loader still runs over several)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "dataloader_idx" or p.kind is p.VAR_POSITIONAL for p in params)


class _StepHooks:
    """The per-step hooks that do something, looked up once per epoch: calling the empty defaults of
    every callback and of the module on each step costs more than a tiny model's step takes to vary.
    Under an instrument (a profiler) each one is timed. Callbacks run before the module at each hook, as in
    Lightning."""

    def __init__(self, trainer: "Trainer", instrument: Any = None) -> None:
        from fabric_lite.callbacks.base import Callback

        module = trainer.module
        # (`callbacks.base.overrides` written out: these run for every hook of every callback, each epoch)

        def mine(name: str) -> Any:
            if name not in vars(module) and getattr(type(module), name) is getattr(TrainModule, name):
                return None
            if instrument is not None:
                return instrument.wrap(f"[TrainModule]{type(module).__name__}.{name}", getattr(module, name))
            return getattr(module, name)

        def theirs(name: str) -> List[Any]:
            default = getattr(Callback, name)
            if instrument is not None:
                return [instrument.wrap(f"[Callback]{type(cb).__name__}.{name}", getattr(cb, name))
                        for cb in trainer.callbacks if name in vars(cb) or getattr(type(cb), name) is not default]
            return [getattr(cb, name) for cb in trainer.callbacks
                    if name in vars(cb) or getattr(type(cb), name) is not default]

        def both(name: str) -> Any:
            """The callbacks' hooks, then the module's, as one callable taking the module's arguments (or None)."""
            own, callbacks = mine(name), theirs(name)
            if not callbacks:
                return own

            def call(*args: Any) -> None:
                for hook in callbacks:
                    hook(trainer, module, *args)
                if own is not None:
                    own(*args)

            return call

        self.batch_start, self.cb_batch_start = mine("on_train_batch_start"), theirs("on_train_batch_start")
        # (kept apart, not joined by `both`: progress bars and checkpoints hear every batch end, one call each)
        self.batch_end, self.cb_batch_end = mine("on_train_batch_end"), theirs("on_train_batch_end")
        self.before_backward, self.after_backward = both("on_before_backward"), both("on_after_backward")
        # for the engine: called with the optimizer (or None: nothing to call)
        self.before_optimizer_step = both("on_before_optimizer_step")
        self.before_zero_grad = both("on_before_zero_grad")
        self.transfer = trainer.batch_transfer  # (None: the loader placed the batch)


def _extract_loss(out: Any, batch_idx: int) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = "nothing" if out is None else (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                                             else type(out).__name__)
        raise ValueError(
            f"training_step returned {got} at batch {batch_idx}; with automatic optimization it must return the "
            f"loss (a scalar tensor) or a dict with a 'loss' key. For loops that step themselves, set "
            f"`automatic_optimization = False`."
        )
    return loss


def _flush_step_metrics(trainer: "Trainer") -> None:
    values = trainer.metric_store.flush_step()
    if values:
        trainer.log_metrics(values, trainer.global_step)


def run_fit(trainer: "Trainer") -> None:
    trainer.start_time = time.monotonic()
    trainer.should_stop = False
    module = trainer.module
    assert module is not None  # (fit() set it up)
    trainer.call_hook("on_fit_start")
    if trainer.val_dataloaders and trainer.num_sanity_val_steps > 0 and trainer.global_step == 0:
        trainer.sanity_checking = True
        trainer.call_callback_hook("on_sanity_check_start")  # (callbacks only, as in Lightning)
        with trainer.evaluation_context():
            run_evaluation(trainer, "validate", trainer.val_dataloaders, limit=trainer.num_sanity_val_steps,
                           log=False)
        trainer.call_callback_hook("on_sanity_check_end")
        trainer.sanity_checking = False
        trainer.metric_store.clear_outputs()
    instrument = trainer.events.instrument  # (a profiler: the calls below are timed; None: called as they are)
    for cb in trainer.callbacks if instrument is None else trainer.timed_callbacks():
        cb.on_hyperparameters(trainer, dict(module.hparams))
    trainer.call_hook("on_train_start")
    train_epoch = _train_epoch if instrument is None else instrument.wrap("run_training_epoch", _train_epoch)
    warned = False
    reload_every = trainer.reload_dataloaders_every_n_epochs
    trainer.loaded_epoch = trainer.current_epoch  # (the loaders were asked for at this epoch: resumed, it is later)
    # (a stop asked for before min_epochs/min_steps are reached waits for them: may_stop)
    while not (trainer.should_stop and may_stop(trainer)) and (trainer.max_epochs == -1
                                                                or trainer.current_epoch < trainer.max_epochs):
        if 0 <= trainer.max_steps <= trainer.global_step:
            break
        if reload_every and trainer.current_epoch - trainer.loaded_epoch >= reload_every:
            reload_loaders(trainer)
        drew = train_epoch(trainer)
        if drew is None:  # a spike rolled every process back to a checkpoint: go on from there
            continue
        if not drew and not warned:
            warnings.warn(empty_loader_warning(trainer), UserWarning, stacklevel=3)
            warned = True
        if trainer.should_stop and trainer.time_is_up():
            break
        trainer.current_epoch += 1
        trainer.epoch_finished = False
    trainer.call_hook("on_train_end")
    trainer.call_hook("on_fit_end")


def may_stop(trainer: "Trainer") -> bool:
    """Whether `min_epochs`/`min_steps` let training stop now: a stop asked for before waits for them."""
    if (trainer.min_epochs is None or trainer.current_epoch >= trainer.min_epochs) and \
            (trainer.min_steps is None or trainer.global_step >= trainer.min_steps):
        return True
    if not trainer.min_limits_noted and trainer.is_global_zero:
        trainer.min_limits_noted = True
        print(f"fabric_lite: a stop was asked for at epoch {trainer.current_epoch}, step {trainer.global_step}, before "
              f"min_epochs={trainer.min_epochs} / min_steps={trainer.min_steps}; training goes on until they are "
              f"reached.", file=sys.stderr, flush=True)
    return False


def _should_validate_in_epoch(trainer: "Trainer", batch_idx: int, limit: Optional[int]) -> bool:
    interval = trainer.val_check_interval
    if not trainer.val_dataloaders or (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch:
        return False
    if isinstance(interval, float):
        if interval >= 1.0 or limit is None:
            return False
        every = max(1, int(limit * interval))
    else:
        every = interval
    # a fraction never fires on the last batch: the end-of-epoch validation covers it
    last = limit is not None and batch_idx + 1 >= limit
    return (batch_idx + 1) % every == 0 and not (last and isinstance(interval, float))


def empty_loader_warning(trainer: "Trainer") -> str:
    """What to say when the training loader yielded no batch in an epoch: which loader, and the likely cause."""
    loader, origin = trainer.train_dataloader_source
    dataset = getattr(loader, "dataset", None)
    samples = loader_length(dataset) if dataset is not None else None
    batch_size, drop_last = getattr(loader, "batch_size", None), getattr(loader, "drop_last", False)
    world = trainer.strategy.dp_size  # (the processes the data is sharded over)
    what = type(loader).__name__ + (f" over {type(dataset).__name__}" if dataset is not None else "")
    if samples is not None:
        what += f" of {samples} samples"
    if batch_size is not None:
        what += f", batch_size={batch_size}" + (f", drop_last={drop_last}" if drop_last else "")
    if samples == 0:
        cause = "Its dataset is empty."
    elif drop_last and batch_size and samples is not None:
        cause = (f"drop_last=True drops every batch: {samples} samples"
                 + (f" shared by {world} processes" if world > 1 else "") + f" are fewer than batch_size={batch_size}"
                 + (" per process" if world > 1 else "") + ".")
    else:
        cause = "It yielded nothing."
    return (f"The training dataloader {origin} ({what}) yielded no batches in epoch {trainer.current_epoch}: no "
            f"training step ran, so fit() leaves the model as it was. {cause} Give fit() a loader with at least "
            f"one batch (check the dataset, batch_size and drop_last).")


def _spike_guard(trainer: "Trainer") -> Any:
    """The SpikeDetection callback that decides each optimizer step, or None."""
    if "fabric_lite.callbacks.spike" not in sys.modules:  # (loaded on first use: no callback can be one)
        return None
    from fabric_lite.callbacks.spike import SpikeDetection

    return next((cb for cb in trainer.callbacks if isinstance(cb, SpikeDetection)), None)


def _train_epoch(trainer: "Trainer") -> Optional[bool]:
    """One training epoch; False when the loader yielded no batch at all (nothing trained), None when a spike rolled
    the run back to a checkpoint (the loop goes on from the epoch and batch it restored)."""
    module, model, strategy, metrics = trainer.module, trainer.model, trainer.strategy, trainer.metric_store
    assert module is not None and model is not None  # (fit() set them up before its loop)
    engine = trainer.accelerator
    loader = trainer.train_dataloader
    limit = batch_limit(trainer.limits["train"], loader_length(loader))
    position = loader.state_dict()
    start = position["batches_seen"] if position["epoch"] == trainer.current_epoch else 0
    # (resumed mid-epoch: the aggregates restored from the checkpoint go on)
    metrics.start_train_epoch(fresh=start == 0)
    module.train()
    trainer.call_hook("on_train_epoch_start")
    metrics.fx = "training_step"  # (and the other per-batch hooks: Lightning's rules are the same for them all)
    batch_idx = start - 1
    cut_short = False
    # What each step calls, looked up once per epoch: timed wrappers under an instrument (a profiler), else the
    # calls themselves; and the observers of each step (preemption).
    events = trainer.events
    instrument, on_step = events.instrument, events.step
    hooks = _StepHooks(trainer, instrument)
    forward, backward, step_optimizers, step_scheduler = model, engine.backward, engine.step_optimizers, _step_scheduler
    callbacks, module_hooks = trainer.callbacks, module
    if instrument is not None:
        name = type(strategy).__name__
        forward = instrument.wrap(f"[Strategy]{name}.training_step", model)
        backward = instrument.wrap(f"[Strategy]{name}.backward", backward)
        step_optimizers = instrument.wrap(f"[Strategy]{name}.optimizer_step", step_optimizers)
        step_scheduler = instrument.wrap("lr_scheduler_step", step_scheduler)
        callbacks, module_hooks = trainer.timed_callbacks(), instrument.timed(module, "TrainModule", TrainModule)
    # a module stepping its own optimizers may run several backwards per forward: unwrapped where the wrapper
    # could not follow them (see manual_optimization.py)
    manual_forward: Any = forward
    if not module.automatic_optimization and strategy.traits.syncs_gradients_per_forward and trainer.world_size > 1:
        manual_forward = trainer.eval_model if instrument is None else \
            instrument.wrap(f"[Strategy]{type(strategy).__name__}.training_step", trainer.eval_model)
    models = (model,)
    gradient_state = engine.gradient_state
    validates_in_epoch = bool(trainer.val_dataloaders)
    # a spike guard (SpikeDetection) decides each optimizer step on every process alike; the positions it left out
    guard = _spike_guard(trainer) if module.automatic_optimization else None
    excluded = guard.excluded_batches(trainer.current_epoch) if guard is not None else None
    verdict = "step"
    # (the loader is not held in a variable: breaking out of the loop closes its iterator at once, as before)
    for batch_idx, batch in enumerate(loader if instrument is None else
                                      instrument.iterate("train_dataloader_next", loader), start=start):
        if limit is not None and batch_idx >= limit:
            break
        if excluded and batch_idx in excluded:
            continue  # (left out after a spike: not trained on, here or after a resume)
        if hooks.transfer is not None:
            batch = hooks.transfer(batch, 0)
        for hook in hooks.cb_batch_start:
            hook(trainer, module, batch, batch_idx)
        if hooks.batch_start is not None and hooks.batch_start(batch, batch_idx) == -1:
            break
        metrics.batch = batch  # its size weighs epoch means; read only if one is logged
        steps_before = trainer.global_step
        if module.automatic_optimization:
            # (a checkpoint taken before the window closes carries its partial gradients)
            with engine.begin_micro_step(batch_idx, limit, models):
                out = forward(batch, batch_idx)
                # (a plain scalar tensor needs no checks: one call fewer per step)
                loss = out if out.__class__ is torch.Tensor and out.ndim == 0 else _extract_loss(out, batch_idx)
                if hooks.before_backward is not None:
                    hooks.before_backward(loss)
                # divided by the window's real length (divide_loss_by="window")
                backward(loss if guard is None else guard.mark(loss, batch_idx), model)
                if hooks.after_backward is not None:
                    hooks.after_backward()
            if gradient_state.sync_gradients:  # the window closed: clip, step, zero_grad
                if guard is not None:  # "skip": the gradients were dropped on every process
                    verdict = guard.verdict(trainer, batch_idx)
                    if verdict == "rollback":
                        break
                if verdict == "step":
                    step_optimizers(trainer.optimizers, trainer.gradient_clip_val, trainer.gradient_clip_algorithm,
                                    hooks.before_optimizer_step, hooks.before_zero_grad)
                    trainer.global_step += 1
                    for sched in trainer.lr_scheduler_configs:
                        if sched.interval == "step" and trainer.global_step % sched.frequency == 0:
                            step_scheduler(trainer, sched)
        else:
            out = manual_forward(batch, batch_idx)  # optimizer steps count themselves (Trainer.count_manual_step)
        if hooks.cb_batch_end or hooks.batch_end is not None:  # (Lightning hands a plain loss over as {"loss": loss})
            outputs = {"loss": out} if out.__class__ is torch.Tensor and module.automatic_optimization else out
            for hook in hooks.cb_batch_end:
                hook(trainer, module, outputs, batch, batch_idx)
            if hooks.batch_end is not None:
                hooks.batch_end(outputs, batch, batch_idx)
        # (after on_train_batch_end, so what it logs is written with this step's values, as in Lightning)
        if trainer.global_step != steps_before and (trainer.global_step % trainer.log_every_n_steps == 0
                                                    or batch_idx + 1 == limit):
            _flush_step_metrics(trainer)
        for observe in on_step:
            observe(trainer, batch_idx)
        if validates_in_epoch and _should_validate_in_epoch(trainer, batch_idx, limit):
            _validate(trainer)
        if 0 <= trainer.max_steps <= trainer.global_step or trainer.time_is_up():
            trainer.should_stop = True
            cut_short = limit is None or batch_idx + 1 < limit
            break
        if trainer.should_stop and may_stop(trainer):  # (a callback asked; min_epochs/min_steps may hold it)
            cut_short = limit is None or batch_idx + 1 < limit
            break
    else:
        cut_short = False
    if verdict == "rollback":
        assert guard is not None
        guard.rollback(trainer)  # (every process: the epoch, its position and the weights are the checkpoint's)
        trainer.epoch_finished = False
        metrics.fx = None
        return None
    if not cut_short:
        # A batch limit ends the epoch before the loader runs out: move the loader on too, so a
        # checkpoint taken now resumes at the next epoch's first batch.
        loader.set_epoch(trainer.current_epoch + 1)
    trainer.epoch_finished = True
    if trainer.val_dataloaders and (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch == 0 \
            and not isinstance(trainer.val_check_interval, int) and not cut_short:
        _validate(trainer)
    metrics.stage, metrics.fx, metrics.batch = "train", "on_train_epoch_end", None
    module_hooks.on_train_epoch_end()
    trainer.log_metrics(metrics.epoch_end(), trainer.global_step)
    for sched in trainer.lr_scheduler_configs:  # after validation, so a monitored val metric is this epoch's
        if sched.interval == "epoch" and (trainer.current_epoch + 1) % sched.frequency == 0:
            step_scheduler(trainer, sched)
    for cb in callbacks:
        cb.on_train_epoch_end(trainer, module)
    trainer.log_metrics(metrics.epoch_end(), trainer.global_step)  # what the callbacks logged there
    metrics.fx = None
    drew = batch_idx >= start or start > 0  # (resumed at an epoch's end: nothing more was asked of the loader)
    # every process must agree to stop, or one would wait in a collective the others never reach; the same
    # collective carries each epoch-end observer's flag (preemption: a signal arrived), acted on everywhere
    flags = [float(trainer.should_stop)]
    voters = events.epoch_end
    for voter in voters:
        flags.append(float(voter.flag(trainer)))
    agreed = strategy.collectives.all_reduce(torch.tensor(flags, device=trainer.device), "max").tolist()  # (nccl: device tensors)
    trainer.should_stop = bool(agreed[0])
    for voter, raised in zip(voters, agreed[1:]):
        if raised:
            voter.act(trainer)
    return drew


def _step_scheduler(trainer: "Trainer", sched: Any) -> None:
    if sched.optimizer is not None and sched.optimizer.step_was_skipped:
        return  # (as the raw door's prepared scheduler: no schedule step for a skipped optimizer step)
    if sched.needs_metric:
        if sched.monitor not in trainer.callback_metrics:
            raise KeyError(
                f"The scheduler monitors {sched.monitor!r}, which was never logged. Logged: "
                f"{sorted(trainer.callback_metrics)}."
            )
        sched.scheduler.step(trainer.callback_metrics[sched.monitor])
    else:
        sched.scheduler.step()


def _validate(trainer: "Trainer") -> None:
    with trainer.evaluation_context():
        run_evaluation(trainer, "validate", trainer.val_dataloaders, in_fit=True)


def run_evaluation(trainer: "Trainer", stage: str, loaders: List[Any], limit: Optional[int] = None,
                   log: bool = True, in_fit: bool = False) -> List[Dict[str, float]]:
    """Run validation or test over `loaders` as one epoch; returns each loader's epoch metrics as floats
    (with the values logged in the epoch-end hooks in every loader's dict, as Lightning returns them). With
    several loaders, the step and the batch hooks get each one's `dataloader_idx`."""
    from fabric_lite.callbacks.base import Callback, overrides

    module, model, metrics = trainer.module, trainer.eval_model, trainer.metric_store
    assert module is not None and model is not None  # (the stage set them up before its loop)
    hook = "validation" if stage == "validate" else "test"
    saved = metrics.begin_evaluation(stage, fresh_steps=not in_fit)
    modes = [(m, m.training) for m in module.modules()]  # restored after, unless the module says how
    instrument = trainer.events.instrument  # (a profiler: the calls below are timed; None: called as they are)
    forward, callbacks, module_hooks = model, trainer.callbacks, module
    if instrument is not None:
        forward = instrument.wrap(f"[Strategy]{type(trainer.strategy).__name__}.{hook}_step", model)
        callbacks, module_hooks = trainer.timed_callbacks(), instrument.timed(module, "TrainModule", TrainModule)
    getattr(module_hooks, f"on_{hook}_model_eval")()
    trainer.call_hook(f"on_{hook}_start")
    trainer.call_hook(f"on_{hook}_epoch_start")
    several = len(loaders) > 1
    step_takes_idx = several and takes_dataloader_idx(getattr(module, f"{hook}_step"))
    transfer = trainer.batch_transfer
    # the batch hooks that do something, looked up once (callbacks first, then the module, as in Lightning)
    starts = [getattr(timed, f"on_{hook}_batch_start") for cb, timed in zip(trainer.callbacks, callbacks)
              if overrides(cb, f"on_{hook}_batch_start", Callback)]
    ends = [getattr(timed, f"on_{hook}_batch_end") for cb, timed in zip(trainer.callbacks, callbacks)
            if overrides(cb, f"on_{hook}_batch_end", Callback)]
    own_start = getattr(module_hooks, f"on_{hook}_batch_start") \
        if overrides(module, f"on_{hook}_batch_start", TrainModule) else None
    own_end = getattr(module_hooks, f"on_{hook}_batch_end") \
        if overrides(module, f"on_{hook}_batch_end", TrainModule) else None
    writes_steps = log and not trainer.sanity_checking
    outputs: List[Dict[str, torch.Tensor]] = []
    with trainer.evaluation_context():
        for dataloader_idx, loader in enumerate(loaders):
            extra = (dataloader_idx,) if several else ()
            step_extra = extra if step_takes_idx else ()
            loader_limit = batch_limit(trainer.limits[stage] if limit is None else limit, loader_length(loader))
            metrics.start_eval_loader(dataloader_idx if several else None, loader_limit)
            batches = loader if instrument is None else \
                instrument.iterate(f"{'val' if hook == 'validation' else hook}_dataloader_next", loader)
            for batch_idx, batch in enumerate(batches):
                if loader_limit is not None and batch_idx >= loader_limit:
                    break
                if transfer is not None:
                    batch = transfer(batch, dataloader_idx)
                metrics.batch = batch
                for cb_hook in starts:
                    cb_hook(trainer, module, batch, batch_idx, *extra)
                if own_start is not None:
                    own_start(batch, batch_idx, *extra)
                out = forward(batch, batch_idx, stage, *step_extra)
                for cb_hook in ends:
                    cb_hook(trainer, module, out, batch, batch_idx, *extra)
                if own_end is not None:
                    own_end(out, batch, batch_idx, *extra)
                if writes_steps:
                    step, values = metrics.flush_eval_step(dataloader_idx)
                    trainer.log_metrics(values, step)  # per-step values, at this loader's own step count
            del batches  # (closes a timed loader's iterator now, as a loop that ran out or broke off does)
            outputs.append(metrics.epoch_end())  # this loader's epoch values
    metrics.dataloader_idx, metrics.batch, metrics.fx = None, None, f"on_{hook}_epoch_end"
    getattr(module_hooks, f"on_{hook}_epoch_end")()
    _add_to_each(outputs, metrics.epoch_end())  # logged in the epoch-end hook: part of every loader's results
    if log and not trainer.sanity_checking:
        trainer.log_metrics({k: v for out in outputs for k, v in out.items()}, trainer.global_step)
        # (after the module's: the callbacks read this epoch's results in trainer.callback_metrics)
        for cb in callbacks:
            getattr(cb, f"on_{hook}_epoch_end")(trainer, module)
        late = metrics.epoch_end()  # what the callbacks logged in their epoch-end hook
        _add_to_each(outputs, late)
        trainer.log_metrics(late, trainer.global_step)
    trainer.call_hook(f"on_{hook}_end")
    if overrides(module, f"on_{hook}_model_train", TrainModule):
        getattr(module_hooks, f"on_{hook}_model_train")()
    else:
        for m, training in modes:
            m.training = training
    metrics.end_evaluation(saved)
    return [{k: float(v) for k, v in out.items()} for out in outputs]


def _add_to_each(outputs: List[Dict[str, Any]], values: Dict[str, Any]) -> None:
    for out in outputs:
        out.update(values)
