"""The plan of a Trainer run: what `Trainer(explain=True)` and `fabric-lite explain` print for `fit`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional

from fabric_lite.explain.plan import (
    CKPT_SECTION, CONFLICTS_SECTION, DATA_SECTION, OPT_SECTION, Plan, accelerator_conflicts, data_lines, effective_value, given_arguments, hardware_lines,
    header_lines, planned_layout, model_line, optimizer_lines, setting_origin, precision_lines, strategy_lines,
)

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer


def plan_for_trainer(trainer: "Trainer", module: "TrainModule", ckpt_path: Optional[str] = None) -> Plan:
    """The plan of `trainer.fit(module, ...)`, once fit() has prepared the model, optimizers and loaders."""
    from fabric_lite.callbacks.checkpoint import ModelCheckpoint

    accelerator = trainer.accelerator
    layout = planned_layout(accelerator, trainer)
    plan = Plan(header_lines(layout, "Trainer.fit(...)"))
    launch = accelerator.run_config.launch
    hardware_lines(plan, accelerator, layout)
    model_line(plan, [trainer.model], accelerator)
    precision_lines(plan, accelerator, trainer)
    strategy_lines(plan, accelerator, [trainer.model], trainer.optimizers, layout)

    train = data_lines(plan, "train", trainer.train_dataloader, layout.world, trainer.limits["train"])
    for i, loader in enumerate(trainer.val_dataloaders):
        name = "val" if len(trainer.val_dataloaders) == 1 else f"val {i + 1}"
        data_lines(plan, name, loader, layout.world, trainer.limits["validate"], evaluation=True)
    if trainer.val_dataloaders:
        interval = trainer.val_check_interval
        when = f"every {trainer.check_val_every_n_epoch} epoch(s)"
        if isinstance(interval, int) and not isinstance(interval, bool):
            when = f"every {interval} training batches (in epochs validated: every {trainer.check_val_every_n_epoch})"
        elif interval < 1.0:
            when += f", and every {interval:g} of an epoch"
        plan.add(DATA_SECTION, "validation", f"{when}; {trainer.num_sanity_val_steps} sanity batch(es) before training")
    else:
        plan.add(DATA_SECTION, "validation", "none (no val loader)")

    manual = not module.automatic_optimization
    accumulate = 1 if manual else trainer.accumulate_grad_batches
    plan.add(OPT_SECTION, "optimization", "manual (the module steps its optimizers itself)" if manual else "automatic")
    optimizer_lines(plan, trainer.optimizers, [(s.scheduler, f"every {s.frequency} {s.interval}(s)")
                                            for s in trainer.lr_scheduler_configs])
    if manual:
        plan.add(OPT_SECTION, "gradient accumulation", "done by the module (manual optimization)")
    else:
        plan.add(OPT_SECTION, "gradient accumulation", f"{accumulate} batch(es) per optimizer step (accumulate_grad_batches)")
    effective_value(plan, train, layout.world, accumulate, "", trainer.accelerator.run_config.mesh_shape,
                    trainer.strategy)
    if train.batches is not None and not manual:
        from fabric_lite.trainer import loops

        run = loops.batch_limit(trainer.limits["train"], train.batches) or 0
        per_epoch = math.ceil(run / accumulate)
        plan.add(OPT_SECTION, "optimizer steps per epoch", per_epoch)
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
        plan.add(OPT_SECTION, "stops after", total)
    if trainer.gradient_clip_val is not None and not manual:
        plan.add(OPT_SECTION, "gradient clipping", f"{trainer.gradient_clip_algorithm} <= {trainer.gradient_clip_val} "
                                            f"(gradient_clip_val; after unscaling fp16 gradients)")
    else:
        plan.add(OPT_SECTION, "gradient clipping", "off")

    plan.add(CKPT_SECTION, "default_root_dir", trainer.default_root_dir)
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    root = f"{trainer.default_root_dir.rstrip('/')}/checkpoints"
    if callback is not None:
        dirpath = callback.dirpath or root
        plan.add(CKPT_SECTION, "checkpoints", dirpath)
        saves: List[str] = []
        if callback.every_n_train_steps:
            saves.append(f"every {callback.every_n_train_steps} optimizer steps")
        if callback.every_n_epochs:
            saves.append(f"every {callback.every_n_epochs} epoch(s)")
        keep = ("all" if callback.save_top_k == -1 else
                f"the best {callback.save_top_k} by {callback.monitor} ({callback.mode})" if callback.monitor else
                f"the newest {callback.save_top_k}")
        text = f"{' and '.join(saves) or 'never'}, named {callback.filename!r}, keeping {keep}"
        if callback.save_last:
            text += f", plus {dirpath.rstrip('/')}/last"
        if trainer.fast_dev_run:
            text = "none: fast_dev_run saves no checkpoints"
        if callback.save_top_k == 0 and not callback.save_last:
            text = "none (save_top_k=0)"
        plan.add(CKPT_SECTION, "checkpoint schedule", text)
        root = dirpath
    else:
        plan.add(CKPT_SECTION, "checkpoints", "none (enable_checkpointing=False)")
    plan.add(CKPT_SECTION, "on preemption", f"{root.rstrip('/')}/preempted (SIGTERM/SIGUSR1 save one and exit)")
    if ckpt_path is not None:
        plan.add(CKPT_SECTION, "resume", "the newest whole checkpoint under " + root if ckpt_path == "last" else ckpt_path)
    loggers = _logger_lines(trainer)
    plan.add(CKPT_SECTION, "loggers", "; ".join(loggers) if loggers else "none (no logger callback)")

    _trainer_conflicts(plan, trainer, module, launch)
    accelerator_conflicts(plan, accelerator, layout, launch)
    return plan


def _logger_lines(trainer: "Trainer") -> List[str]:
    from fabric_lite.callbacks.loggers import VersionedLogger, version_dir

    out = []
    for cb in trainer.callbacks:
        if isinstance(cb, VersionedLogger):
            where = cb.log_dir
            if where is None:
                try:
                    where = version_dir(cb.save_dir, cb.name, cb.version)  # reads the directory, creates nothing
                    where += "" if cb.version is not None else " (the next free version)"
                except Exception as err:  # a storage error is worth seeing, not worth failing the plan
                    where = f"{cb.save_dir} (cannot list it: {err})"
            out.append(f"{type(cb).__name__} -> {where}")
    return out


def _trainer_conflicts(plan: Plan, trainer: "Trainer", module: "TrainModule", launch: Any) -> None:
    given = given_arguments(trainer) or {}
    no_val = not trainer.val_dataloaders
    if no_val and trainer.limits["validate"] is not None and not trainer.fast_dev_run:
        plan.add(CONFLICTS_SECTION, "limit_val_batches", f"limit_val_batches={trainer.limits['validate']!r} is ignored: "
                                                  f"there is no val loader.")
    if no_val and trainer.check_val_every_n_epoch != 1:
        plan.add(CONFLICTS_SECTION, "check_val_every_n_epoch", f"check_val_every_n_epoch={trainer.check_val_every_n_epoch} "
                                                        f"is ignored: there is no validation.")
    if no_val and trainer.val_check_interval != 1.0:
        plan.add(CONFLICTS_SECTION, "val_check_interval", f"val_check_interval={trainer.val_check_interval!r} is ignored: "
                                                   f"there is no validation.")
    if no_val and "num_sanity_val_steps" in given and not trainer.fast_dev_run:
        plan.add(CONFLICTS_SECTION, "num_sanity_val_steps", "is ignored: there is no val loader.")
    if not module.automatic_optimization:
        if trainer.accumulate_grad_batches != 1:
            plan.add(CONFLICTS_SECTION, "accumulate_grad_batches",
                     f"accumulate_grad_batches={trainer.accumulate_grad_batches} is ignored with manual optimization "
                     f"(automatic_optimization=False): the module decides when to step.")
        if trainer.gradient_clip_val is not None:
            plan.add(CONFLICTS_SECTION, "gradient_clip_val",
                     f"gradient_clip_val={trainer.gradient_clip_val} is ignored with manual optimization: clip in "
                     f"training_step before stepping.")
    elif trainer.gradient_clip_val is None and trainer.gradient_clip_algorithm != "norm":
        plan.add(CONFLICTS_SECTION, "gradient_clip_algorithm", f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} "
                                                        f"is ignored: gradient_clip_val is not set.")
    if trainer.fast_dev_run:
        plan.add(CONFLICTS_SECTION, "fast_dev_run", f"fast_dev_run={trainer.fast_dev_run!r} overrides max_epochs, max_steps, "
                                             f"limit_*_batches and num_sanity_val_steps, and turns checkpointing off.")
    if launch.gradient_accumulation_steps is not None:
        origin = setting_origin("gradient_accumulation_steps", launch.gradient_accumulation_steps)
        if launch.gradient_accumulation_steps != trainer.accumulate_grad_batches:
            plan.add(CONFLICTS_SECTION, "gradient_accumulation_steps",
                     f"{origin} is ignored: the Trainer accumulates accumulate_grad_batches="
                     f"{trainer.accumulate_grad_batches}; pass Trainer(accumulate_grad_batches="
                     f"{launch.gradient_accumulation_steps}) instead.")
        else:
            plan.add(CONFLICTS_SECTION, "gradient_accumulation_steps",
                     f"set twice, same value: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) "
                     f"and {origin} (the Trainer's is the one used).")
