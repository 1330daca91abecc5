"""The trainer door: `Trainer` holds the settings and entry points; the loops live in `loops.py`.

Built on the Accelerator: each micro-step (accumulation window, no-sync, backward, clipping, optimizer
step) runs through its step engine (`engine.py`), and device placement, sharding and precision through
the same Strategy the raw door uses. The Trainer owns the loop (epochs, when windows end, validation,
logging, checkpoints, callbacks) and nothing else.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from fabric_lite.accelerator.accelerator import Accelerator
from fabric_lite.arguments import ArgumentCheck, is_int
from fabric_lite.callbacks.base import Callback, is_logger
from fabric_lite.strategies.environments import detect_process, read_launch_settings, records_explain_arguments
from fabric_lite.trainer.logged_metrics import MetricStore
from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.configure_optimizers import SchedulerConfig, parse_optimizers
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler
from fabric_lite.launch.preemption import PreemptionWatch

__all__ = ["Trainer", "convert_sync_batchnorm", "SYNC_BATCHNORM_DEVICES"]

#: The device types torch's SyncBatchNorm synchronizes across processes (it refuses CPU tensors).
SYNC_BATCHNORM_DEVICES = ("cuda", "xpu", "hpu")


_STEP_METHODS = {"train": "training_step", "validate": "validation_step", "test": "test_step",
                 "predict": "predict_step"}


class _StepRunner(nn.Module):
    """Routes the strategy's wrapped forward to the module's step methods (so DDP sees a forward)."""

    def __init__(self, module: TrainModule) -> None:
        super().__init__()
        self.module = module

    # Checkpoints hold the TrainModule's own keys ("net.0.weight", not "module.net.0.weight"), so
    # the exported weights load straight into the user's module.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, batch: Any, batch_idx: int, stage: str = "train") -> Any:
        return getattr(self.module, _STEP_METHODS[stage])(batch, batch_idx)


class _TrainerState:
    """The Trainer's part of a checkpoint: counters, callback states, hyperparameters."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> Dict[str, Any]:
        t = self.trainer
        extra: Dict[str, Any] = {}
        t.module.on_save_checkpoint(extra)
        for cb in t.callbacks:
            cb.on_save_checkpoint(t, t.module, extra)
        return {
            "epoch": t.current_epoch, "global_step": t.global_step, "epoch_finished": t.epoch_finished,
            "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
            "hyper_parameters": dict(t.module.hparams), "extra": extra,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        t = self.trainer
        t.current_epoch = int(state["epoch"]) + (1 if state.get("epoch_finished") else 0)
        t.global_step = int(state["global_step"])
        for cb in t.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        extra = state.get("extra", {})
        t.module.on_load_checkpoint(extra)
        for cb in t.callbacks:
            cb.on_load_checkpoint(t, t.module, extra)


class _LoggedAggregates:
    """Each process's unfinished epoch aggregates of `self.log` (saved per rank: they differ between ranks)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> Dict[str, Any]:
        return self.trainer.metric_store.state_dict(self.trainer.module)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.trainer.metric_store.load_state_dict(state, self.trainer.module)


class Trainer:
    """Fit a TrainModule: `Trainer(max_epochs=3, precision="bf16-mixed").fit(module, train_loader, val_loader)`."""

    #: Under `fabric-lite explain`, the arguments this Trainer was given; None otherwise.
    explain_arguments: Optional[Dict[str, Any]] = None

    @records_explain_arguments
    def __init__(
        self, *, max_epochs: Optional[int] = None, max_steps: int = -1, max_time: Optional[float] = None,
        accelerator: str = "auto", devices: Union[int, str] = "auto", num_nodes: int = 1,
        strategy: Any = "auto", precision: Any = "32-true",
        callbacks: Union[Sequence[Callback], Callback, None] = None,
        logger: Union[Sequence[Callback], Callback, bool, None] = None,
        gradient_clip_val: Optional[float] = None, gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1, val_check_interval: Union[int, float] = 1.0,
        check_val_every_n_epoch: int = 1, limit_train_batches: Union[int, float, None] = None,
        limit_val_batches: Union[int, float, None] = None, limit_test_batches: Union[int, float, None] = None,
        limit_predict_batches: Union[int, float, None] = None, fast_dev_run: Union[bool, int] = False,
        num_sanity_val_steps: int = 2, log_every_n_steps: int = 50, default_root_dir: Optional[str] = None,
        enable_progress_bar: bool = True, enable_checkpointing: bool = True, enable_model_summary: bool = True,
        deterministic: Union[bool, str, None] = False, profiler: Any = None, sync_batchnorm: bool = False,
        explain: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            known = list(inspect.signature(Trainer.__init__).parameters)[1:-1]
            hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
            detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise TypeError(f"Unknown Trainer argument(s): {detail}. Known arguments: {', '.join(known)}.")
        # Every argument is checked here, before anything starts (a relaunch, the strategy, torch's settings).
        check = ArgumentCheck("Trainer")
        max_epochs = check.int("max_epochs", max_epochs, minimum=-1, allow_none=True, hint="-1: no epoch limit")
        max_steps = check.int("max_steps", max_steps, minimum=-1, hint="-1: no step limit")
        max_time = check.number("max_time", max_time, minimum=0, above=True, allow_none=True,
                                hint="seconds of training; None: no time limit")
        accelerator = check.accelerator("accelerator", accelerator)
        devices = check.devices("devices", devices)
        num_nodes = check.int("num_nodes", num_nodes, minimum=1)
        strategy = check.strategy("strategy", strategy)
        precision = check.precision("precision", precision)
        callbacks = check.instances("callbacks", callbacks, Callback, what="fabric_lite Callback instances",
                                    single=True)
        logger = _check_logger(check, logger)
        # (0 turns clipping off, as in Lightning; clipping to a norm of 0 would zero every gradient)
        gradient_clip_val = check.number("gradient_clip_val", gradient_clip_val, minimum=0, allow_none=True,
                                         hint="0 or None turns clipping off") or None
        gradient_clip_algorithm = check.choice("gradient_clip_algorithm", gradient_clip_algorithm, ("norm", "value"))
        accumulate_grad_batches = check.int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
        val_check_interval = _check_val_check_interval(check, val_check_interval)
        check_val_every_n_epoch = check.int("check_val_every_n_epoch", check_val_every_n_epoch, minimum=1,
                                            hint="validate at the end of every N-th epoch")
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches = (
            _check_batch_limit(check, name, value) for name, value in (
                ("limit_train_batches", limit_train_batches), ("limit_val_batches", limit_val_batches),
                ("limit_test_batches", limit_test_batches), ("limit_predict_batches", limit_predict_batches)))
        if not isinstance(fast_dev_run, bool):
            fast_dev_run = check.int("fast_dev_run", fast_dev_run, minimum=0,
                                     hint="or True/False: True runs 1 batch, N runs N batches of each stage")
        num_sanity_val_steps = check.int("num_sanity_val_steps", num_sanity_val_steps, minimum=0,
                                         hint="0 skips the sanity check")
        log_every_n_steps = check.int("log_every_n_steps", log_every_n_steps, minimum=1,
                                      hint="step metrics are written every N optimizer steps and at epoch ends")
        default_root_dir = check.path("default_root_dir", default_root_dir)
        enable_progress_bar = check.bool("enable_progress_bar", enable_progress_bar)
        enable_checkpointing = check.bool("enable_checkpointing", enable_checkpointing)
        enable_model_summary = check.bool("enable_model_summary", enable_model_summary,
                                          hint="the layer and parameter table printed when fit starts")
        if deterministic is not None and deterministic != "warn":
            check.bool("deterministic", deterministic, allow_none=True,
                       hint="or 'warn': deterministic kernels, warning where torch has none")
        profiler = _check_profiler(check, profiler)
        sync_batchnorm = check.bool("sync_batchnorm", sync_batchnorm,
                                    hint="BatchNorm statistics over every process's batch under DDP")
        explain = check.bool("explain", explain)
        if fast_dev_run:
            n = 1 if fast_dev_run is True else int(fast_dev_run)
            max_epochs, max_steps, num_sanity_val_steps = 1, n, 0
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            enable_checkpointing = False
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
        if read_launch_settings().explain_dry_run:  # one process stands in for the planned launch
            num_nodes = 1  # the plan compares the requested nodes with the launch
        else:
            _relaunch_if_needed(devices, num_nodes, _xla_replicas(accelerator, strategy))
        # The Trainer's micro-steps run through the Accelerator's step engine; a short last window of an
        # epoch averages over its real length (divide_loss_by="window", see engine.py).
        self.accelerator = Accelerator(
            strategy=strategy, devices=None if devices == "auto" else devices, mixed_precision=str(precision),
            accelerator=accelerator, gradient_accumulation_steps=accumulate_grad_batches, divide_loss_by="window",
        )
        self.strategy = self.accelerator.strategy
        if num_nodes != self.strategy.process.num_nodes:
            raise ValueError(
                f"num_nodes={num_nodes} disagrees with the launch environment, which has "
                f"{self.strategy.process.num_nodes} node(s). Launch with `fabric-lite launch --nnodes {num_nodes}`."
            )
        if sync_batchnorm and self.strategy.world_size > 1 and self.device.type not in SYNC_BATCHNORM_DEVICES:
            check.fail("sync_batchnorm", sync_batchnorm,
                       f"torch's SyncBatchNorm synchronizes {'/'.join(SYNC_BATCHNORM_DEVICES)} tensors only, and "
                       f"these {self.strategy.world_size} processes train on {self.device.type!r} (torch raises "
                       f"'SyncBatchNorm expected input tensor to be on GPU' at the first training step). Train on "
                       f"GPUs, or drop sync_batchnorm: each process then normalizes over its own batch.")
        self.sync_batchnorm = sync_batchnorm
        #: Times the hooks and steps when given one (`profiler="simple"`); a PassThroughProfiler otherwise.
        self.profiler: Profiler = profiler
        self.max_epochs = max_epochs if max_epochs is not None else (1000 if max_steps == -1 else -1)
        self.max_steps = max_steps
        self.max_time = max_time
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.accumulate_grad_batches = accumulate_grad_batches
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limits = {"train": limit_train_batches, "validate": limit_val_batches, "test": limit_test_batches,
                       "predict": limit_predict_batches}
        self.num_sanity_val_steps = num_sanity_val_steps
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()
        self.fast_dev_run = fast_dev_run
        self.explain = explain  # fit() prints the plan (explain.py) and returns without training
        self.callbacks: List[Callback] = callbacks  # (a new list: the checks above copied it)
        self.enable_model_summary = enable_model_summary
        self._add_default_callbacks(enable_progress_bar, enable_checkpointing, enable_model_summary, logger)
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.sanity_checking = False
        self.epoch_finished = False
        self.metric_store = MetricStore(self.strategy)
        self.optimizers: List[Any] = []
        self.lr_scheduler_configs: List[SchedulerConfig] = []
        self.start_time: Optional[float] = None
        self.preemption = PreemptionWatch()
        self.module: Optional[TrainModule] = None
        #: ids of the TrainModules whose configure_model() has run (once each, whatever stage comes first).
        self.configured_models: set = set()
        self.model: Optional[nn.Module] = None
        self.eval_model: Optional[nn.Module] = None

    def _add_default_callbacks(self, progress_bar: bool, checkpointing: bool, model_summary: bool,
                               logger: Union[List[Callback], bool, None]) -> None:
        from fabric_lite.callbacks.checkpoint import ModelCheckpoint
        from fabric_lite.callbacks.progress import ProgressBar, ProgressBarBase
        from fabric_lite.callbacks.summary import ModelSummary

        # logger=: True adds a default logger (unless callbacks hold one), False refuses loggers in callbacks,
        # loggers given go ahead of the other callbacks, in their order.
        if logger is False:
            given = next((c for c in self.callbacks if is_logger(c)), None)
            if given is not None:
                raise ValueError(f"logger=False, but a {type(given).__name__} is in callbacks; drop one of them.")
        elif logger is True:
            if not any(is_logger(c) for c in self.callbacks):
                self.callbacks.insert(0, _default_logger(self.default_root_dir))
        elif logger is not None:  # (in the order given, ahead of the other callbacks; each once)
            given = {id(c) for c in logger}
            self.callbacks[:] = [*logger, *(c for c in self.callbacks if id(c) not in given)]
        summary = next((c for c in self.callbacks if isinstance(c, ModelSummary)), None)
        if not model_summary and summary is not None:
            raise ValueError("enable_model_summary=False, but a ModelSummary is in callbacks; drop one of them.")

        bar = next((c for c in self.callbacks if isinstance(c, ProgressBarBase)), None)
        if not progress_bar:
            if bar is not None:
                raise ValueError(f"enable_progress_bar=False, but a {type(bar).__name__} is in callbacks; "
                                 f"drop one of them.")
        elif bar is None:
            self.callbacks.append(ProgressBar())
        if not checkpointing:
            if any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
                raise ValueError("enable_checkpointing=False, but a ModelCheckpoint is in callbacks; drop one of them.")
        elif not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        self._order_callbacks()

    def _order_callbacks(self) -> None:
        """Callbacks that report what the others did at a hook (`Callback.runs_last`) go last, in their order."""
        self.callbacks.sort(key=lambda c: bool(getattr(c, "runs_last", False)))  # (a stable sort)

    def _add_model_summary(self) -> None:
        """The default ModelSummary joins the callbacks when fit starts, unless one is there already: after
        `fabric-lite explain`'s return (which trains nothing and prints no summary), and not at construction, so
        that `callbacks` then holds what was given plus the progress bar and checkpoint defaults, as before."""
        from fabric_lite.callbacks.summary import ModelSummary

        if not any(isinstance(c, ModelSummary) for c in self.callbacks):
            self.callbacks.append(ModelSummary())
            self._order_callbacks()

    def timed_callbacks(self) -> List[Any]:
        """The callbacks, each hook read from them timed by the profiler (only while one is on)."""
        return [self.profiler.timed(cb, "Callback", Callback) for cb in self.callbacks]

    def _start_profile(self, stage: str) -> None:
        self.profiler.setup(stage, rank=self.global_rank if self.world_size > 1 else None)

    def _end_profile(self, stage: str) -> None:
        """Print the stage's report on the main process (each process writes its report file, if it has one)."""
        self.profiler.log_dir = self.log_dir
        text = self.profiler.describe()
        if text and self.is_global_zero:
            print(text, file=sys.stderr, flush=True)
        self.profiler.teardown(stage)

    # -- what callbacks and modules read -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def world_size(self) -> int:
        """Processes in the job (Lightning's `world_size`)."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the job (0 on the main process)."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """The rank of this process's node."""
        return self.strategy.node_rank

    @property
    def num_nodes(self) -> int:
        return self.strategy.process.num_nodes

    @property
    def num_devices(self) -> int:
        """Devices this node trains on: one per process, or under SPMD (one process driving every device) the
        devices of its mesh."""
        if self.strategy.drives_all_devices:
            devices = getattr(getattr(self.strategy, "mesh", None), "device_ids", None)
            if devices is not None:
                return max(1, len(devices) // self.num_nodes)
        return self.strategy.process.local_world_size

    @property
    def loggers(self) -> List[Callback]:
        """The logger callbacks (from `logger=` and `callbacks=`), in the order they run."""
        return [c for c in self.callbacks if is_logger(c)]

    @property
    def logger(self) -> Optional[Callback]:
        """The first logger callback, or None."""
        return next((c for c in self.callbacks if is_logger(c)), None)

    @property
    def log_dir(self) -> str:
        """The first logger's directory (its save_dir until it has chosen its version), else default_root_dir."""
        logger = self.logger
        found = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        return os.fspath(found) if found is not None else self.default_root_dir

    @property
    def callback_metrics(self) -> Dict[str, torch.Tensor]:
        """Every logged value for callbacks (early stopping, checkpoints): the latest training step values
        (`name` and `name_step`) and epoch results (`name` and `name_epoch`), as device tensors."""
        self.metric_store.refresh()
        return self.metric_store.callback_metrics

    @property
    def logged_metrics(self) -> Dict[str, torch.Tensor]:
        """The latest value of each name sent to the loggers (`logger=True`), as tensors."""
        self.metric_store.refresh()
        return self.metric_store.logged_metrics

    @property
    def progress_bar_metrics(self) -> Dict[str, float]:
        """The latest `prog_bar=True` values, as floats."""
        self.metric_store.refresh()
        return self.metric_store.progress_bar_metrics

    @property
    def checkpoint_callback(self) -> Optional[Callback]:
        from fabric_lite.callbacks.checkpoint import ModelCheckpoint

        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        """Send values to every logger callback (floats; tensors are read here, once)."""
        if not metrics:
            return
        values = {k: float(v.detach() if v.requires_grad else v) if isinstance(v, torch.Tensor) else float(v)
                  for k, v in metrics.items()}
        self.metric_store.logged_metrics.update(metrics)
        for cb in self.callbacks if not self.profiler.enabled else self.timed_callbacks():
            cb.on_log(self, values, self.global_step if step is None else step)

    def call_hook(self, hook: str, *args: Any) -> None:
        """Run a hook on the module, then on every callback (each timed, under a profiler)."""
        module: Any = self.module
        callbacks: List[Any] = self.callbacks
        if self.profiler.enabled:
            module, callbacks = self.profiler.timed(module, "TrainModule", TrainModule), self.timed_callbacks()
        store = self.metric_store
        running, store.fx = store.fx, hook  # (what self.log may do depends on the hook)
        fn = getattr(module, hook, None)
        if fn is not None:
            fn(*args)
        for cb in callbacks:
            getattr(cb, hook)(self, self.module, *args)
        store.fx = running

    def count_manual_step(self, *_: Any) -> None:
        self.global_step += 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`TrainModule.manual_backward`: backward through the step engine (loss scaling, DDP sync)."""
        self.accelerator.backward(loss, self.model, **kwargs)

    def time_is_up(self) -> bool:
        return self.max_time is not None and self.start_time is not None and \
            time.monotonic() - self.start_time >= self.max_time

    # -- entry points ------------------------------------------------------------------------------
    def fit(self, module: TrainModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Optional[DataModule] = None, ckpt_path: Optional[str] = None) -> None:
        """Train `module`; `ckpt_path="last"` resumes from the newest checkpoint if there is one."""
        from fabric_lite.trainer import loops

        train, val = self._loaders(module, datamodule, "fit", train_dataloaders, val_dataloaders)
        if train is None:
            raise ValueError("fit() needs train_dataloaders, or a datamodule with train_dataloader().")
        # A second fit() on this Trainer starts from clean registrations (no duplicate checkpoint entries).
        self.accelerator.free_memory()
        self.accelerator.registered_objects.clear()
        self.accelerator.per_process_objects.clear()
        self.train_dataloader = self.accelerator.prepare_data_loader(train)
        # the user's loader and where it came from, named if it yields no batches (loops.empty_loader_warning)
        self.train_dataloader_source = (train, "given to fit()" if datamodule is None
                                        else f"from {type(datamodule).__name__}.train_dataloader()")
        self.val_dataloaders = [self._prepare_eval_loader(v) for v in _as_list(val)]
        self._attach(module, with_optimizers=True)
        for sched in self.lr_scheduler_configs:
            self.accelerator.register_for_checkpointing(sched.scheduler)
        if not module.automatic_optimization:
            for opt in self.optimizers:  # global_step counts optimizer steps, which the module takes itself
                if not hasattr(opt.optimizer, "register_step_post_hook"):
                    raise ValueError(f"{type(self.strategy).__name__} steps its optimizer inside its engine; manual "
                                     f"optimization (automatic_optimization=False) is not available with it.")
                opt.optimizer.register_step_post_hook(self.count_manual_step)
        if self.explain or self.accelerator.explain_requested:  # print the plan instead of training
            from fabric_lite.explain import explain_trainer

            explain_trainer(self, module, ckpt_path)  # exits 0 under `fabric-lite explain`
            return
        self.accelerator.register_for_checkpointing(_TrainerState(self))
        self.accelerator.register_for_checkpointing(_LoggedAggregates(self), per_process=True)
        if self.enable_model_summary:
            self._add_model_summary()
        profiling = self.profiler.enabled
        if profiling:
            self._start_profile("fit")
        callbacks = self.timed_callbacks() if profiling else self.callbacks
        for cb in callbacks:
            cb.setup(self, module, "fit")
        process = detect_process()
        if ckpt_path in (None, "last") and process.started_by_ray:
            ckpt_path = self._ray_checkpoint(ckpt_path)
        if ckpt_path is None and process.restart_count > 0:
            ckpt_path = "last"  # restarted by torch elastic: go on from the newest whole checkpoint
            if self.is_global_zero:
                print(f"fabric_lite: restart {process.restart_count}: resuming from the newest checkpoint "
                      f"under {self.checkpoint_dir()}", file=sys.stderr, flush=True)
        if ckpt_path is not None:
            self._restore(ckpt_path)
        self.preemption = PreemptionWatch()
        self.preemption.install()
        try:
            loops.run_fit(self)
            self.accelerator.wait_for_checkpoint()  # the last save is published (or its failure raised) on return
        except BaseException as err:
            for cb in callbacks:
                cb.on_exception(self, module, err)
            raise
        finally:
            self.accelerator.checkpoint_saver.close(quiet=True)  # after a failure too: nothing is left writing
            self.preemption.uninstall()
            for cb in callbacks:
                cb.teardown(self, module, "fit")
            if datamodule is not None:  # after a failure too, as its setup ran
                datamodule.teardown("fit")
            if profiling:
                self._end_profile("fit")

    def validate(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
                 datamodule: Optional[DataModule] = None) -> List[Dict[str, float]]:
        return self._evaluate("validate", module, dataloaders, datamodule)

    def test(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
             datamodule: Optional[DataModule] = None) -> List[Dict[str, float]]:
        return self._evaluate("test", module, dataloaders, datamodule)

    def predict(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
                datamodule: Optional[DataModule] = None) -> List[Any]:
        from fabric_lite.trainer import loops

        module = module or self.module
        if module is None:
            raise ValueError("predict() needs a module (or a Trainer that has already fit one).")
        loaders = self._eval_loaders(module, datamodule, "predict", dataloaders)
        profiling = self.profiler.enabled
        if profiling:
            self._start_profile("predict")
        try:
            return loops.run_predict(self, loaders)
        finally:
            if datamodule is not None:
                datamodule.teardown("predict")
            if profiling:
                self._end_profile("predict")

    def _evaluate(self, stage: str, module: Optional[TrainModule], dataloaders: Any,
                  datamodule: Optional[DataModule]) -> List[Dict[str, float]]:
        from fabric_lite.trainer import loops

        module = module or self.module
        if module is None:
            raise ValueError(f"{stage}() needs a module (or a Trainer that has already fit one).")
        loaders = self._eval_loaders(module, datamodule, stage, dataloaders)
        profiling = self.profiler.enabled
        if profiling:
            self._start_profile(stage)
        try:
            return loops.run_evaluation(self, stage, loaders)
        finally:
            if datamodule is not None:
                datamodule.teardown(stage)
            if profiling:
                self._end_profile(stage)

    def _eval_loaders(self, module: TrainModule, datamodule: Optional[DataModule], stage: str,
                      dataloaders: Any) -> List[Any]:
        loaders, _ = self._loaders(module, datamodule, stage, dataloaders, None)
        if loaders is None:
            raise ValueError(f"{stage}() needs dataloaders, or a datamodule with {stage}_dataloader().")
        if self.module is not module:
            self._attach(module)
        return [self._prepare_eval_loader(d) for d in _as_list(loaders)]

    def _prepare_eval_loader(self, loader: Any) -> Any:
        # Every sample exactly once (no even-batch padding), so metrics over the whole set are exact;
        # unless each forward is a collective (ZeRO-3), where a process that ran out would hang the rest:
        # then the last step is padded as in training, and its repeated samples count in epoch means.
        return self.accelerator.prepare_data_loader(loader, even_batches=self.strategy.forward_is_collective)

    # -- plumbing ----------------------------------------------------------------------------------
    def _loaders(self, module: TrainModule, datamodule: Optional[DataModule], stage: str, first: Any,
                 second: Any) -> tuple:
        if datamodule is None:
            return first, second
        if first is not None or second is not None:
            raise ValueError(f"Pass dataloaders or a datamodule to {stage}(), not both.")
        with self.accelerator.main_process_first():
            if self.is_global_zero:
                datamodule.prepare_data()
        datamodule.setup(stage)
        if datamodule.hparams:
            module.hparams.setdefault("datamodule", dict(datamodule.hparams))
        if stage == "fit":
            return datamodule.train_dataloader(), datamodule.val_dataloader()
        name = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}[stage]
        return getattr(datamodule, name)(), None

    def _attach(self, module: TrainModule, with_optimizers: bool = False) -> None:
        if not isinstance(module, TrainModule):
            raise TypeError(f"Trainer runs TrainModule subclasses, got {type(module).__name__}.")
        module.trainer = self
        self.module = module
        acc = self.accelerator
        if id(module) not in self.configured_models:  # layers built here land on the meta device under FSDP
            with acc.init_module():
                module.configure_model()
            self.configured_models.add(id(module))
        if with_optimizers and self.sync_batchnorm and self.world_size > 1:  # (fit only, as in Lightning)
            convert_sync_batchnorm(module)
        # the Accelerator's own check of prepare(model, optimizer), in the module's terms
        fix = (f"return an optimizer over this module's parameters from configure_optimizers, e.g. "
               f"torch.optim.AdamW(self.parameters(), lr=1e-3), built from the {type(module).__name__} passed to fit")
        if self.strategy.setup_takes_optimizers:  # an engine that owns model and optimizer (DeepSpeed)
            clip = self.gradient_clip_val if self.gradient_clip_algorithm == "norm" else None

            def prepare(optimizers: List[Any]) -> List[Any]:
                acc.check_optimizers(optimizers, [module], fix=fix)
                models, prepared = acc.setup_jointly([_StepRunner(module)], optimizers, self.accumulate_grad_batches,
                                                     gradient_clip_val=clip)
                self.model = models[0]
                return prepared

            if with_optimizers:
                self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers(), prepare)
            else:
                prepare([])
        else:
            self.model = acc.prepare_model(_StepRunner(module))
            if with_optimizers:
                def prepare_each(optimizers: List[Any]) -> List[Any]:
                    acc.check_optimizers(optimizers, [module], fix=fix)
                    return [acc.prepare_optimizer(o) for o in optimizers]

                self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers(),
                                                                              prepare_each)
        # Evaluation runs without the DDP wrapper: no gradients to sync, and no per-forward buffer
        # broadcast that would wait for a process that has run out of (unpadded) batches.
        self.eval_model = self.accelerator.unwrap_model(self.model)

    def save_checkpoint(self, path: str, blocking: bool = True, if_busy: str = "wait",
                        after_commit: Sequence[Callable[[], None]] = ()) -> Optional[str]:
        """Write a full checkpoint (weights, optimizers, schedulers, RNG, loop position, callbacks).

        Written whole or not at all; once published, ``latest`` in its directory names it. `blocking=False`
        returns once the state is copied and publishes it in the background (see `Accelerator.save_state`);
        returns None where `if_busy="skip"` skipped it. `after_commit` runs on the main process once published."""
        from fabric_lite.checkpoint import state as state_io

        return state_io.save_state(self.accelerator, path, update_latest=True, blocking=blocking, if_busy=if_busy,
                                   after_commit=after_commit,
                                   meta={"epoch": self.current_epoch, "global_step": self.global_step})

    def checkpoint_dir(self) -> str:
        callback = self.checkpoint_callback
        if callback is not None:
            callback.setup(self, self.module, "fit")  # type: ignore[arg-type]
            return callback.dirpath  # type: ignore[attr-defined]
        return f"{self.default_root_dir.rstrip('/')}/checkpoints"

    def _ray_checkpoint(self, ckpt_path: Optional[str]) -> Optional[str]:
        """Under Ray: the checkpoint Ray hands this run (a restarted worker group, a new driver on the same storage
        and run name) for "last"; for None too when it is a fabric_lite checkpoint (one RayReportCallback reported),
        so a run Ray restarts resumes by itself, as under torch elastic."""
        from fabric_lite.ray import get_checkpoint

        found = get_checkpoint()
        if found is None:
            return ckpt_path
        if ckpt_path is None:
            from fabric_lite.checkpoint import files as checkpoint_io

            try:
                checkpoint_io.read_manifest(found)
            except checkpoint_io.CheckpointError:
                return None  # the script's own kind of checkpoint: its business
        if self.is_global_zero:
            print(f"fabric_lite: resuming from the checkpoint Ray handed this run: {found}", file=sys.stderr, flush=True)
        return found

    def _restore(self, ckpt_path: str) -> None:
        if ckpt_path == "last":
            from fabric_lite.checkpoint import files as checkpoint_io

            root = self.checkpoint_dir()
            found = checkpoint_io.newest_whole_checkpoint(root) if self.is_global_zero else None
            found = self.strategy.broadcast_object(found)
            if found is None:
                return  # nothing saved yet: a fresh start, as Lightning does
            ckpt_path = found
        self.accelerator.load_state(ckpt_path)


def convert_sync_batchnorm(module: nn.Module) -> int:
    """Replace the BatchNorm layers inside `module` by SyncBatchNorm layers, in place, and return how many.

    The new layers hold the same parameters and running statistics (optimizers built before still step them);
    SyncBatchNorm layers already there are left as they are (with their process group). What `Trainer(
    sync_batchnorm=True)` does to the module before it is prepared, when several processes train."""
    from torch.nn.modules.batchnorm import _BatchNorm

    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, _BatchNorm) and not isinstance(child, nn.SyncBatchNorm):
            module.add_module(name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
            replaced += 1
        else:
            replaced += convert_sync_batchnorm(child)
    return replaced


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


def _check_profiler(check: ArgumentCheck, value: Any) -> Profiler:
    """None (no profiling: a PassThroughProfiler), "simple" (a SimpleProfiler) or a Profiler instance."""
    if value is None:
        return PassThroughProfiler()
    if isinstance(value, Profiler):
        return value
    rule = "must be 'simple', a Profiler instance such as SimpleProfiler(filename='perf'), or None"
    if not isinstance(value, str):
        check.fail("profiler", value, f"{rule}; got {type(value).__name__}.", TypeError)
    if value.lower() != "simple":
        other = value.lower() in ("advanced", "pytorch", "xla")
        check.fail("profiler", value, rule + (" (Lightning's cProfile and torch.profiler profilers are not "
                                              "available here)." if other else "."))
    return SimpleProfiler()


def _default_logger(root: str) -> Callback:
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


def _xla_replicas(accelerator: str, strategy: Any) -> Optional[bool]:
    """Whether this Trainer trains XLA replicas (True), one process over every device (None: SPMD), or neither
    (False), from what it was given: the launcher to start differs."""
    from fabric_lite.strategies import Strategy, strategy_class
    from fabric_lite.strategies.environments import read_xla_settings

    if isinstance(strategy, Strategy):
        cls: Any = type(strategy)
    else:
        cls = None if str(strategy).lower() == "auto" else strategy_class(str(strategy))
    if cls is not None and cls.drives_all_devices:
        return None
    name = str(accelerator).lower()
    return bool((cls is not None and cls.runtime_device_type == "xla") or name in ("tpu", "xla")
                or (name == "auto" and read_xla_settings().wants_xla))


def _relaunch_if_needed(devices: Union[int, str], num_nodes: int, xla: Optional[bool] = False) -> None:
    """`Trainer(devices=N)` in a script started with plain `python train.py`: start the script again
    under torch's elastic launcher on N processes, or as N XLA replicas under torch_xla's launcher (`xla`)
    (this process waits for them and exits with their code)."""
    import sys

    from fabric_lite.strategies.environments import detect_process, read_launch_settings

    process = detect_process()
    if not isinstance(devices, int) or devices <= 1 or process.is_distributed or xla is None:
        return
    if process.started_by_ray:  # Ray starts, places and restarts the processes: never a second launcher under it
        raise RuntimeError(
            f"Trainer(devices={devices}) in a single Ray process ({process.source}): under Ray, Ray starts the "
            f"processes. Run the training function in Ray Train's TorchTrainer(train_fn, scaling_config="
            f"ScalingConfig(num_workers={devices})) and leave `devices` out (or 'auto'), or pass devices=1.")
    if xla and read_launch_settings().accelerator == "xla":
        return  # a replica that torch_xla's launcher started (replicas that are threads share one environment)
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or not script.endswith(".py") or os.path.basename(sys.argv[0]) != os.path.basename(script):
        raise RuntimeError(
            f"Trainer(devices={devices}) needs {devices} processes, and this process was not started from a script "
            f"it can start again (a notebook or an interactive session). Use notebook_launcher(fn, "
            f"num_processes={devices}), or run `fabric-lite launch{' --tpu' if xla else ''} --nproc-per-node {devices} "
            f"train.py`."
        )
    if not os.path.isfile(script):  # moved or deleted since it started: every worker would fail to open it
        raise RuntimeError(
            f"Trainer(devices={devices}) starts this script again on {devices} processes, but {script} no longer "
            f"exists (moved or deleted while it ran). Put it back, or start it with `fabric-lite launch"
            f"{' --tpu' if xla else ''} --nproc-per-node {devices} PATH/TO/SCRIPT.py`.")
    import subprocess

    from fabric_lite.launch.launcher import torchrun_command

    if xla:  # (torch_xla's launcher, without `fabric-lite launch`'s config file: as torchrun below)
        cmd = [sys.executable, "-m", "fabric_lite.launch.xla_launch", str(devices), script, *sys.argv[1:]]
    else:  # (the script's own arguments pass through untouched)
        cmd = torchrun_command(devices, num_nodes, script, sys.argv[1:])
    raise SystemExit(subprocess.call(cmd))


def _as_list(loaders: Any) -> List[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]
