"""Accelerate utilities for features fabric_lite does not have. Each name imports; using it raises
`NotSupportedError` naming the feature and what to do instead (see `fabric_lite.utils.refusals`)."""

from __future__ import annotations

from fabric_lite.utils.refusals import refused, refused_class

_MEGATRON = "Megatron-LM"
_MEGATRON_INSTEAD = ("train with DDP, FSDP (FSDPStrategy / FullyShardedDataParallelPlugin) or DeepSpeed, and shard "
                     "the model with FSDP instead of Megatron's tensor and pipeline parallelism")
MegatronLMPlugin = refused_class("MegatronLMPlugin", _MEGATRON, _MEGATRON_INSTEAD)
MegatronLMDummyScheduler = refused_class("MegatronLMDummyScheduler", _MEGATRON,
                                         "prepare an ordinary torch LR scheduler")
MegatronLMDummyDataLoader = refused_class("MegatronLMDummyDataLoader", _MEGATRON,
                                          "prepare an ordinary torch DataLoader")
AbstractTrainStep = refused_class("AbstractTrainStep", _MEGATRON, "write the training step in the loop")
GPTTrainStep = refused_class("GPTTrainStep", _MEGATRON, "write the training step in the loop")
BertTrainStep = refused_class("BertTrainStep", _MEGATRON, "write the training step in the loop")
T5TrainStep = refused_class("T5TrainStep", _MEGATRON, "write the training step in the loop")
avg_losses_across_data_parallel_group = refused(
    "avg_losses_across_data_parallel_group", _MEGATRON,
    "average losses with accelerator.reduce(loss, reduction='mean') or accelerator.gather_for_metrics")

_TE = "FP8 through NVIDIA Transformer Engine (layer conversion and fp8_autocast)"
_TE_INSTEAD = "train in bf16 (mixed_precision='bf16'), which needs no conversion of the model's layers"
convert_model = refused("convert_model", _TE, _TE_INSTEAD)
has_transformer_engine_layers = refused("has_transformer_engine_layers", _TE, _TE_INSTEAD)
contextual_fp8_autocast = refused("contextual_fp8_autocast", _TE, _TE_INSTEAD)
apply_fp8_autowrap = refused("apply_fp8_autowrap", _TE, _TE_INSTEAD)

_DS_CONFIG = "an optimizer or scheduler defined in the DeepSpeed config file (DummyOptim / DummyScheduler)"
_DS_CONFIG_INSTEAD = ("create the torch optimizer and LR scheduler in the script, remove the optimizer/scheduler "
                      "sections from the DeepSpeed config, and pass them to accelerator.prepare")
DummyOptim = refused_class("DummyOptim", _DS_CONFIG, _DS_CONFIG_INSTEAD)
DummyScheduler = refused_class("DummyScheduler", _DS_CONFIG, _DS_CONFIG_INSTEAD)
_DS_WRAPPERS = "Accelerate's internal DeepSpeed wrapper classes"
_DS_WRAPPERS_INSTEAD = ("use what accelerator.prepare returns under DeepSpeedStrategy / DeepSpeedPlugin "
                        "(a prepared model, optimizer and scheduler) directly")
DeepSpeedEngineWrapper = refused_class("DeepSpeedEngineWrapper", _DS_WRAPPERS, _DS_WRAPPERS_INSTEAD)
DeepSpeedOptimizerWrapper = refused_class("DeepSpeedOptimizerWrapper", _DS_WRAPPERS, _DS_WRAPPERS_INSTEAD)
DeepSpeedSchedulerWrapper = refused_class("DeepSpeedSchedulerWrapper", _DS_WRAPPERS, _DS_WRAPPERS_INSTEAD)

_BNB = "bitsandbytes 8-bit/4-bit quantization (BnbQuantizationConfig, load_and_quantize_model)"
_BNB_INSTEAD = "quantize with the model library (e.g. transformers' BitsAndBytesConfig) before accelerator.prepare"
BnbQuantizationConfig = refused_class("BnbQuantizationConfig", _BNB, _BNB_INSTEAD)
load_and_quantize_model = refused("load_and_quantize_model", _BNB, _BNB_INSTEAD)

_FSDP2_INTERNALS = "Accelerate's internal FSDP2 preparation helpers"
_FSDP2_INSTEAD = ("pass the model and optimizer to accelerator.prepare under FSDPStrategy / "
                  "FullyShardedDataParallelPlugin, which shards them; load full weights with "
                  "accelerator.load_model_weights")
fsdp2_load_full_state_dict = refused("fsdp2_load_full_state_dict", _FSDP2_INTERNALS, _FSDP2_INSTEAD)
fsdp2_switch_optimizer_parameters = refused("fsdp2_switch_optimizer_parameters", _FSDP2_INTERNALS, _FSDP2_INSTEAD)
fsdp2_prepare_model = refused("fsdp2_prepare_model", _FSDP2_INTERNALS, _FSDP2_INSTEAD)
fsdp2_prepare_auto_wrap_policy = refused("fsdp2_prepare_auto_wrap_policy", _FSDP2_INTERNALS, _FSDP2_INSTEAD)

_NUMA = "NUMA affinity pinning"
_NUMA_INSTEAD = "pin the processes with numactl or taskset in front of the launch command"
set_numa_affinity = refused("set_numa_affinity", _NUMA, _NUMA_INSTEAD)
override_numa_affinity = refused("override_numa_affinity", _NUMA, _NUMA_INSTEAD)

__all__ = [
    "MegatronLMPlugin", "MegatronLMDummyScheduler", "MegatronLMDummyDataLoader", "AbstractTrainStep", "GPTTrainStep",
    "BertTrainStep", "T5TrainStep", "avg_losses_across_data_parallel_group", "convert_model",
    "has_transformer_engine_layers", "contextual_fp8_autocast", "apply_fp8_autowrap", "DummyOptim", "DummyScheduler",
    "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "BnbQuantizationConfig",
    "load_and_quantize_model", "fsdp2_load_full_state_dict", "fsdp2_switch_optimizer_parameters",
    "fsdp2_prepare_model", "fsdp2_prepare_auto_wrap_policy", "set_numa_affinity",
    "override_numa_affinity",
]
