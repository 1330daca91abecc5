"""XLA's checkpoint format (`XLAStrategy.checkpoint_format`): checkpoints hold plain CPU tensors.

A state written on a TPU loads on a CPU and back. Reading an XLA tensor to the host runs the pending graph (a step
of the runtime, which moves its RNG), so the state is not copied by a background thread (`background=False`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from fabric_lite._tree import tree_map
from fabric_lite.strategies.checkpoint_format import CheckpointFormat

__all__ = ["XLACheckpointFormat", "to_cpu"]


def to_cpu(state: Any) -> Any:
    """`state` with every XLA tensor copied to the host (others as they are)."""
    # No step marker: it would advance the XLA random stream, and a run that saves a checkpoint must draw the
    # same dropout masks as one that does not (exact resume). Reading a tensor runs what it still needs.
    return tree_map(lambda t: t.cpu() if t.device.type == "xla" else t, state)


class XLACheckpointFormat(CheckpointFormat):
    """Whole state dicts of plain CPU tensors, read after the pending graph ran, never in the background."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy, background=False)

    def module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        return to_cpu(self.strategy.unwrap_module(module).state_dict())

    def to_host(self, obj: Any) -> Any:
        return to_cpu(obj)

    def optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return to_cpu(optimizer.state_dict())
