"""The trainer door: `Trainer` holds the settings and entry points; the loops live in `loops.py`.

Built on the Accelerator: each micro-step (accumulation window, no-sync, backward, clipping, optimizer
step) runs through its step engine (`engine.py`), and device placement, sharding and precision through
the same Strategy the raw door uses. The Trainer owns the loop (epochs, when windows end, validation,
logging, checkpoints, callbacks) and nothing else.
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from fabric_lite.accelerator.accelerator import Accelerator
from fabric_lite.arguments import ArgumentCheck, is_int
from fabric_lite.callbacks.base import Callback
from fabric_lite.events import FitRun, announces_construction
from fabric_lite.strategies.environments import read_launch_environment
from fabric_lite.trainer.barebones import BarebonesMetricStore
from fabric_lite.trainer.logged_metrics import MetricStore
from fabric_lite.trainer.module import DataModule, TrainModule
from fabric_lite.trainer.checkpointing import (
    LoggedAggregates, TrainerCheckpointState, load_eval_weights, restore,
)
from fabric_lite.trainer.facts import TrainerFacts
from fabric_lite.trainer.data_hooks import batch_transfer
from fabric_lite.trainer.data_connector import (
    STAGE_LOADERS, as_list, connect_data, datamodule_given_as_loaders, prepare_eval_loader, prepare_train_loader,
    teardown_data,
)
from fabric_lite.trainer.configure_optimizers import SchedulerConfig, parse_optimizers
from fabric_lite.trainer.relaunch import relaunch_if_needed, runtime_class
from fabric_lite.trainer.sync_batchnorm import SYNC_BATCHNORM_DEVICES, convert_sync_batchnorm
from fabric_lite.trainer.settings import (
    apply_torch_settings, check_unknown, resolve_settings, resolve_trainer_run_config,
)
from fabric_lite.trainer.manual_optimization import average_gradients_before_step
from fabric_lite.trainer.step_runner import StepRunner
from fabric_lite.trainer.callback_list import (
    add_default_callbacks, add_model_summary, merge_module_callbacks, order_callbacks,
)
from fabric_lite.trainer.profiler import Profiler
from fabric_lite.trainer.lightning_surface import TrainerLightningNames, check_refused_arguments, \
    check_refused_overrides

__all__ = ["Trainer", "convert_sync_batchnorm", "SYNC_BATCHNORM_DEVICES"]


class Trainer(TrainerFacts, TrainerLightningNames):
    """Fit a TrainModule: `Trainer(max_epochs=3, precision="bf16-mixed").fit(module, train_loader, val_loader)`.

    Features that watch a run (the profiler, `explain`, preemption, Ray) observe its events (`self.events`, see
    `fabric_lite/events.py`); `fabric_lite/integrations.py` subscribes them as the Trainer is built."""

    #: Under `fabric-lite explain`, the arguments this Trainer was given; None otherwise.
    explain_arguments: Optional[Dict[str, Any]] = None
    #: Profiles the hooks and steps when given one (`profiler="simple"`, "advanced", "pytorch"); a
    #: PassThroughProfiler otherwise. Set as the Trainer is built (`fabric_lite/integrations.py`).
    profiler: Profiler
    #: The signal watch of the latest fit (preemption), set as the Trainer is built.
    preemption: Any = None

    @announces_construction
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
        num_sanity_val_steps: Optional[int] = None, log_every_n_steps: Optional[int] = None,
        default_root_dir: Optional[str] = None, enable_progress_bar: Optional[bool] = None,
        enable_checkpointing: Optional[bool] = None, enable_model_summary: Optional[bool] = None,
        deterministic: Union[bool, str, None] = False, profiler: Union[Profiler, str, None] = None,
        sync_batchnorm: bool = False,
        min_epochs: Optional[int] = None, min_steps: Optional[int] = None, overfit_batches: Union[int, float] = 0.0,
        detect_anomaly: bool = False, inference_mode: bool = True, reload_dataloaders_every_n_epochs: int = 0,
        use_distributed_sampler: bool = True, benchmark: Optional[bool] = None, barebones: bool = False,
        plugins: Any = None, explain: bool = False,
        **unknown: Any,
    ) -> None:
        check_refused_arguments(unknown)  # Lightning's arguments fabric_lite refuses, in one table
        given = {name: value for name, value in locals().items() if name not in ("self", "unknown", "__class__")}
        check_unknown(list(inspect.signature(Trainer.__init__).parameters)[1:-1], unknown)
        # Every argument is checked here, before anything starts (a relaunch, the strategy, torch's settings).
        check = ArgumentCheck("Trainer")
        settings = resolve_settings(check, given)
        apply_torch_settings(settings)
        launch_env = read_launch_environment()
        run_config = resolve_trainer_run_config(settings, launch_env)
        self.events.emit("configured", self, run_config)
        devices = settings.devices or "auto"  # (None, as "auto": what the launch says)
        # one process standing in for the planned launch (`fabric-lite explain`) checks no nodes: the plan
        # compares the requested nodes with the launch
        nodes_asked = None if run_config.explain_dry_run else settings.num_nodes
        if nodes_asked is not None:
            relaunch_if_needed(devices, nodes_asked, runtime_class(settings.accelerator, settings.strategy,
                                                                   launch_env.runtimes), launch_env)
        # The Trainer's micro-steps run through the Accelerator's step engine, built from the same RunConfig.
        self.settings = settings
        self.accelerator = Accelerator.from_run_config(run_config)
        self.strategy = self.accelerator.strategy
        if nodes_asked is not None and nodes_asked != self.strategy.process.num_nodes:
            raise ValueError(
                f"num_nodes={nodes_asked} disagrees with the launch environment, which has "
                f"{self.strategy.process.num_nodes} node(s). Launch with `fabric-lite launch --nnodes {nodes_asked}`."
            )
        sync_batchnorm = settings.sync_batchnorm
        if sync_batchnorm and self.strategy.world_size > 1 and self.device.type not in SYNC_BATCHNORM_DEVICES:
            check.fail("sync_batchnorm", sync_batchnorm,
                       f"torch's SyncBatchNorm synchronizes {'/'.join(SYNC_BATCHNORM_DEVICES)} tensors only, and "
                       f"these {self.strategy.world_size} processes train on {self.device.type!r} (torch raises "
                       f"'SyncBatchNorm expected input tensor to be on GPU' at the first training step). Train on "
                       f"GPUs, or drop sync_batchnorm: each process then normalizes over its own batch.")
        self.sync_batchnorm = sync_batchnorm
        self.max_epochs = settings.max_epochs
        self.max_steps = settings.max_steps
        self.max_time = settings.max_time
        self.gradient_clip_val = settings.gradient_clip_val
        self.gradient_clip_algorithm = settings.gradient_clip_algorithm
        self.val_check_interval = settings.val_check_interval
        self.check_val_every_n_epoch = settings.check_val_every_n_epoch
        self.limits = dict(settings.limits)
        self.num_sanity_val_steps = settings.num_sanity_val_steps
        self.log_every_n_steps = settings.log_every_n_steps
        self.default_root_dir = settings.default_root_dir
        self.fast_dev_run = settings.fast_dev_run
        self.explain = settings.explain  # fit() prints the plan (explain.py) and returns without training
        self.callbacks: List[Callback] = settings.callbacks  # (a new list: the checks copied it)
        self.enable_model_summary = settings.enable_model_summary
        self.min_epochs, self.min_steps = settings.min_epochs, settings.min_steps
        self.overfit_batches = settings.overfit_batches
        self.reload_dataloaders_every_n_epochs = settings.reload_dataloaders_every_n_epochs
        self.barebones = settings.barebones
        #: the DataModule given to the latest fit/validate/test/predict that had one (None before any)
        self.datamodule: Optional[DataModule] = None
        #: the batch-transfer hooks as one function (data_hooks.batch_transfer), or None: the loaders place batches
        self.batch_transfer: Optional[Callable[[Any, int], Any]] = None
        self.min_limits_noted = False  # (the note that a stop waits for min_epochs/min_steps is printed once)
        add_default_callbacks(self.callbacks, self.default_root_dir, settings.enable_progress_bar,
                              settings.enable_checkpointing, settings.enable_model_summary, settings.logger)
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.sanity_checking = False
        self.epoch_finished = False
        self.metric_store = (BarebonesMetricStore if self.barebones else MetricStore)(self.strategy)
        self.optimizers: List[Any] = []
        self.lr_scheduler_configs: List[SchedulerConfig] = []
        self.start_time: Optional[float] = None
        self.module: Optional[TrainModule] = None
        #: ids of the TrainModules whose configure_model() has run (once each, whatever stage comes first).
        self.configured_models: set = set()
        self.model: Optional[nn.Module] = None
        self.eval_model: Optional[nn.Module] = None
        self.predict_loop: Any = None  # the running prediction's state (predict_loop.PredictionState)
        self.gathers_predictions = False  # predict(gather=True) is running

    def timed_callbacks(self) -> List[Any]:
        """The callbacks as the hooks are called on them: each hook timed by the instrument (the profiler), where
        the Trainer has one; the callbacks themselves otherwise."""
        instrument = self.events.instrument
        if instrument is None:
            return self.callbacks
        return [instrument.timed(cb, "Callback", Callback) for cb in self.callbacks]

    # -- what callbacks and modules read -----------------------------------------------------------
    @property
    def accumulate_grad_batches(self) -> int:
        """Batches per optimizer step: the step engine's window, so a change between epochs (as
        GradientAccumulationScheduler makes) applies from the next batch on."""
        return self.accelerator.gradient_accumulation_steps

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        if not is_int(value) or value < 1:
            raise ValueError(f"trainer.accumulate_grad_batches={value!r} must be an integer >= 1 (batches per "
                             f"optimizer step; 1: no accumulation).")
        self.accelerator.gradient_accumulation_steps = value

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        """Send values to every logger callback (floats; tensors are read here, once)."""
        if not metrics:
            return
        values = {k: float(v.detach() if v.requires_grad else v) if isinstance(v, torch.Tensor) else float(v)
                  for k, v in metrics.items()}
        self.metric_store.logged_metrics.update(metrics)
        for cb in self.callbacks if self.events.instrument is None else self.timed_callbacks():
            cb.on_log(self, values, self.global_step if step is None else step)

    def call_hook(self, hook: str, *args: Any) -> None:
        """Run a hook on every callback, then on the module, as Lightning orders them (each timed, under a
        profiler)."""
        module: Any = self.module
        callbacks: List[Any] = self.callbacks
        instrument = self.events.instrument
        if instrument is not None:
            module, callbacks = instrument.timed(module, "TrainModule", TrainModule), self.timed_callbacks()
        store = self.metric_store
        running, store.fx = store.fx, hook  # (what self.log may do depends on the hook)
        for cb in callbacks:
            getattr(cb, hook)(self, self.module, *args)
        fn = getattr(module, hook, None)
        if fn is not None:
            fn(*args)
        store.fx = running

    def call_callback_hook(self, hook: str, *args: Any) -> None:
        """Run a hook on every callback only (those the module has no counterpart of, such as
        on_sanity_check_start)."""
        store = self.metric_store
        running, store.fx = store.fx, hook
        for cb in self.callbacks if self.events.instrument is None else self.timed_callbacks():
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
        """Train `module`; `ckpt_path="last"` resumes from the newest checkpoint if there is one. Without loaders or
        a datamodule, the module's own train_dataloader()/val_dataloader() give them."""
        from fabric_lite.trainer import loops

        if not isinstance(module, TrainModule):
            raise TypeError(f"Trainer runs TrainModule subclasses, got {type(module).__name__}.")
        train_dataloaders, datamodule = datamodule_given_as_loaders("fit", train_dataloaders, datamodule)
        check_refused_overrides(module, datamodule)
        self.callbacks[:] = merge_module_callbacks(self.callbacks, module.configure_callbacks())
        order_callbacks(self.callbacks)
        self.train_source, self.val_source = connect_data(self, module, datamodule, "fit",
                                                          (train_dataloaders, val_dataloaders))
        self.batch_transfer = batch_transfer(module, self.datamodule, self.device, self.strategy.runtime.device_feed(False))
        train = self.train_source.request()
        if train is None:
            raise ValueError("fit() needs train_dataloaders, a datamodule with train_dataloader(), or a module that "
                             "defines train_dataloader().")
        # A second fit() on this Trainer starts from clean registrations (no duplicate checkpoint entries).
        self.accelerator.free_memory()
        self.accelerator.registered_objects.clear()
        self.accelerator.per_process_objects.clear()
        self.train_dataloader = prepare_train_loader(self, train)
        self.val_dataloaders = [self._prepare_eval_loader(v, "validate", i)
                                for i, v in enumerate(as_list(self.val_source.request()))]
        self._attach(module, with_optimizers=True)
        for sched in self.lr_scheduler_configs:
            self.accelerator.register_for_checkpointing(sched.scheduler)
        if not module.automatic_optimization:
            for opt in self.optimizers:  # global_step counts optimizer steps, which the module takes itself
                if not hasattr(opt.optimizer, "register_step_post_hook"):
                    raise ValueError(f"{type(self.strategy).__name__} steps its optimizer inside its engine; manual "
                                     f"optimization (automatic_optimization=False) is not available with it.")
                opt.optimizer.register_step_post_hook(self.count_manual_step)
                if self.strategy.traits.syncs_gradients_per_forward and self.world_size > 1:
                    if self.strategy.precision.scaler is not None:  # (a rank skipping an inf step would hang the rest)
                        raise ValueError(
                            f"Manual optimization (automatic_optimization=False) on {self.world_size} processes under "
                            f"{type(self.strategy).__name__} with precision={self.strategy.precision.name!r}: its loss "
                            f"scaler skips a step on a process that finds inf gradients, while the others average "
                            f"gradients with it and would wait forever. Use precision='bf16-mixed' or '32-true', or "
                            f"automatic optimization.")
                    opt.optimizer.register_step_pre_hook(average_gradients_before_step(self.strategy))
        events = self.events
        run = FitRun(module, ckpt_path)
        events.emit("prepared", self, run)  # (`explain`: the plan, printed in place of training)
        if not run.train:
            return
        self.accelerator.register_for_checkpointing(TrainerCheckpointState(self))
        self.accelerator.register_for_checkpointing(LoggedAggregates(self), per_process=True)
        if self.enable_model_summary:
            add_model_summary(self.callbacks)
        events.emit("stage_start", self, "fit")
        callbacks = self.timed_callbacks()
        for cb in callbacks:
            cb.setup(self, module, "fit")
        events.emit("fit_start", self, run)  # (under Ray: the checkpoint Ray hands the run)
        ckpt_path = run.ckpt_path
        process = self.accelerator.run_config.process  # (the launch environment, read once in __init__)
        if ckpt_path is None and process.restart_count > 0:
            ckpt_path = "last"  # restarted by torch elastic: go on from the newest whole checkpoint
            if self.is_global_zero:
                print(f"fabric_lite: restart {process.restart_count}: resuming from the newest checkpoint "
                      f"under {self.checkpoint_dir()}", file=sys.stderr, flush=True)
        if ckpt_path is not None:
            restore(self, ckpt_path)
        events.emit("train_start", self)  # (preemption: the signals are caught from here on)
        try:
            with torch.autograd.set_detect_anomaly(self.settings.detect_anomaly):
                loops.run_fit(self)
            self.accelerator.wait_for_checkpoint()  # the last save is published (or its failure raised) on return
        except BaseException as err:
            for cb in callbacks:
                cb.on_exception(self, module, err)
            raise
        finally:
            self.accelerator.checkpoint_saver.close(quiet=True)  # after a failure too: nothing is left writing
            events.emit("fit_end", self)
            for cb in callbacks:
                cb.teardown(self, module, "fit")
            teardown_data(module, datamodule, "fit")  # after a failure too, as their setup ran
            events.emit("stage_end", self, "fit")

    def validate(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
                 datamodule: Optional[DataModule] = None, ckpt_path: Optional[str] = None) -> List[Dict[str, float]]:
        """Run validation; `ckpt_path` ("best", "last" or a path) loads those weights first."""
        return self._evaluate("validate", module, dataloaders, datamodule, ckpt_path)

    def test(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
             datamodule: Optional[DataModule] = None, ckpt_path: Optional[str] = None) -> List[Dict[str, float]]:
        """Run the test loop; `ckpt_path` ("best", "last" or a path) loads those weights first."""
        return self._evaluate("test", module, dataloaders, datamodule, ckpt_path)

    def predict(self, module: Optional[TrainModule] = None, dataloaders: Any = None,
                datamodule: Optional[DataModule] = None, return_predictions: Optional[bool] = None,
                ckpt_path: Optional[str] = None, gather: bool = False) -> Optional[List[Any]]:
        """Run `predict_step` over the loaders: a list of batch outputs (on the CPU), a list of such lists for
        several loaders; None with `return_predictions=False`. Each process predicts its own shard; `gather=True`
        returns every process's predictions on every process, in dataset order, each sample once (batched as
        one process would batch them). `ckpt_path`: weights to predict with ("best", "last" or a path)."""
        from fabric_lite.trainer.predict_loop import PredictionState, run_predict

        dataloaders, datamodule = datamodule_given_as_loaders("predict", dataloaders, datamodule)
        module = module or self.module
        if module is None:
            raise ValueError("predict() needs a module (or a Trainer that has already fit one).")
        if return_predictions is not None and not isinstance(return_predictions, bool):
            raise TypeError(f"predict(return_predictions={return_predictions!r}): must be None (True), True or False.")
        loaders = self._eval_loaders(module, datamodule, "predict", dataloaders, ckpt_path)
        self.predict_loop = PredictionState()
        self.gathers_predictions = bool(gather)
        self.events.emit("stage_start", self, "predict")
        callbacks = self.timed_callbacks()
        try:
            for cb in callbacks:
                cb.setup(self, module, "predict")
            return run_predict(self, loaders, return_predictions is not False)
        except BaseException as err:
            for cb in callbacks:
                cb.on_exception(self, module, err)
            raise
        finally:
            self.gathers_predictions = False
            for cb in callbacks:
                cb.teardown(self, module, "predict")
            teardown_data(module, datamodule, "predict")
            self.events.emit("stage_end", self, "predict")

    def _evaluate(self, stage: str, module: Optional[TrainModule], dataloaders: Any,
                  datamodule: Optional[DataModule], ckpt_path: Optional[str] = None) -> List[Dict[str, float]]:
        from fabric_lite.trainer import loops

        dataloaders, datamodule = datamodule_given_as_loaders(stage, dataloaders, datamodule)
        module = module or self.module
        if module is None:
            raise ValueError(f"{stage}() needs a module (or a Trainer that has already fit one).")
        loaders = self._eval_loaders(module, datamodule, stage, dataloaders, ckpt_path)
        self.events.emit("stage_start", self, stage)
        callbacks = self.timed_callbacks()
        try:
            for cb in callbacks:
                cb.setup(self, module, stage)
            with self.evaluation_context():
                return loops.run_evaluation(self, stage, loaders)
        except BaseException as err:
            for cb in callbacks:
                cb.on_exception(self, module, err)
            raise
        finally:
            for cb in callbacks:
                cb.teardown(self, module, stage)
            teardown_data(module, datamodule, stage)
            self.events.emit("stage_end", self, stage)

    def _eval_loaders(self, module: TrainModule, datamodule: Optional[DataModule], stage: str,
                      dataloaders: Any, ckpt_path: Optional[str] = None) -> List[Any]:
        if not isinstance(module, TrainModule):
            raise TypeError(f"Trainer runs TrainModule subclasses, got {type(module).__name__}.")
        check_refused_overrides(module, datamodule)
        self.callbacks[:] = merge_module_callbacks(self.callbacks, module.configure_callbacks())
        order_callbacks(self.callbacks)
        source, = connect_data(self, module, datamodule, stage, (dataloaders,))
        self.batch_transfer = batch_transfer(module, self.datamodule, self.device, self.strategy.runtime.device_feed(False))
        loaders = source.request()
        if loaders is None:
            name = STAGE_LOADERS[stage][0]
            raise ValueError(f"{stage}() needs dataloaders, a datamodule with {name}(), or a module that defines "
                             f"{name}().")
        if self.module is not module:
            self._attach(module)
        if ckpt_path is not None:
            load_eval_weights(self, stage, ckpt_path)
        return [self._prepare_eval_loader(d, stage, i) for i, d in enumerate(as_list(loaders))]

    def prepare_train_dataloader(self, loader: Any) -> Any:
        """`loader` prepared as fit() prepares its training loader (sharded, placed, its position kept); the batch-size
        and learning-rate finders probe with such loaders."""
        return prepare_train_loader(self, loader)

    def _prepare_eval_loader(self, loader: Any, stage: str = "validate", dataloader_idx: int = 0) -> Any:
        return prepare_eval_loader(self, loader, stage, dataloader_idx)

    def evaluation_context(self) -> Any:
        """What evaluation and prediction run under: torch.inference_mode (`inference_mode=True`, the default) or
        torch.no_grad; no_grad where the device runtime or a gloo process group does not support inference tensors."""
        import torch.distributed as dist

        if not self.settings.inference_mode or not self.strategy.runtime.inference_tensors or (
                dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"):
            return torch.no_grad()
        return torch.inference_mode()

    # -- plumbing ----------------------------------------------------------------------------------
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
        if self.strategy.engine_step is not None:  # an engine that owns model and optimizer (DeepSpeed)
            clip = self.gradient_clip_val if self.gradient_clip_algorithm == "norm" else None

            def prepare(optimizers: List[Any]) -> List[Any]:
                acc.check_optimizers(optimizers, [module], fix=fix)
                models, prepared = acc.setup_jointly([StepRunner(module)], optimizers, self.accumulate_grad_batches,
                                                     gradient_clip_val=clip)
                self.model = models[0]
                return prepared

            if with_optimizers:
                self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers(), prepare)
            else:
                prepare([])
        else:
            self.model = acc.prepare_model(StepRunner(module))
            if with_optimizers:
                def prepare_each(optimizers: List[Any]) -> List[Any]:
                    acc.check_optimizers(optimizers, [module], fix=fix)
                    return [acc.prepare_optimizer(o) for o in optimizers]

                self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers(),
                                                                              prepare_each)
        # Evaluation runs without the DDP wrapper: no gradients to sync, and no per-forward buffer
        # broadcast that would wait for a process that has run out of (unpadded) batches.
        assert self.model is not None  # (prepared just above)
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
