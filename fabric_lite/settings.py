"""The run configuration: what a door was given, resolved once into one frozen `RunConfig`.

`resolve_run_config` is a pure function of plain values: the door's checked arguments, the plugins and
kwargs handlers given, the launch environment (`environments.read_launch_environment`, read once by the
door) and the values of a config file. Both doors build their strategy and state from the result, and the
explain plan reads it (`accelerator.run_config`); nothing else reads the launch environment again.

Precedence, for each setting: the door's argument, else a plugin that says it, else the launch environment,
else the config file, else the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from fabric_lite.strategies.environments import (
    ENV_GRAD_ACCUM, LaunchEnvironment, LaunchSettings, ProcessInfo,
)
from fabric_lite.strategies.mesh_shape import MeshShape
from fabric_lite.strategies.registry import runtime_for_accelerator, strategy_class

__all__ = ["RunConfig", "resolve_run_config", "HANDLER_ATTRIBUTES", "handlers_by_attribute"]

#: The Accelerator attribute each kind of kwargs handler is kept under (None when none was given), as in
#: Accelerate. A handler class says its own with the class attribute `accelerator_attribute`.
HANDLER_ATTRIBUTES = ("ddp_handler", "scaler_handler", "init_handler", "autocast_handler", "profile_handler",
                      "fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler")

#: The plugins `resolve_run_config` reads, by the Accelerator's argument names.
PLUGIN_NAMES = ("gradient_accumulation_plugin", "deepspeed_plugin", "fsdp_plugin", "dynamo_plugin",
                "parallelism_config")



def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


def handlers_by_attribute(handlers: Sequence[Any]) -> Dict[str, Optional[Any]]:
    """{attribute: handler} for every name in HANDLER_ATTRIBUTES (None where none was given).

    Two handlers of one kind are refused, as in Accelerate: only one of them could take effect.
    """
    found: Dict[str, Optional[Any]] = dict.fromkeys(HANDLER_ATTRIBUTES)
    seen: Dict[type, Any] = {}
    for handler in handlers:
        if type(handler) in seen:
            raise ValueError(f"kwargs_handlers has two {type(handler).__name__} objects; pass one, with every "
                             "setting in it.")
        seen[type(handler)] = handler
        attribute = getattr(type(handler), "accelerator_attribute", None)
        if attribute in found:
            found[attribute] = handler
    return found


@dataclass(frozen=True)
class RunConfig:
    """One run's settings, resolved from every source. Objects the user gave (a DataLoaderConfiguration, a
    plugin, a handler) are kept as given; the door builds its own defaults where they are None."""

    #: This process's place in the job, and what a launcher passed down (from the launch environment).
    process: ProcessInfo = ProcessInfo()
    launch: LaunchSettings = LaunchSettings()
    #: The device runtimes' launch settings, by runtime name (`LaunchEnvironment.runtimes`): what
    #: accelerator="auto" picks, and how a runtime starts.
    runtimes: Mapping[str, Any] = field(default_factory=_empty)
    #: A strategy name ("auto", "ddp", ...) or a Strategy (the user's, or one a DeepSpeed/FSDP plugin made).
    strategy: Any = "auto"
    accelerator: str = "auto"
    devices: Any = None
    #: Accelerate's precision name given, or the launch's ("no" when neither says).
    precision: str = "no"
    gradient_accumulation_steps: int = 1
    #: The GradientAccumulationPlugin given (None: the door makes one of `gradient_accumulation_steps`).
    gradient_accumulation_plugin: Any = None
    divide_loss_by: str = "gradient_accumulation_steps"
    device_placement: bool = True
    step_scheduler_with_optimizer: bool = True
    #: The DataLoaderConfiguration given (None: the default one), and the fields the door's arguments set in it.
    dataloader_config: Any = None
    dataloader_overrides: Mapping[str, bool] = field(default_factory=_empty)
    #: The ProjectConfiguration given, and `project_dir` (which, given too, sets its directories).
    project_config: Any = None
    project_dir: Optional[str] = None
    log_with: Any = None
    rng_types: Tuple[str, ...] = ("generator",)
    dynamo_backend: Optional[str] = None
    deepspeed_plugin: Any = None
    fsdp_plugin: Any = None
    parallelism_config: Any = None
    #: N-D parallelism's layout (from parallelism_config, or from a launch's --use_parallelism_config), or None.
    mesh_shape: Optional[MeshShape] = None
    dynamo_plugin: Any = None
    kwargs_handlers: Tuple[Any, ...] = ()
    #: Each kind of kwargs handler given, under Accelerate's attribute names (`ddp_handler`, ...; else None).
    handlers: Mapping[str, Any] = field(default_factory=_empty)
    #: The door's arguments as resolve_run_config received them (for the explain plan).
    arguments: Mapping[str, Any] = field(default_factory=_empty)

    @property
    def explain_requested(self) -> bool:
        """Run under `fabric-lite explain` (or FABRIC_LITE_EXPLAIN): the doors print the plan instead of training."""
        return self.launch.explain is not None

    @property
    def explain_dry_run(self) -> bool:
        return self.launch.explain_dry_run

    @property
    def notes_unread_config(self) -> bool:
        """Rank 0 of processes another launcher started: a `fabric-lite config` file, if any, is not in force."""
        return self.process.is_distributed and self.process.global_rank == 0 and \
            not self.launch.launched_by_fabric_lite

    @property
    def scaler_kwargs(self) -> Optional[Dict[str, Any]]:
        """The GradScalerKwargs given, as `torch.amp.GradScaler` keywords (None: none given)."""
        handler = self.handlers.get("scaler_handler")
        return handler.to_kwargs() if handler is not None else None


def resolve_run_config(arguments: Mapping[str, Any], plugins: Optional[Mapping[str, Any]] = None,
                       kwargs_handlers: Sequence[Any] = (), launch_env: Optional[LaunchEnvironment] = None,
                       config_file: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Resolve a door's settings into one RunConfig. Pure: it reads no environment and starts nothing.

    `arguments`: the door's checked arguments by the Accelerator's names (absent ones take the defaults);
    `plugins`: by argument name (PLUGIN_NAMES); `launch_env`: what `read_launch_environment()` returned (None: a
    lone process with nothing set); `config_file`: settings by LaunchSettings' field names (`mixed_precision`,
    `gradient_accumulation_steps`, `use_cpu`, `strategy`, `accelerator`), used where nothing else says.
    Raises ValueError where two sources disagree or a plugin conflicts with the strategy asked for.
    """
    a = dict(arguments)
    p = dict(plugins or {})
    env = launch_env if launch_env is not None else LaunchEnvironment()
    launch = _with_config_file(env.launch, config_file or {})
    strategy = a.get("strategy", "auto")
    devices = a.get("devices")
    if launch.explain_dry_run and isinstance(devices, int) and devices > 1:
        devices = None  # this lone process stands in for rank 0 of a planned launch; the plan checks devices
    steps = a.get("gradient_accumulation_steps")
    deepspeed, fsdp = p.get("deepspeed_plugin"), p.get("fsdp_plugin")
    if deepspeed is not None:
        if strategy != "auto":
            raise ValueError(f"Pass strategy={strategy!r} or deepspeed_plugin, not both.")
        strategy = deepspeed.to_strategy()
        if steps is None:
            steps = deepspeed.gradient_accumulation_steps
    if fsdp is not None:
        if strategy != "auto" or deepspeed is not None:
            raise ValueError(f"Pass one of strategy={strategy!r}, deepspeed_plugin and fsdp_plugin, not several.")
        strategy = fsdp.to_strategy()
    parallel = p.get("parallelism_config")
    shape = parallel.shape() if parallel is not None else _launched_shape(launch)
    if shape is not None and shape.total > 1:  # (one process in all: nothing to lay out)
        if deepspeed is not None or (fsdp is None and strategy != "auto"):
            raise ValueError(f"parallelism_config lays the processes out for FSDP2 and tensor parallelism; pass it "
                             f"without strategy={strategy!r} and deepspeed_plugin (an fsdp_plugin may give FSDP's "
                             f"settings).")
        strategy = fsdp.to_strategy() if fsdp is not None else strategy_class("fsdp")()
        strategy.mesh_shape = shape
    handlers = handlers_by_attribute(kwargs_handlers)
    accumulation = p.get("gradient_accumulation_plugin")
    if accumulation is not None:
        if steps not in (None, accumulation.num_steps):
            raise ValueError(f"gradient_accumulation_steps={steps} disagrees with "
                             f"gradient_accumulation_plugin.num_steps={accumulation.num_steps}; pass only one of them.")
        steps = accumulation.num_steps
    elif steps is None and launch.gradient_accumulation_steps is not None:
        steps = launch.gradient_accumulation_steps
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps={steps} from the launch environment "
                             f"({ENV_GRAD_ACCUM}) must be an integer >= 1.")
    if strategy == "auto" and launch.strategy:
        strategy = launch.strategy  # from `fabric-lite config` through `fabric-lite launch`
    accelerator = a.get("accelerator", "auto")
    accelerator = "cpu" if (a.get("cpu", False) or launch.use_cpu) else (
        launch.accelerator if accelerator == "auto" and launch.accelerator else accelerator)
    name = str(accelerator).lower()
    runtime = runtime_for_accelerator(name, env.runtimes) if strategy == "auto" else None
    if runtime is not None:  # a device whose own runtime places the processes: that runtime's strategy
        strategy = runtime.strategy  # (DDP's kwargs handlers, if any, do not apply there)
    project_dir = a.get("project_dir")
    rng_types = a.get("rng_types")
    overrides = {k: a[k] for k in ("split_batches", "even_batches") if a.get(k) is not None}
    return RunConfig(
        process=env.process, launch=launch, runtimes=MappingProxyType(dict(env.runtimes)), strategy=strategy,
        accelerator=accelerator, devices=devices,
        precision=a.get("mixed_precision") or launch.mixed_precision or "no",
        gradient_accumulation_steps=1 if steps is None else steps, gradient_accumulation_plugin=accumulation,
        divide_loss_by=a.get("divide_loss_by", "gradient_accumulation_steps"),
        device_placement=a.get("device_placement", True),
        step_scheduler_with_optimizer=a.get("step_scheduler_with_optimizer", True),
        dataloader_config=a.get("dataloader_config"), dataloader_overrides=MappingProxyType(overrides),
        project_config=a.get("project_config"),
        project_dir=os.fspath(project_dir) if project_dir is not None else None,
        log_with=a.get("log_with"),
        rng_types=("generator",) if rng_types is None else ((rng_types,) if isinstance(rng_types, str)
                                                            else tuple(rng_types)),
        dynamo_backend=a.get("dynamo_backend"), deepspeed_plugin=deepspeed, fsdp_plugin=fsdp,
        parallelism_config=parallel, mesh_shape=shape,
        dynamo_plugin=p.get("dynamo_plugin"), kwargs_handlers=tuple(kwargs_handlers),
        handlers=MappingProxyType(handlers), arguments=MappingProxyType(a),
    )


def _launched_shape(launch: LaunchSettings) -> Optional[MeshShape]:
    """The layout a launch passed down with Accelerate's variables (`--use_parallelism_config`), or None."""
    if launch.parallelism is None:
        return None
    replicate, shard, tp, cp = launch.parallelism
    if cp != 1:
        raise ValueError(f"PARALLELISM_CONFIG_CP_SIZE={cp}: context parallelism is not supported by fabric_lite; "
                         f"launch with --parallelism_config_cp_size 1.")
    return MeshShape(replicate, shard, tp)


def _with_config_file(launch: LaunchSettings, values: Mapping[str, Any]) -> LaunchSettings:
    """The launch settings, with the config file's values where the launch environment says nothing."""
    if not values:
        return launch
    unknown = sorted(set(values) - {"mixed_precision", "gradient_accumulation_steps", "use_cpu", "strategy",
                                    "accelerator"})
    if unknown:
        raise ValueError(f"config file values {unknown} are not run settings; known: mixed_precision, "
                         f"gradient_accumulation_steps, use_cpu, strategy, accelerator.")
    from dataclasses import replace

    filled = {k: v for k, v in values.items() if getattr(launch, k) is None or getattr(launch, k) is False}
    return replace(launch, **filled) if filled else launch
