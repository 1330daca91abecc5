"""Accelerate's big-model inference (``accelerate.big_modeling``): spreading one model over several devices,
offloading weights to the CPU or the disk, and the hooks that move them at each forward. fabric_lite does not
do it. The names import, so a script that only imports them runs; calling one raises `NotSupportedError`.
`init_empty_weights` and `init_on_device` work (they build a model on the meta device or a given device), and
`load_checkpoint_in_model` loads weights into a model that is not spread over devices.
"""

from __future__ import annotations

from fabric_lite.refusals import NotSupportedError, refused

FEATURE = "big-model inference (a model spread over devices, or offloaded to the CPU or the disk)"
INSTEAD = ("load the model whole on one device (or shard it for training with FSDPStrategy / "
           "FullyShardedDataParallelPlugin) and call accelerator.prepare(model)")

dispatch_model = refused("dispatch_model", FEATURE, INSTEAD)
load_checkpoint_and_dispatch = refused("load_checkpoint_and_dispatch", FEATURE,
                                       "load the weights with load_checkpoint_in_model(model, checkpoint) or "
                                       "accelerator.load_model_weights, without a device_map")
infer_auto_device_map = refused("infer_auto_device_map", FEATURE, INSTEAD)
get_balanced_memory = refused("get_balanced_memory", FEATURE, INSTEAD)
cpu_offload = refused("cpu_offload", FEATURE, INSTEAD)
cpu_offload_with_hook = refused("cpu_offload_with_hook", FEATURE, INSTEAD)
disk_offload = refused("disk_offload", FEATURE, INSTEAD)
attach_layerwise_casting_hooks = refused("attach_layerwise_casting_hooks", FEATURE,
                                         "keep the weights in one dtype and use mixed_precision='bf16'")
load_offloaded_weights = refused("load_offloaded_weights", FEATURE, INSTEAD)
offload_state_dict = refused("offload_state_dict", FEATURE, INSTEAD)
set_module_tensor_to_device = refused("set_module_tensor_to_device", FEATURE,
                                      "move the whole model with model.to(device), or load weights with "
                                      "load_checkpoint_in_model")
align_module_device = refused("align_module_device", FEATURE, INSTEAD)
retie_parameters = refused("retie_parameters", FEATURE,
                           "tie weights in the model's own code (module.weight = other.weight) before prepare")


def has_offloaded_params(module) -> bool:
    """Whether `module` has weights offloaded by a big-model hook: never, here (there are no such hooks)."""
    return False


_ELSEWHERE = {"init_empty_weights": "fabric_lite.accelerator.model_state",
              "init_on_device": "fabric_lite.accelerator.model_state",
              "load_checkpoint_in_model": "fabric_lite.utils.modeling"}


def __getattr__(name: str):
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "NotSupportedError", "FEATURE", "dispatch_model", "load_checkpoint_and_dispatch", "infer_auto_device_map",
    "get_balanced_memory", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "attach_layerwise_casting_hooks",
    "load_offloaded_weights", "offload_state_dict", "set_module_tensor_to_device", "align_module_device",
    "retie_parameters",
    "has_offloaded_params", *_ELSEWHERE,
]
