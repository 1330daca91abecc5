"""What an `Accelerator` was configured with, read back under Accelerate's names.

Scripts read these (`accelerator.mixed_precision`, `accelerator.use_stateful_dataloader`,
`accelerator.ddp_handler`, ...) to decide what to do; each one answers from the single place the setting lives
(the data-loader configuration, the strategy's precision, the kwargs handlers given), so nothing is stored twice.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Sequence

import torch
from torch import nn

from fabric_lite.accelerator.configs import KwargsHandler
from fabric_lite.accelerator.enums import DistributedType, StrEnum
from fabric_lite.arguments import is_int

__all__ = ["RunSettings", "FP8BackendType", "HANDLER_ATTRIBUTES", "handlers_by_attribute"]

#: The Accelerator attribute each kind of kwargs handler is kept under (None when none was given), as in
#: Accelerate. A handler class says its own with the class attribute `accelerator_attribute`.
HANDLER_ATTRIBUTES = ("ddp_handler", "scaler_handler", "init_handler", "autocast_handler", "profile_handler",
                      "fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler")
_FP8_HANDLERS = ("fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler")
_MULTI_DEVICE = (DistributedType.MULTI_GPU, DistributedType.MULTI_NPU, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_MLU)


class FP8BackendType(StrEnum):
    """Which library runs fp8 training (`accelerator.fp8_backend`)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def handlers_by_attribute(handlers: Sequence[KwargsHandler]) -> Dict[str, Optional[KwargsHandler]]:
    """{attribute: handler} for every name in HANDLER_ATTRIBUTES (None where none was given).

    Two handlers of one kind are refused, as in Accelerate: only one of them could take effect.
    """
    found: Dict[str, Optional[KwargsHandler]] = dict.fromkeys(HANDLER_ATTRIBUTES)
    seen: Dict[type, KwargsHandler] = {}
    for handler in handlers:
        if type(handler) in seen:
            raise ValueError(f"kwargs_handlers has two {type(handler).__name__} objects; pass one, with every "
                             "setting in it.")
        seen[type(handler)] = handler
        attribute = type(handler).accelerator_attribute
        if attribute in found:
            found[attribute] = handler
    return found


class RunSettings:
    """Accelerate's read-only view of an Accelerator's settings (mixed into `Accelerator`)."""

    # (set by Accelerator.__init__; declared for readers and type checkers)
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
