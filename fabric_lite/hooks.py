"""Accelerate's model hooks (``accelerate.hooks``), which move weights between devices around each forward for
big-model inference. fabric_lite has no such hooks: the names import, and using one raises `NotSupportedError`
(see `fabric_lite.big_modeling`)."""

from __future__ import annotations

from fabric_lite.big_modeling import FEATURE, INSTEAD, attach_layerwise_casting_hooks  # noqa: F401
from fabric_lite.refusals import refused, refused_class

ModelHook = refused_class("ModelHook", FEATURE, INSTEAD)
AlignDevicesHook = refused_class("AlignDevicesHook", FEATURE, INSTEAD)
SequentialHook = refused_class("SequentialHook", FEATURE, INSTEAD)
LayerwiseCastingHook = refused_class("LayerwiseCastingHook", FEATURE,
                                     "keep the weights in one dtype and use mixed_precision='bf16'")
add_hook_to_module = refused("add_hook_to_module", FEATURE, INSTEAD)
attach_execution_device_hook = refused("attach_execution_device_hook", FEATURE, INSTEAD)
attach_align_device_hook = refused("attach_align_device_hook", FEATURE, INSTEAD)
attach_align_device_hook_on_blocks = refused("attach_align_device_hook_on_blocks", FEATURE, INSTEAD)
remove_hook_from_module = refused("remove_hook_from_module", FEATURE, INSTEAD)
remove_hook_from_submodules = refused("remove_hook_from_submodules", FEATURE, INSTEAD)

__all__ = ["ModelHook", "AlignDevicesHook", "SequentialHook", "LayerwiseCastingHook", "add_hook_to_module",
           "attach_execution_device_hook", "attach_align_device_hook", "attach_align_device_hook_on_blocks",
           "attach_layerwise_casting_hooks", "remove_hook_from_module", "remove_hook_from_submodules"]
