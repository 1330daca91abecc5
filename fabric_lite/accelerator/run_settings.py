"""What an `Accelerator` was configured with, read back under Accelerate's names.

Scripts read these (`accelerator.mixed_precision`, `accelerator.use_stateful_dataloader`,
`accelerator.ddp_handler`, ...) to decide what to do; each one answers from the single place the setting lives
(the data-loader configuration, the strategy's precision, the kwargs handlers given), so nothing is stored twice.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from fabric_lite.accelerator.configs import (
    DataLoaderConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
    KwargsHandler, ProjectConfiguration, TorchDynamoPlugin,
)
from fabric_lite.accelerator.precision_handlers import fp8_recipe_from_handlers
from fabric_lite.accelerator.run_tracking import check_log_with
from fabric_lite.engine import LOSS_DIVISIONS
from fabric_lite.accelerator.enums import DistributedType, StrEnum
from fabric_lite.arguments import ArgumentCheck, is_int
from fabric_lite.settings import (  # (HANDLER_ATTRIBUTES, handlers_by_attribute: re-exported, their old path)
    HANDLER_ATTRIBUTES, PLUGIN_NAMES, handlers_by_attribute,
)

__all__ = ["RunSettings", "FP8BackendType", "HANDLER_ATTRIBUTES", "handlers_by_attribute", "check_arguments"]

_FP8_HANDLERS = ("fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler")
_MULTI_DEVICE = (DistributedType.MULTI_GPU, DistributedType.MULTI_NPU, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_MLU)


class FP8BackendType(StrEnum):
    """Which library runs fp8 training (`accelerator.fp8_backend`)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def check_arguments(given: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any], List[Any]]:
    """Check every `Accelerator(...)` argument in `given` (by name), before anything starts; raise naming the
    argument, the value and what is allowed. Returns the checked arguments, the plugins given and the kwargs
    handlers, as `fabric_lite.settings.resolve_run_config` takes them."""
    g = {name: value for name, value in given.items() if name not in ("self", "__class__")}
    check = ArgumentCheck("Accelerator")
    check.bool("device_placement", g["device_placement"])
    check.bool("split_batches", g["split_batches"], allow_none=True, hint="None: dataloader_config's")
    handlers = check.instances(
        "kwargs_handlers", g["kwargs_handlers"], KwargsHandler,
        what="KwargsHandler objects (DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs, "
             "ProfileKwargs, AORecipeKwargs, ...)")
    fp8_recipe = fp8_recipe_from_handlers(handlers)  # (refuses MS-AMP and two fp8 recipes)
    g["mixed_precision"] = check.precision("mixed_precision", g["mixed_precision"], allow_none=True,
                                           fp8_emulated=fp8_recipe is not None and fp8_recipe.emulated)
    g["gradient_accumulation_steps"] = check.int(
        "gradient_accumulation_steps", g["gradient_accumulation_steps"], minimum=1, allow_none=True,
        hint="None: the launch's setting, else 1")
    check.bool("cpu", g["cpu"])
    check.instance("dataloader_config", g["dataloader_config"], DataLoaderConfiguration)
    g["log_with"] = check_log_with(check, g["log_with"])
    g["project_dir"] = check.path("project_dir", g["project_dir"])
    check.instance("project_config", g["project_config"], ProjectConfiguration)
    accumulation = g["gradient_accumulation_plugin"]
    check.instance("gradient_accumulation_plugin", accumulation, GradientAccumulationPlugin)
    if accumulation is not None:
        _check_plugin_steps("gradient_accumulation_plugin", "GradientAccumulationPlugin", "num_steps",
                            accumulation.num_steps)
    check.bool("step_scheduler_with_optimizer", g["step_scheduler_with_optimizer"])
    check.bool("even_batches", g["even_batches"], allow_none=True, hint="None: dataloader_config's")
    rng_types = g["rng_types"]
    if rng_types is not None and not isinstance(rng_types, str):  # (accepted, and not needed: the order is seeded)
        check.instances("rng_types", rng_types, str, what="RNG names ('torch', 'cuda', 'generator', ...)")
    dynamo_backend, dynamo_plugin = g["dynamo_backend"], g["dynamo_plugin"]
    if dynamo_backend is not None and (not isinstance(dynamo_backend, str) or not dynamo_backend.strip()):
        check.fail("dynamo_backend", dynamo_backend, "must be a torch.compile backend name ('inductor', 'eager', "
                   "...), or 'no' or None for no compilation.",
                   ValueError if isinstance(dynamo_backend, str) else TypeError)
    check.instance("dynamo_plugin", dynamo_plugin, TorchDynamoPlugin)
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError("Pass dynamo_backend or dynamo_plugin, not both (TorchDynamoPlugin(backend=...) "
                         "says the backend).")
    g["strategy"] = check.strategy("strategy", g["strategy"])
    g["devices"] = check.devices("devices", g["devices"])
    g["accelerator"] = check.accelerator("accelerator", g["accelerator"])
    deepspeed = g["deepspeed_plugin"]
    check.instance("deepspeed_plugin", deepspeed, DeepSpeedPlugin)
    if deepspeed is not None and deepspeed.gradient_accumulation_steps is not None:
        _check_plugin_steps("deepspeed_plugin", "DeepSpeedPlugin", "gradient_accumulation_steps",
                            deepspeed.gradient_accumulation_steps)
    check.instance("fsdp_plugin", g["fsdp_plugin"], FullyShardedDataParallelPlugin)
    from fabric_lite.accelerator.parallelism import ParallelismConfig

    check.instance("parallelism_config", g["parallelism_config"], ParallelismConfig)
    check.choice("divide_loss_by", g["divide_loss_by"], LOSS_DIVISIONS)
    plugins = {name: g.pop(name) for name in PLUGIN_NAMES}
    del g["kwargs_handlers"]
    return g, plugins, handlers


def _check_plugin_steps(argument: str, plugin: str, field: str, value: Any) -> None:
    """The accumulation steps a plugin gives (GradientAccumulationPlugin, DeepSpeedPlugin): an integer >= 1."""
    if not is_int(value) or value < 1:
        raise (ValueError if is_int(value) else TypeError)(
            f"Accelerator({argument}={plugin}({field}={value!r}, ...)): gradient_accumulation_steps={value!r} "
            f"must be an integer >= 1.")


class RunSettings:
    """Accelerate's read-only view of an Accelerator's settings (mixed into `Accelerator`)."""

    # (set by Accelerator.configure from its RunConfig; declared for readers and type checkers)
    run_config: Any
    dataloader_config: Any
    project_configuration: Any
    gradient_accumulation_plugin: Any
    strategy: Any
    ddp_handler: Any = None
    scaler_handler: Any = None
    init_handler: Any = None
    autocast_handler: Any = None
    profile_handler: Any = None
    fp8_recipe_handler: Any = None
    ao_recipe_handler: Any = None
    te_recipe_handler: Any = None
    msamp_recipe_handler: Any = None
    #: Accelerate keeps its DeepSpeed engine here; in fabric_lite the prepared model is the engine, so this reads None.
    deepspeed_engine_wrapped: Any = None
    #: fp8 autocast is never delayed past the forward here (Accelerate's flag for its DeepSpeed + TE path).
    delayed_fp8_autocast: bool = False

    # -- precision ------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return self.strategy.precision.accelerate_name

    @property
    def native_amp(self) -> bool:
        return self.strategy.precision.is_mixed

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        """The fp16 loss scaler (None in other precisions)."""
        return self.strategy.precision.scaler

    @property
    def has_fp8_handler(self) -> bool:
        """Whether an fp8 recipe was given in kwargs_handlers (AORecipeKwargs, TERecipeKwargs, ...)."""
        return any(getattr(self, name) is not None for name in _FP8_HANDLERS)

    @property
    def fp8_enabled(self) -> bool:
        return self.mixed_precision == "fp8"

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The fp8 library the recipe given names (`NO` without one)."""
        if self.fp8_recipe_handler is not None:
            return FP8BackendType(str(self.fp8_recipe_handler.backend).upper())
        for name, backend in (("ao_recipe_handler", FP8BackendType.AO), ("te_recipe_handler", FP8BackendType.TE),
                              ("msamp_recipe_handler", FP8BackendType.MSAMP)):
            if getattr(self, name) is not None:
                return backend
        if self.fp8_enabled:
            recipe = self.strategy.precision.fp8_recipe
            return FP8BackendType.TE if recipe is not None and recipe.backend == "te" else FP8BackendType.AO
        return FP8BackendType.NO

    # -- accumulation -----------------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_accumulation_plugin.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if not is_int(value) or value < 1:
            raise ValueError(f"gradient_accumulation_steps={value!r} must be an integer >= 1.")
        self.gradient_accumulation_plugin.num_steps = value

    # -- data loading (DataLoaderConfiguration) ---------------------------------------------------------
    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def dispatch_batches(self) -> Optional[bool]:
        return getattr(self.dataloader_config, "dispatch_batches", None)

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    # -- project --------------------------------------------------------------------------------------
    @property
    def project_dir(self) -> Optional[str]:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    # -- where the run is -----------------------------------------------------------------------------
    @property
    def multi_device(self) -> bool:
        """Several processes, each on its own accelerator device (GPUs, NPUs, ...), with data parallelism."""
        return bool(self.use_distributed) and self.distributed_type in _MULTI_DEVICE  # type: ignore[attr-defined]

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP  # type: ignore[attr-defined]  # (FSDP here is FSDP2)

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files (`save_model` does this by itself; scripts that write their own
        files ask): one process per machine."""
        return bool(self.is_local_main_process)  # type: ignore[attr-defined]

    # -- models that other libraries placed --------------------------------------------------------------
    def verify_device_map(self, model: nn.Module) -> bool:
        """True when `model` (or a submodule) was spread over several devices by a `device_map` (Hugging Face
        `from_pretrained(device_map=...)`): such a model cannot be trained with data parallelism."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> Iterator[None]:
        """Context parallelism (sequence sharding) over a device mesh: not configured in this run, so the block
        runs as it is."""
        yield
