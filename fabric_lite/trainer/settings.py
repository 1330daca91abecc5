"""The Trainer's arguments, checked and resolved once into one `TrainerSettings` before anything starts.

`resolve_settings` is a pure function of what `Trainer(...)` was given: it raises for a wrong name, type or
value (naming the argument, the value and what is allowed) and applies the rules that tie arguments together
(`fast_dev_run`, the default epoch limit). `apply_torch_settings` then sets torch's process-wide switches.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from fabric_lite.arguments import ArgumentCheck, is_int
from fabric_lite.callbacks.base import Callback, is_logger
from fabric_lite.settings import RunConfig, resolve_run_config
from fabric_lite.strategies.environments import LaunchEnvironment

__all__ = ["TrainerSettings", "resolve_settings", "resolve_trainer_run_config", "apply_torch_settings",
           "default_logger"]


@dataclass
class TrainerSettings:
    """What a Trainer runs with, after the checks and Lightning's rules between arguments."""

    max_epochs: int
    max_steps: int
    max_time: Optional[float]
    accelerator: str
    devices: Union[int, str, None]
    num_nodes: int
    strategy: Any
    precision: Any
    callbacks: List[Callback]
    logger: Union[List[Callback], bool, None]
    gradient_clip_val: Optional[float]
    gradient_clip_algorithm: str
    accumulate_grad_batches: int
    val_check_interval: Union[int, float]
    check_val_every_n_epoch: int
    #: batch limits by stage ("train", "validate", "test", "predict"): None, a count or a fraction
    limits: Dict[str, Union[int, float, None]] = field(default_factory=dict)
    fast_dev_run: Union[bool, int] = False
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 50
    default_root_dir: str = ""
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    deterministic: Union[bool, str, None] = False
    sync_batchnorm: bool = False
    explain: bool = False
    min_epochs: Optional[int] = None
    min_steps: Optional[int] = None
    #: 0: off; a count or a fraction of the batches, read in order, in every epoch (training and validation)
    overfit_batches: Union[int, float] = 0
    detect_anomaly: bool = False
    inference_mode: bool = True
    reload_dataloaders_every_n_epochs: int = 0
    use_distributed_sampler: bool = True
    benchmark: Optional[bool] = None
    barebones: bool = False


def check_unknown(known: Sequence[str], unknown: Dict[str, Any]) -> None:
    """Refuse arguments the Trainer does not take, suggesting the closest known name."""
    if not unknown:
        return
    hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
    detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
    raise TypeError(f"Unknown Trainer argument(s): {detail}. Known arguments: {', '.join(known)}.")


def resolve_settings(check: ArgumentCheck, given: Dict[str, Any]) -> TrainerSettings:
    """Check every argument in `given` (by the Trainer's names) and resolve them into one TrainerSettings."""
    g = dict(given)
    barebones = check.bool("barebones", g["barebones"],
                           hint="True turns off logging, the progress bar, checkpoints, the model summary and the "
                                "sanity check, to measure the Trainer's own cost")
    if barebones:
        _refuse_in_barebones(check, g)
    for name, usual in (("enable_progress_bar", True), ("enable_checkpointing", True), ("enable_model_summary", True),
                        ("log_every_n_steps", 50), ("num_sanity_val_steps", 2)):
        if g[name] is None:  # Lightning's defaults: on, unless barebones
            g[name] = usual if not barebones else (_BAREBONES_LOG_EVERY if name == "log_every_n_steps" else
                                                   0 if name == "num_sanity_val_steps" else False)
    if barebones:
        g["logger"] = False
    g["precision"] = _precision_from_plugins(check, g["plugins"], g["precision"])
    max_epochs = check.int("max_epochs", g["max_epochs"], minimum=-1, allow_none=True, hint="-1: no epoch limit")
    max_steps = check.int("max_steps", g["max_steps"], minimum=-1, hint="-1: no step limit")
    max_time = check.number("max_time", g["max_time"], minimum=0, above=True, allow_none=True,
                            hint="seconds of training; None: no time limit")
    accelerator = check.accelerator("accelerator", g["accelerator"])
    devices = check.devices("devices", g["devices"])
    num_nodes = check.int("num_nodes", g["num_nodes"], minimum=1)
    strategy = check.strategy("strategy", g["strategy"])
    precision = check.precision("precision", g["precision"])
    callbacks = check.instances("callbacks", g["callbacks"], Callback, what="fabric_lite Callback instances",
                                single=True)
    logger = _check_logger(check, g["logger"])
    # (0 turns clipping off, as in Lightning; clipping to a norm of 0 would zero every gradient)
    gradient_clip_val = check.number("gradient_clip_val", g["gradient_clip_val"], minimum=0, allow_none=True,
                                     hint="0 or None turns clipping off") or None
    gradient_clip_algorithm = check.choice("gradient_clip_algorithm", g["gradient_clip_algorithm"], ("norm", "value"))
    accumulate_grad_batches = check.int("accumulate_grad_batches", g["accumulate_grad_batches"], minimum=1)
    val_check_interval = _check_val_check_interval(check, g["val_check_interval"])
    check_val_every_n_epoch = check.int("check_val_every_n_epoch", g["check_val_every_n_epoch"], minimum=1,
                                        hint="validate at the end of every N-th epoch")
    limits = {stage: _check_batch_limit(check, name, g[name]) for stage, name in (
        ("train", "limit_train_batches"), ("validate", "limit_val_batches"), ("test", "limit_test_batches"),
        ("predict", "limit_predict_batches"))}
    fast_dev_run = g["fast_dev_run"]
    if not isinstance(fast_dev_run, bool):
        fast_dev_run = check.int("fast_dev_run", fast_dev_run, minimum=0,
                                 hint="or True/False: True runs 1 batch, N runs N batches of each stage")
    num_sanity_val_steps = check.int("num_sanity_val_steps", g["num_sanity_val_steps"], minimum=0,
                                     hint="0 skips the sanity check")
    log_every_n_steps = check.int("log_every_n_steps", g["log_every_n_steps"], minimum=1,
                                  hint="step metrics are written every N optimizer steps and at epoch ends")
    default_root_dir = check.path("default_root_dir", g["default_root_dir"])
    enable_progress_bar = check.bool("enable_progress_bar", g["enable_progress_bar"])
    enable_checkpointing = check.bool("enable_checkpointing", g["enable_checkpointing"])
    enable_model_summary = check.bool("enable_model_summary", g["enable_model_summary"],
                                      hint="the layer and parameter table printed when fit starts")
    deterministic = g["deterministic"]
    if deterministic is not None and deterministic != "warn":
        check.bool("deterministic", deterministic, allow_none=True,
                   hint="or 'warn': deterministic kernels, warning where torch has none")
    sync_batchnorm = check.bool("sync_batchnorm", g["sync_batchnorm"],
                                hint="BatchNorm statistics over every process's batch under DDP")
    explain = check.bool("explain", g["explain"])
    min_epochs = check.int("min_epochs", g["min_epochs"], minimum=0, allow_none=True,
                           hint="train at least this many epochs, even when a callback asks to stop")
    min_steps = check.int("min_steps", g["min_steps"], minimum=0, allow_none=True,
                          hint="train at least this many optimizer steps, even when a callback asks to stop")
    overfit_batches = _check_batch_limit(check, "overfit_batches", g["overfit_batches"]) or 0
    detect_anomaly = check.bool("detect_anomaly", g["detect_anomaly"],
                                hint="torch.autograd anomaly detection during fit: slow, names the op that made a NaN")
    inference_mode = check.bool("inference_mode", g["inference_mode"],
                                hint="True: evaluate under torch.inference_mode; False: under torch.no_grad")
    reload_every = check.int("reload_dataloaders_every_n_epochs", g["reload_dataloaders_every_n_epochs"], minimum=0,
                             hint="call the *_dataloader() methods again every N epochs; 0: never")
    use_distributed_sampler = check.bool("use_distributed_sampler", g["use_distributed_sampler"],
                                         hint="False: each process reads its loader as given (shard it yourself)")
    benchmark = check.bool("benchmark", g["benchmark"], allow_none=True,
                           hint="torch.backends.cudnn.benchmark; None: as set, or False with deterministic=True")
    if deterministic:
        if benchmark is None:
            benchmark = False
        elif benchmark:
            warnings.warn("Trainer(deterministic=True, benchmark=True): with cudnn.benchmark on, cuDNN picks its "
                          "kernels by timing them, so results may differ between runs despite deterministic=True.",
                          UserWarning, stacklevel=4)
    if overfit_batches:
        limits["train"] = limits["validate"] = overfit_batches
    if fast_dev_run:
        n = 1 if fast_dev_run is True else int(fast_dev_run)
        max_epochs, max_steps, num_sanity_val_steps = 1, n, 0
        limits = {k: (v if overfit_batches and k in ("train", "validate") else n) for k, v in limits.items()}
        enable_checkpointing = False
    return TrainerSettings(
        max_epochs=max_epochs if max_epochs is not None else (1000 if max_steps == -1 else -1),
        max_steps=max_steps, max_time=max_time, accelerator=accelerator, devices=devices, num_nodes=num_nodes,
        strategy=strategy, precision=precision, callbacks=callbacks, logger=logger,
        gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
        accumulate_grad_batches=accumulate_grad_batches, val_check_interval=val_check_interval,
        check_val_every_n_epoch=check_val_every_n_epoch, limits=limits, fast_dev_run=fast_dev_run,
        num_sanity_val_steps=num_sanity_val_steps, log_every_n_steps=log_every_n_steps,
        default_root_dir=os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd(),
        enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing,
        enable_model_summary=enable_model_summary, deterministic=deterministic, sync_batchnorm=sync_batchnorm,
        explain=explain, min_epochs=min_epochs, min_steps=min_steps, overfit_batches=overfit_batches,
        detect_anomaly=detect_anomaly, inference_mode=inference_mode, reload_dataloaders_every_n_epochs=reload_every,
        use_distributed_sampler=use_distributed_sampler, benchmark=benchmark, barebones=barebones,
    )


def resolve_trainer_run_config(settings: TrainerSettings, launch_env: LaunchEnvironment) -> RunConfig:
    """The RunConfig the Trainer's Accelerator is built from: its settings under the Accelerator's names, resolved
    with the launch environment the Trainer read. A short last window of an epoch averages over its real length
    (divide_loss_by="window", see engine.py)."""
    arguments = {
        "strategy": settings.strategy, "devices": None if settings.devices == "auto" else settings.devices,
        "mixed_precision": str(settings.precision), "accelerator": settings.accelerator,
        "gradient_accumulation_steps": settings.accumulate_grad_batches, "divide_loss_by": "window",
    }
    return resolve_run_config(arguments, launch_env=launch_env)


def apply_torch_settings(settings: TrainerSettings) -> None:
    """Set torch's process-wide switches the settings ask for (after every check has passed)."""
    if settings.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=settings.deterministic == "warn")
    if settings.benchmark is not None:  # (None leaves the session's setting as it is)
        torch.backends.cudnn.benchmark = settings.benchmark


#: barebones: step metrics are never written on their own (only at epoch ends)
_BAREBONES_LOG_EVERY = 10 ** 9

#: what barebones turns off: the argument, and the values that leave it off
_BAREBONES_OFF = {
    "enable_checkpointing": (None, False), "logger": (None, False), "enable_progress_bar": (None, False),
    "log_every_n_steps": (None, 0), "enable_model_summary": (None, False), "num_sanity_val_steps": (None, 0),
    "fast_dev_run": (False, 0), "detect_anomaly": (False,), "profiler": (None,),
}


def _refuse_in_barebones(check: ArgumentCheck, given: Dict[str, Any]) -> None:
    """barebones=True with a feature it turns off asked for: refuse, naming the feature (as Lightning does)."""
    for name, off in _BAREBONES_OFF.items():
        value = given[name]
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            check.fail(name, value, f"is not available with barebones=True, which turns off logging, the progress "
                                    f"bar, checkpoints, the model summary, the sanity check, fast_dev_run, "
                                    f"detect_anomaly and the profiler. Drop {name}, or barebones=True.")
    # (log_every_n_steps=0 means "never" under barebones only; elsewhere it is refused by its own check)
    given["log_every_n_steps"] = None if given["log_every_n_steps"] == 0 else given["log_every_n_steps"]


def _precision_from_plugins(check: ArgumentCheck, plugins: Any, precision: Any) -> Any:
    """`plugins=`: a precision plugin (fabric_lite's `Precision`) sets the precision; Lightning's other plugin kinds
    (cluster environments, checkpoint IO, layer sync) have no counterpart here and are refused by name."""
    if plugins is None:
        return precision
    from fabric_lite.strategies.precision import Precision
    from fabric_lite.refusals import NotSupportedError

    items = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    chosen = None
    for item in items:
        if isinstance(item, Precision):
            if chosen is not None:
                check.fail("plugins", plugins, "holds two precision plugins; keep one.")
            chosen = item.name
            continue
        name = item if isinstance(item, str) else type(item).__name__
        raise NotSupportedError(
            f"Trainer(plugins=[{name}]): the {name!r} plugin has no counterpart in fabric_lite. A precision plugin "
            f"(fabric_lite.strategies.precision.Precision) is accepted; the launch environment (torchrun, SLURM, "
            f"...) is read by itself, checkpoints are written by the strategy's own format, and sync_batchnorm=True "
            f"replaces a layer-sync plugin. Drop the plugin, or use the Trainer argument that does its work.")
    if chosen is None:
        return precision
    if precision not in ("32-true", chosen):  # (the default, or the same value, agree with the plugin)
        check.fail("precision", precision, f"and plugins=[Precision({chosen!r})] both set the precision; pass one.")
    return chosen


def _check_logger(check: ArgumentCheck, value: Any) -> Union[List[Callback], bool, None]:
    """None (only the loggers in callbacks), True (a default logger, unless callbacks hold one), False (no
    logger), or a logger callback or a list of them (returned as a new list)."""
    if value is None or isinstance(value, bool):
        return value
    rule = ("must be a logger callback (TensorBoardLogger, CSVLogger, or another Callback that implements "
            "on_log), a list of them, True (a default logger) or False/None")
    if isinstance(value, Callback):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        check.fail("logger", value, f"{rule}; got {type(value).__name__}.", TypeError)
    for i, item in enumerate(items):
        if not is_logger(item):
            where = "" if item is value else f"item {i} "
            why = ("a Callback that logs nothing (no on_log): pass it in callbacks=[...]"
                   if isinstance(item, Callback) else "not a Callback")
            check.fail("logger", value, f"{rule}; {where}{type(item).__name__} is {why}.", TypeError)
    return items


def default_logger(root: str) -> Callback:
    """`logger=True`: a TensorBoardLogger under default_root_dir/lightning_logs where tensorboard is installed,
    else a CSVLogger there (as Lightning chooses)."""
    import importlib.util

    from fabric_lite.callbacks.loggers import CSVLogger, TensorBoardLogger

    if importlib.util.find_spec("tensorboard") is not None:
        return TensorBoardLogger(root, name="lightning_logs")
    return CSVLogger(root, name="lightning_logs")


def _check_val_check_interval(check: ArgumentCheck, value: Any) -> Union[int, float]:
    """An int >= 1 (validate every N training batches) or a float in (0, 1] (a fraction of the epoch)."""
    if is_int(value):
        return check.int("val_check_interval", value, minimum=1,
                         hint="validate every N training batches; or a float in (0.0, 1.0]: a fraction of the epoch")
    return check.number("val_check_interval", value, minimum=0.0, maximum=1.0, above=True,
                        hint="a fraction of the epoch, 1.0: at its end; or an integer >= 1: every N training batches")


def _check_batch_limit(check: ArgumentCheck, name: str, value: Any) -> Union[int, float, None]:
    """None (every batch), an int >= 0 (that many batches) or a float in [0, 1] (that fraction of the loader)."""
    if value is None or is_int(value):
        return check.int(name, value, minimum=0, allow_none=True,
                         hint="that many batches; or a float in [0.0, 1.0]: that fraction of the loader")
    return check.number(name, value, minimum=0.0, maximum=1.0, allow_none=True,
                        hint="a fraction of the loader; or an integer >= 0: that many batches; None: all of them")
