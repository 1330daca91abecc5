"""Accelerate's ``accelerate.utils`` names that scripts import, in one place.

Every name is imported on first use (``import fabric_lite.utils`` imports torch and two small modules of its own:
the constants and the ``is_*_available`` checks), from the module
that defines it. The free collectives (`gather`, `reduce`, `broadcast`, `wait_for_everyone`, ...) work on the
current state, with no Accelerator object at hand. Names of features fabric_lite does not have (Megatron-LM,
Transformer Engine FP8, big-model inference, bitsandbytes) import too; using one raises `NotSupportedError`, which
names the feature and what to do instead. The migration guide's table (docs/migration/accelerate.md) gives each
documented name of Accelerate's and what it does here.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

_CONFIGS = "fabric_lite.accelerator.configs"
_PRECISION = "fabric_lite.accelerator.precision_handlers"
_MEMORY = "fabric_lite.accelerator.memory"
_OPS = "fabric_lite.utils.operations"
_ENV = "fabric_lite.utils.environment"
_MODELING = "fabric_lite.utils.modeling"
_NO = "fabric_lite.utils.unsupported"
_BIG = "fabric_lite.big_modeling"
_TRACKING = "fabric_lite.accelerator.tracking"

# name -> the module that defines it
_LAZY: Dict[str, str] = {
    **dict.fromkeys((
        "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
        "InitProcessGroupKwargs", "KwargsHandler", "ProjectConfiguration", "DeepSpeedPlugin",
        "FullyShardedDataParallelPlugin", "TorchDynamoPlugin"), _CONFIGS),
    **dict.fromkeys(("DDPCommunicationHookType", "DistributedType", "LoggerType", "PrecisionType", "DynamoBackend"),
                    "fabric_lite.accelerator.enums"),
    **dict.fromkeys(("ComputeEnvironment", "RNGType", "SageMakerDistributedType"), "fabric_lite.utils.dataclasses"),
    **dict.fromkeys(("AutocastKwargs", "FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs"),
                    _PRECISION),
    "ProfileKwargs": "fabric_lite.accelerator.profiling",
    **dict.fromkeys(("WeightAverage", "ExponentialMovingAverage"), "fabric_lite.callbacks.averaged_weights"),
    **dict.fromkeys(("find_executable_batch_size", "release_memory", "should_reduce_batch_size",
                     "clear_device_cache"), _MEMORY),
    "LocalSGD": "fabric_lite.local_sgd",
    **dict.fromkeys(("CometMLTracker", "AimTracker", "ClearMLTracker", "DVCLiveTracker", "TrackioTracker",
                     "SwanLabTracker", "GeneralTracker", "TensorBoardTracker", "WandBTracker", "MLflowTracker",
                     "on_main_process"), _TRACKING),
    **dict.fromkeys(("init_empty_weights", "init_on_device"), "fabric_lite.accelerator.model_state"),
    "skip_first_batches": "fabric_lite.data.loader",
    **dict.fromkeys(("set_seed", "seed_everything"), "fabric_lite.seed"),
    **dict.fromkeys(("synchronize_rng_state", "synchronize_rng_states"), "fabric_lite.utils.rng"),
    **dict.fromkeys((
        "is_torch_tensor", "is_tensor_information", "is_namedtuple", "honor_type", "recursively_apply",
        "send_to_device", "find_batch_size", "listify", "concatenate", "slice_tensors", "convert_to_fp32",
        "convert_outputs_to_fp32", "ConvertOutputsToFp32", "gather", "gather_object", "reduce", "broadcast",
        "broadcast_object_list", "pad_across_processes", "wait_for_everyone"), _OPS),
    **dict.fromkeys(("patch_environment", "clear_environment", "purge_accelerate_environment", "write_basic_config",
                     "str_to_bool", "parse_flag_from_env", "parse_choice_from_env", "get_int_from_env"), _ENV),
    **dict.fromkeys(("extract_model_from_parallel", "save", "load", "load_state_dict", "load_checkpoint_in_model",
                     "compute_module_sizes", "get_max_layer_size", "calculate_maximum_sizes",
                     "get_module_children_bottom_up", "dtype_byte_size"), _MODELING),
    **dict.fromkeys(("merge_fsdp_weights", "enable_fsdp_ram_efficient_loading",
                     "disable_fsdp_ram_efficient_loading"), "fabric_lite.utils.fsdp"),
    **dict.fromkeys(("tqdm", "get_active_deepspeed_plugin", "get_grad_scaler", "get_mixed_precision_context_manager"),
                    "fabric_lite.utils.other"),
    **dict.fromkeys(("NotSupportedError",), "fabric_lite.utils.refusals"),
    **dict.fromkeys((
        "MegatronLMPlugin", "MegatronLMDummyScheduler", "MegatronLMDummyDataLoader", "AbstractTrainStep",
        "GPTTrainStep", "BertTrainStep", "T5TrainStep", "avg_losses_across_data_parallel_group", "convert_model",
        "has_transformer_engine_layers", "contextual_fp8_autocast", "apply_fp8_autowrap", "DummyOptim",
        "DummyScheduler", "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
        "BnbQuantizationConfig", "load_and_quantize_model", "fsdp2_load_full_state_dict",
        "fsdp2_switch_optimizer_parameters", "fsdp2_prepare_model", "fsdp2_prepare_auto_wrap_policy",
        "set_numa_affinity", "override_numa_affinity"), _NO),
    **dict.fromkeys(("infer_auto_device_map", "get_balanced_memory", "load_offloaded_weights", "offload_state_dict",
                     "set_module_tensor_to_device", "has_offloaded_params", "align_module_device", "retie_parameters"),
                    _BIG),
}
def _load_tables() -> None:
    """The constants and the is_*_available() checks are many small names: their (small) modules list them."""
    from fabric_lite.utils import constants, imports

    for module in (constants, imports):
        for name in module.__all__:
            _LAZY.setdefault(name, module.__name__)


_load_tables()

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_lite.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
