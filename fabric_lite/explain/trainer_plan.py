"""The plan of a Trainer run: what `Trainer(explain=True)` and `fabric-lite explain` print for `fit`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional

from fabric_lite.explain.plan import (
    _CKPT, _CONFLICTS, _DATA, _OPT, Plan, _accelerator_conflicts, _data_lines, _effective, _given, _hardware,
    _header, _layout, _model_line, _optimizers, _origin, _precision,
)

if TYPE_CHECKING:
    from fabric_lite.module import TrainModule
    from fabric_lite.trainer import Trainer


def plan_for_trainer(trainer: "Trainer", module: "TrainModule", ckpt_path: Optional[str] = None) -> Plan:
    """The plan of `trainer.fit(module, ...)`, once fit() has prepared the model, optimizers and loaders."""
    from fabric_lite.callbacks.checkpoint import ModelCheckpoint
    from fabric_lite.environments import read_launch_settings

    accelerator = trainer.accelerator
    layout = _layout(accelerator, trainer)
    plan = Plan(_header(layout, "Trainer.fit(...)"))
    launch = read_launch_settings()
    _hardware(plan, accelerator, layout)
    _model_line(plan, [trainer.model], accelerator)
    _precision(plan, accelerator, trainer)

    train = _data_lines(plan, "train", trainer._train_loader, layout.world, trainer.limits["train"])
    for i, loader in enumerate(trainer._val_loaders):
        name = "val" if len(trainer._val_loaders) == 1 else f"val {i + 1}"
        _data_lines(plan, name, loader, layout.world, trainer.limits["validate"], evaluation=True)
    if trainer._val_loaders:
        interval = trainer.val_check_interval
        when = f"every {trainer.check_val_every_n_epoch} epoch(s)"
        if isinstance(interval, int) and not isinstance(interval, bool):
            when = f"every {interval} training batches (in epochs validated: every {trainer.check_val_every_n_epoch})"
        elif interval < 1.0:
            when += f", and every {interval:g} of an epoch"
        plan.add(_DATA, "validation", f"{when}; {trainer.num_sanity_val_steps} sanity batch(es) before training")
    else:
        plan.add(_DATA, "validation", "none (no val loader)")

    manual = not module.automatic_optimization
    accumulate = 1 if manual else trainer.accumulate_grad_batches
    plan.add(_OPT, "optimization", "manual (the module steps its optimizers itself)" if manual else "automatic")
    _optimizers(plan, trainer._optimizers, [(s.scheduler, f"every {s.frequency} {s.interval}(s)")
                                            for s in trainer._schedulers])
    if manual:
        plan.add(_OPT, "gradient accumulation", "done by the module (manual optimization)")
    else:
        plan.add(_OPT, "gradient accumulation", f"{accumulate} batch(es) per optimizer step (accumulate_grad_batches)")
    _effective(plan, train, layout.world, accumulate, "")
    if train.batches is not None and not manual:
        from fabric_lite import loops

        run = loops._limit(trainer.limits["train"], train.batches) or 0
        per_epoch = math.ceil(run / accumulate)
        plan.add(_OPT, "optimizer steps per epoch", per_epoch)
        epochs = trainer.max_epochs
        if trainer.max_steps >= 0 and (epochs == -1 or trainer.max_steps <= epochs * per_epoch):
            total = f"max_steps={trainer.max_steps}" + (f" (about {math.ceil(trainer.max_steps / per_epoch)} epoch(s))"
                                                        if per_epoch else "")
        elif epochs == -1:
            total = "no epoch or step limit (max_epochs=-1, max_steps=-1)"
        else:
            total = f"max_epochs={epochs}: {epochs * per_epoch} optimizer steps"
        if trainer.max_time is not None:
            total += f", or max_time={trainer.max_time}s"
        plan.add(_OPT, "stops after", total)
    if trainer.gradient_clip_val is not None and not manual:
        plan.add(_OPT, "gradient clipping", f"{trainer.gradient_clip_algorithm} <= {trainer.gradient_clip_val} "
                                            f"(gradient_clip_val; after unscaling fp16 gradients)")
    else:
        plan.add(_OPT, "gradient clipping", "off")

    plan.add(_CKPT, "default_root_dir", trainer.default_root_dir)
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    root = f"{trainer.default_root_dir.rstrip('/')}/checkpoints"
    if callback is not None:
        dirpath = callback.dirpath or root
        plan.add(_CKPT, "checkpoints", dirpath)
        when = []
        if callback.every_n_train_steps:
            when.append(f"every {callback.every_n_train_steps} optimizer steps")
        if callback.every_n_epochs:
            when.append(f"every {callback.every_n_epochs} epoch(s)")
        keep = ("all" if callback.save_top_k == -1 else
                f"the best {callback.save_top_k} by {callback.monitor} ({callback.mode})" if callback.monitor else
                f"the newest {callback.save_top_k}")
        text = f"{' and '.join(when) or 'never'}, named {callback.filename!r}, keeping {keep}"
        if callback.save_last:
            text += f", plus {dirpath.rstrip('/')}/last"
        if trainer.fast_dev_run:
            text = "none: fast_dev_run saves no checkpoints"
        if callback.save_top_k == 0 and not callback.save_last:
            text = "none (save_top_k=0)"
        plan.add(_CKPT, "checkpoint schedule", text)
        root = dirpath
    else:
        plan.add(_CKPT, "checkpoints", "none (enable_checkpointing=False)")
    plan.add(_CKPT, "on preemption", f"{root.rstrip('/')}/preempted (SIGTERM/SIGUSR1 save one and exit)")
    if ckpt_path is not None:
        plan.add(_CKPT, "resume", "the newest whole checkpoint under " + root if ckpt_path == "last" else ckpt_path)
    loggers = _logger_lines(trainer)
    plan.add(_CKPT, "loggers", "; ".join(loggers) if loggers else "none (no logger callback)")

    _trainer_conflicts(plan, trainer, module, launch)
    _accelerator_conflicts(plan, accelerator, layout, launch)
    return plan


def _logger_lines(trainer: "Trainer") -> List[str]:
    from fabric_lite.callbacks.loggers import _VersionedLogger, _version_dir

    out = []
    for cb in trainer.callbacks:
        if isinstance(cb, _VersionedLogger):
            where = cb.log_dir
            if where is None:
                try:
                    where = _version_dir(cb.save_dir, cb.name, cb.version)  # reads the directory, creates nothing
                    where += "" if cb.version is not None else " (the next free version)"
                except Exception as err:  # a storage error is worth seeing, not worth failing the plan
                    where = f"{cb.save_dir} (cannot list it: {err})"
            out.append(f"{type(cb).__name__} -> {where}")
    return out


def _trainer_conflicts(plan: Plan, trainer: "Trainer", module: "TrainModule", launch: Any) -> None:
    given = _given(trainer) or {}
    no_val = not trainer._val_loaders
    if no_val and trainer.limits["validate"] is not None and not trainer.fast_dev_run:
        plan.add(_CONFLICTS, "limit_val_batches", f"limit_val_batches={trainer.limits['validate']!r} is ignored: "
                                                  f"there is no val loader.")
    if no_val and trainer.check_val_every_n_epoch != 1:
        plan.add(_CONFLICTS, "check_val_every_n_epoch", f"check_val_every_n_epoch={trainer.check_val_every_n_epoch} "
                                                        f"is ignored: there is no validation.")
    if no_val and trainer.val_check_interval != 1.0:
        plan.add(_CONFLICTS, "val_check_interval", f"val_check_interval={trainer.val_check_interval!r} is ignored: "
                                                   f"there is no validation.")
    if no_val and "num_sanity_val_steps" in given and not trainer.fast_dev_run:
        plan.add(_CONFLICTS, "num_sanity_val_steps", "is ignored: there is no val loader.")
    if not module.automatic_optimization:
        if trainer.accumulate_grad_batches != 1:
            plan.add(_CONFLICTS, "accumulate_grad_batches",
                     f"accumulate_grad_batches={trainer.accumulate_grad_batches} is ignored with manual optimization "
                     f"(automatic_optimization=False): the module decides when to step.")
        if trainer.gradient_clip_val is not None:
            plan.add(_CONFLICTS, "gradient_clip_val",
                     f"gradient_clip_val={trainer.gradient_clip_val} is ignored with manual optimization: clip in "
                     f"training_step before stepping.")
    elif trainer.gradient_clip_val is None and trainer.gradient_clip_algorithm != "norm":
        plan.add(_CONFLICTS, "gradient_clip_algorithm", f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} "
                                                        f"is ignored: gradient_clip_val is not set.")
    if trainer.fast_dev_run:
        plan.add(_CONFLICTS, "fast_dev_run", f"fast_dev_run={trainer.fast_dev_run!r} overrides max_epochs, max_steps, "
                                             f"limit_*_batches and num_sanity_val_steps, and turns checkpointing off.")
    if launch.gradient_accumulation_steps is not None:
        origin = _origin("gradient_accumulation_steps", launch.gradient_accumulation_steps)
        if launch.gradient_accumulation_steps != trainer.accumulate_grad_batches:
            plan.add(_CONFLICTS, "gradient_accumulation_steps",
                     f"{origin} is ignored: the Trainer accumulates accumulate_grad_batches="
                     f"{trainer.accumulate_grad_batches}; pass Trainer(accumulate_grad_batches="
                     f"{launch.gradient_accumulation_steps}) instead.")
        else:
            plan.add(_CONFLICTS, "gradient_accumulation_steps",
                     f"set twice, same value: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) "
                     f"and {origin} (the Trainer's is the one used).")
