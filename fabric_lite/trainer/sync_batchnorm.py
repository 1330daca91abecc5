"""`Trainer(sync_batchnorm=True)`: BatchNorm layers become SyncBatchNorm before the module is prepared."""

from __future__ import annotations

from torch import nn

__all__ = ["convert_sync_batchnorm", "SYNC_BATCHNORM_DEVICES"]

#: The device types torch's SyncBatchNorm synchronizes across processes (it refuses CPU tensors).
SYNC_BATCHNORM_DEVICES = ("cuda", "xpu", "hpu")


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
