"""The raw door: `Accelerator`, for people who write their own training loop.

Its names, arguments and return values follow Hugging Face Accelerate's, so a script written for it
runs after changing the import. Every decision about devices, sharding, precision and gradients is
delegated to the one Strategy it holds; nothing here branches on which strategy that is.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from fabric_lite.accelerator.configs import (
    DataLoaderConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
    KwargsHandler, ProjectConfiguration, TorchDynamoPlugin, strategy_from_handlers,
)
from fabric_lite.accelerator.enums import DistributedType
from fabric_lite.strategies.connector import connect
from fabric_lite.data.loader import DataLoaderShard, shard_dataloader, skip_first_batches
from fabric_lite.engine import StepEngine
from fabric_lite.events import EventBus, announces_construction
from fabric_lite.strategies.environments import read_launch_environment
from fabric_lite.settings import RunConfig, resolve_run_config
from fabric_lite.accelerator.wrappers import AcceleratedOptimizer, AcceleratedScheduler, is_scheduler
from fabric_lite.accelerator.model_state import ModelState
from fabric_lite.accelerator.parallelism import MeshFacts, ParallelismConfig
from fabric_lite.accelerator.optimizer_check import PreparedParameters
from fabric_lite.checkpoint.saver import CheckpointSaver
from fabric_lite.strategies.precision import PrecisionForward
from fabric_lite.accelerator.process_control import ProcessControl
from fabric_lite.accelerator.profiling import ProfileKwargs, profile_context
from fabric_lite.accelerator.precision_handlers import (
    AutocastKwargs, autocast_context, autocast_kwargs, fp8_recipe_from_handlers,
)
from fabric_lite.accelerator.run_settings import RunSettings, check_arguments
from fabric_lite.strategies import Strategy
from fabric_lite.accelerator.tracking import GeneralTracker
from fabric_lite.accelerator.run_tracking import TrackerControl
# (the module, not its names: fabric_lite.state imports this package, and may be the one imported first)
from fabric_lite import state as run_state

__all__ = ["Accelerator", "DistributedType"]


class Accelerator(StepEngine, ProcessControl, ModelState, RunSettings, TrackerControl, MeshFacts):
    """Run a hand-written training loop on any device, any number of processes, any precision.

    Examples:
        >>> accelerator = Accelerator(mixed_precision="bf16")
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
    """

    #: Under `fabric-lite explain`, the arguments this Accelerator was given (the plan reports settings
    #: given twice or ignored); None otherwise.
    explain_arguments: Optional[Dict[str, Any]] = None
    #: The observers of this door's events (fabric_lite/events.py), given before __init__ runs.
    events: EventBus

    @announces_construction
    def __init__(
        self,
        device_placement: bool = True,
        split_batches: Optional[bool] = None,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: Optional[int] = None,
        cpu: bool = False,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]] = None,
        project_dir: Optional[Union[str, os.PathLike]] = None,
        project_config: Optional[ProjectConfiguration] = None,
        gradient_accumulation_plugin: Optional[GradientAccumulationPlugin] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[Sequence[KwargsHandler]] = None,
        even_batches: Optional[bool] = None,
        rng_types: Any = None,  # accepted for compatibility: dataloader order is always seeded and synced
        dynamo_backend: Optional[str] = None,
        *,
        strategy: Union[str, Strategy] = "auto",
        devices: Union[int, str, None] = None,
        accelerator: str = "auto",
        deepspeed_plugin: Optional[DeepSpeedPlugin] = None,
        fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None,
        dynamo_plugin: Optional[TorchDynamoPlugin] = None,
        divide_loss_by: str = "gradient_accumulation_steps",
        parallelism_config: Optional[ParallelismConfig] = None,
    ) -> None:
        # Every argument is checked first, before anything starts (the process group, the strategy); then every
        # source of settings is resolved into one RunConfig (fabric_lite/settings.py), which the run is built from.
        arguments, plugins, handlers = check_arguments(locals())
        self.configure(resolve_run_config(arguments, plugins, handlers, read_launch_environment()))

    @classmethod
    def from_run_config(cls, config: RunConfig) -> "Accelerator":
        """An Accelerator built from settings already resolved (the Trainer's), without reading them again."""
        accelerator = cls.__new__(cls)
        accelerator.events = EventBus()  # (no observers: the Trainer that built it watches the run itself)
        if config.explain_dry_run:  # (what `Accelerator(**config.arguments)` would have recorded)
            accelerator.explain_arguments = dict(config.arguments)
        accelerator.configure(config)
        return accelerator

    def configure(self, config: RunConfig) -> None:
        """Build this run from its RunConfig: the strategy, the step engine and the state Accelerate's names read."""
        #: The settings this run was built from, resolved once (the explain plan reads them too).
        self.run_config = config
        self.events.emit("configured", self, config)
        for attribute, handler in config.handlers.items():
            setattr(self, attribute, handler)
        self.dataloader_config = config.dataloader_config or DataLoaderConfiguration()
        for name, value in config.dataloader_overrides.items():
            setattr(self.dataloader_config, name, value)
        project_dir = config.project_dir
        self.project_configuration = config.project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and config.project_config is not None:
            self.project_configuration.project_dir = project_dir
            self.project_configuration.logging_dir = self.project_configuration.logging_dir or project_dir
        #: Run under `fabric-lite explain` (or FABRIC_LITE_EXPLAIN): the first prepare(loader) prints the plan.
        self.explain_requested = config.explain_requested
        process = config.process
        if config.notes_unread_config:
            from fabric_lite.launch.config_file import note_unread_config

            note_unread_config(process.source, os.environ)
        handlers = {type(h): h for h in config.kwargs_handlers}
        strategy = strategy_from_handlers(config.strategy, handlers, process.world_size)  # (hook checked)
        strategy = connect(
            strategy, accelerator=config.accelerator, devices=config.devices, precision=config.precision,
            process=process, scaler_kwargs=config.scaler_kwargs,
            autocast_kwargs=autocast_kwargs(config.handlers["autocast_handler"]),
            fp8_recipe=fp8_recipe_from_handlers(config.kwargs_handlers), runtimes=config.runtimes,
        )
        plugin = config.gradient_accumulation_plugin or GradientAccumulationPlugin(
            num_steps=config.gradient_accumulation_steps)
        divide_loss_by, device_placement = config.divide_loss_by, config.device_placement
        step_scheduler_with_optimizer, log_with = config.step_scheduler_with_optimizer, config.log_with
        dynamo_plugin, dynamo_backend = config.dynamo_plugin, config.dynamo_backend
        # The step engine: the prepared models, optimizers and schedulers, and the accumulation window.
        self.init_engine(strategy, plugin, divide_loss_by)
        # (with Accelerate's names on top: `active_dataloader`, `num_steps`, ...)
        self.gradient_state = run_state.GradientState(self.gradient_accumulation_plugin)
        strategy.setup_environment()
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        #: Accepted as Accelerate takes it; the data order is always seeded and the same on every process here.
        self.rng_types = list(config.rng_types)
        self.dataloaders: List[DataLoaderShard] = []
        self._prepared_params = PreparedParameters()  # what the optimizers given to prepare are checked against
        #: What `save_state` saves beyond the prepared objects: the main process's state, and each process's own.
        self.registered_objects: List[Any] = []
        self.per_process_objects: List[Any] = []
        self._preemption: Any = None
        #: Runs `save_state`'s saves: blocking ones in place, background ones one at a time (checkpoint/saver.py).
        self.checkpoint_saver = CheckpointSaver(strategy)
        self.log_with = log_with
        self.trackers: List[GeneralTracker] = []
        #: How `prepare` compiles models (`torch.compile`); `dynamo_backend` is its backend, None when off.
        self.dynamo_plugin = dynamo_plugin or TorchDynamoPlugin(backend=dynamo_backend)
        self.dynamo_backend = self.dynamo_plugin.backend if self.dynamo_plugin.enabled else None
        self.deepspeed_plugin = config.deepspeed_plugin
        self.fsdp_plugin = config.fsdp_plugin
        #: N-D parallelism (Accelerate's ParallelismConfig), with torch's DeviceMesh once the strategy built it.
        self.parallelism_config = config.parallelism_config
        shape = config.mesh_shape
        if self.parallelism_config is None and shape is not None and shape.total > 1:  # (from the launch)
            self.parallelism_config = ParallelismConfig(shape.dp_replicate, shape.dp_shard, shape.tp)
        if self.parallelism_config is not None:
            self.parallelism_config.device_mesh = strategy.device_mesh.torch
        #: `register_save_state_pre_hook` / `register_load_state_pre_hook` hooks, by handle id.
        self.save_state_pre_hooks: Dict[int, Callable] = {}
        self.load_state_pre_hooks: Dict[int, Callable] = {}
        #: The flag `set_trigger` raises and `check_trigger` reads (summed over processes).
        self.flag_tensor = torch.zeros(1, device=self.device)
        run_state.bind_accelerator(self)  # PartialState() and fabric_lite.utils' functions answer from this run

    # -- where this process is (`device`, `num_processes`, `process_index`, ...: ProcessFacts) ---------------
    @property
    def state(self) -> "run_state.AcceleratorState":
        """This run's `AcceleratorState` (Accelerate's `accelerator.state`): process facts and settings."""
        return run_state.AcceleratorState.of(self)

    # -- prepare -----------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[Sequence[bool]] = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers; return them in the order given.

        Objects of any other type are returned untouched.
        """
        placement = list(device_placement) if device_placement is not None else [self.device_placement] * len(args)
        if len(placement) != len(args):
            raise ValueError(f"device_placement has {len(placement)} entries for {len(args)} objects to prepare.")
        joint = self.strategy.engine_step is not None and any(isinstance(a, nn.Module) for a in args)
        if not joint:  # (the joint set-up checks what it is given itself)
            self.check_optimizers([a for a in args if isinstance(a, torch.optim.Optimizer)
                                   and not isinstance(a, AcceleratedOptimizer)],
                                  [a for a in args if isinstance(a, nn.Module) and a not in self.models])
        if joint:  # (a later prepare() of loaders or schedulers alone takes the usual path)
            models = [a for a in args if isinstance(a, nn.Module)]
            optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
            wrapped_models, wrapped = self.setup_jointly(models, optimizers, self.gradient_accumulation_steps,
                                                         [a for a in args if isinstance(a, DataLoader)])
            swap: Dict[int, Any] = {id(raw): w for raw, w in zip(models, wrapped_models)}
            swap.update({id(raw): w for raw, w in zip(optimizers, wrapped)})
            args = tuple(swap.get(id(a), a) for a in args)
        result: List[Any] = list(args)
        # Models first, whatever the order given: a sharding strategy re-points optimizers at the new parameters.
        for i, (obj, place) in enumerate(zip(args, placement)):
            if isinstance(obj, nn.Module) and obj not in self.models and not joint:
                result[i] = self.prepare_model(obj, device_placement=place)
        for i, (obj, place) in enumerate(zip(args, placement)):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
                result[i] = self.prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=place)
        for opt in self.optimizers:  # an optimizer prepared before its model: found now
            if opt.module is None:
                opt.module = self._model_of(opt)
        for i, obj in enumerate(result):  # schedulers last: they must find their prepared optimizer
            if is_scheduler(obj) and not isinstance(obj, AcceleratedScheduler):
                result[i] = self.prepare_scheduler(obj)
        self.events.emit("prepared", self, args)  # (`fabric-lite explain`: the plan, printed, and exit 0)
        return result[0] if len(result) == 1 else tuple(result)

    def setup_jointly(self, models: Sequence[nn.Module], optimizers: Sequence[Any], accumulation_steps: int,
                      loaders: Sequence[Any] = (), gradient_clip_val: Optional[float] = None) -> tuple:
        """Hand models and optimizers to the strategy in one call (when it has an `engine_step`), with
        what it must be configured with; returns the prepared models and optimizers."""
        self.check_optimizers(optimizers, models)
        batch_size = None
        if loaders:  # the user's loaders, in this prepare() call
            batch_size = loaders[0].batch_size
            if batch_size is not None and self.split_batches:
                batch_size //= self.strategy.dp_size  # (the batch is split over the data-parallel group)
        elif self.dataloaders and self.dataloaders[0].total_batch_size:  # prepared earlier (the Trainer)
            batch_size = self.dataloaders[0].total_batch_size // self.strategy.dp_size
        engine_step = self.strategy.engine_step
        if engine_step is None:
            raise ValueError(f"setup_jointly() needs a strategy with an engine_step; {self.strategy!r} has none.")
        engine_step.set_run_hints(micro_batch_size=batch_size, accumulation_steps=accumulation_steps,
                                  gradient_clip_val=gradient_clip_val)
        records = [self._prepared_params.record(m) for m in models]
        prepared, engine_optimizers = self.strategy.setup(list(models), list(optimizers))
        for record, done in zip(records, prepared):
            record.add(list(done.parameters()))
        self.models.extend(prepared)
        owner = prepared[0] if len(prepared) == 1 else None
        wrapped = [AcceleratedOptimizer(o, self.strategy, self.gradient_state, owner or self._model_of(o))
                   for o in engine_optimizers]
        self.optimizers.extend(wrapped)
        return prepared, wrapped

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False) -> nn.Module:
        """Move the model to the device, give it mixed precision, and wrap it for the strategy."""
        record = self._prepared_params.record(model, trained=not evaluation_mode)
        precision = self.strategy.precision
        if precision.wraps_forward and not isinstance(getattr(model.forward, "__func__", None), PrecisionForward):
            PrecisionForward.install(model, precision)
        if evaluation_mode or (device_placement is False and not self.use_distributed):
            prepared = precision.convert_module(model)
        else:
            prepared = self.strategy.setup_module(model)
        prepared = self.dynamo_plugin.compile(prepared)
        record.add(list(prepared.parameters()))
        self.models.append(prepared)
        return prepared

    def check_optimizers(self, optimizers: Sequence[Any], models: Sequence[nn.Module] = (),
                         fix: Optional[str] = None) -> None:
        """Refuse, with a ValueError naming it, an optimizer that holds none of the parameters of the models given
        to prepare (now, `models`, or before) while such a model with trainable parameters has no optimizer: the
        usual cause is an optimizer built on another copy of the model, and the model would never train.
        `prepare` checks what it is given; `fix` says what to do in the caller's terms."""
        self._prepared_params.check(list(optimizers), list(models), trained_by=self.optimizers, fix=fix)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(self.strategy.setup_optimizer(optimizer), self.strategy, self.gradient_state,
                                       self._model_of(optimizer))
        self.optimizers.append(wrapped)
        return wrapped

    def _model_of(self, optimizer: Any) -> Optional[nn.Module]:
        """The prepared model whose parameters `optimizer` trains (prepared before it), or None."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self.models:
            if any(id(p) in params for p in model.parameters()):
                return model
        return None

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        owners = [o for o in self.optimizers if o.optimizer is scheduler.optimizer or o is scheduler.optimizer]
        wrapped = AcceleratedScheduler(
            scheduler, owners or self.optimizers, self.gradient_state,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches, num_processes=self.strategy.dp_size,  # (one step per data-parallel batch)
        )
        self.schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: Optional[bool] = None,
                            even_batches: Optional[bool] = None) -> DataLoaderShard:
        """Shard by rank (keeping the loader's order and generator), place batches on the device.

        `even_batches=False` here (for one loader) gives each sample to exactly one process, with no
        padding: right for evaluation, where no gradient all-reduce needs every rank in step.
        """
        place = self.device_placement if device_placement is None else device_placement
        config = self.dataloader_config
        config.validate()  # (its fields may have been changed since it was made)
        loader = shard_dataloader(  # (sharded over the data-parallel group)
            data_loader, num_replicas=self.strategy.dp_size, rank=self.strategy.dp_rank,
            # DataLoader batches are already on the CPU: moving them there would only cost time.
            device=self.device if place and self.device.type != "cpu" else None, gradient_state=self.gradient_state,
            split_batches=config.split_batches,
            even_batches=config.even_batches if even_batches is None else even_batches,
            broadcast_seed=self.strategy.collectives.broadcast_object,
            non_blocking=config.non_blocking,
            device_feed=self.strategy.runtime.device_feed(config.non_blocking) if place else None,
            # (use_stateful_dataloader: every prepared loader answers state_dict/load_state_dict and resumes exactly)
            dispatch_batches=config.dispatch_batches, use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
        )
        self.dataloaders.append(loader)
        return loader

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one pass for LOMO optimizers (`lomo_optim.Lomo` / `AdaLomo`, whose
        `fused_backward(loss, lr)` updates each parameter as its gradient is computed)."""
        if learning_rate is None:
            raise ValueError("lomo_backward(loss, learning_rate=None): LOMO updates the weights during backward "
                             "and needs the learning rate, e.g. lomo_backward(loss, scheduler.get_last_lr()[0]).")
        fused = [o.optimizer for o in self.optimizers if callable(getattr(o.optimizer, "fused_backward", None))]
        if not fused:
            raise ValueError("lomo_backward() found no LOMO optimizer among the prepared ones "
                             f"({[type(o.optimizer).__name__ for o in self.optimizers]}); prepare a "
                             "lomo_optim.Lomo or AdaLomo, or call accelerator.backward(loss).")
        for optimizer in fused:
            optimizer.fused_backward(loss, learning_rate)

    @property
    def has_lomo_optimizer(self) -> bool:
        return any(callable(getattr(o.optimizer, "fused_backward", None)) for o in self.optimizers)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The loader's current epoch, starting after `num_batches` of this process's batches."""
        return skip_first_batches(dataloader, num_batches)

    @contextlib.contextmanager
    def profile(self, profile_handler: Optional[ProfileKwargs] = None) -> Iterator[torch.profiler.profile]:
        """Profile the enclosed block with torch's profiler, which is yielded. Settings come from `profile_handler`,
        else the ProfileKwargs in kwargs_handlers, else the defaults. With `output_trace_dir`, each process writes
        ``profile_<process_index>.json`` there when the block ends, then waits for the others."""
        handler = profile_handler if profile_handler is not None else self.profile_handler
        with profile_context(handler, self.process_index, self.wait_for_everyone) as profiler:
            yield profiler

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Optional[AutocastKwargs] = None) -> Iterator[None]:
        """Run the enclosed code under this run's mixed precision (for code outside the model's forward).

        `autocast_handler` replaces, for this block, the AutocastKwargs given in kwargs_handlers:
        ``accelerator.autocast(AutocastKwargs(enabled=False))`` runs the block without autocast."""
        with autocast_context(self.strategy.precision, autocast_handler):
            yield

    # -- models and checkpoints --------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = False) -> nn.Module:
        """The user's model without DDP (or other) wrappers and without torch.compile's; optionally without the
        autocast forward. `keep_torch_compile=True` gives the compiled model back as is where nothing else wraps
        it (on one process), else the plain module."""
        compiled = getattr(model, "_orig_mod", None)  # torch.compile
        if keep_torch_compile and compiled is not None and self.strategy.unwrap_module(compiled) is compiled:
            if not keep_fp32_wrapper:
                PrecisionForward.remove(compiled)
            return model
        inner = self.strategy.unwrap_module(model if compiled is None else compiled)
        inner = getattr(inner, "_orig_mod", inner)
        if not keep_fp32_wrapper:
            PrecisionForward.remove(inner)
        return inner

    def check_preemption(self) -> bool:
        """True, on every process at the same call, once any process has received SIGTERM or SIGUSR1.

        Call it once per step; the first call installs the signal handlers. The processes compare
        notes in one small collective about once a second, so calling it every step costs nothing
        measurable. On True, save a checkpoint and exit, e.g.
        ``accelerator.save_state(...); sys.exit(fabric_lite.EXIT_PREEMPTED)``. Once True, further
        SIGTERM/SIGUSR1 are ignored, so the process leaves with that status even when a launcher
        signals it again. The same collective carries a failed background save (`save_state(blocking=False)`),
        which this call then raises on every process at once.
        """
        if self._preemption is None:
            from fabric_lite.launch.preemption import PreemptionWatch

            self._preemption = PreemptionWatch()
            self._preemption.install()
        saver = self.checkpoint_saver
        stop = self._preemption.should_stop(self.strategy, save_failed=saver.failed)
        if self._preemption.save_failed_anywhere and not stop:
            saver.raise_failure()  # every process, at this same call (on a stop, the save that follows says it)
        if stop:
            self._preemption.uninstall()
            self._preemption.ignore_signals()
        return stop

    def end_training(self) -> None:
        """Wait for a background save in flight, close trackers, wait for every process, and shut the process
        group down."""
        self.checkpoint_saver.close()
        self.checkpoint_saver.release_group()  # the process group goes below
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()
        self.strategy.teardown()

    def free_memory(self, *objects: Any) -> List[Any]:
        self.models, self.optimizers, self.schedulers, self.dataloaders = [], [], [], []
        self._prepared_params = PreparedParameters()
        self.step = 0
        self.loss_divisor = 1  # (a manual loop after an accumulating one must not divide)
        self.gradient_state.sync_gradients = True
        return [None] * len(objects)

    clear = free_memory

    def __repr__(self) -> str:
        return f"Accelerator({self.strategy!r}, gradient_accumulation_steps={self.gradient_accumulation_steps})"

