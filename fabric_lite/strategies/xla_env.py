"""What the environment tells torch_xla's PJRT runtime, and a replica's place in an XLA job (the XLA runtime's
part of the launch protocol: `environments.py` holds the rest)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # (imported when used: environments.py may import this module at its top)
    from fabric_lite.strategies.environments import ProcessInfo

__all__ = ["XLASettings", "read_xla_settings", "detect_xla_process"]


@dataclass(frozen=True)
class XLASettings:
    """What the environment tells torch_xla's PJRT runtime: the device kind and, on the CPU, how many."""

    pjrt_device: Optional[str] = None  # PJRT_DEVICE: "TPU", "CPU", "CUDA", ... (None: not set)

    @property
    def names_device(self) -> bool:
        """PJRT_DEVICE is set: notebook_launcher starts XLA replicas (on XLA's CPU device too)."""
        return bool(self.pjrt_device)

    @property
    def wants_xla(self) -> bool:
        """PJRT_DEVICE names an XLA accelerator: accelerator="auto" picks XLA. Not "CPU": importing torch_xla sets
        PJRT_DEVICE=CPU where it finds no TPU, and a CPU run must not turn into one on XLA's CPU device."""
        return self.pjrt_device not in (None, "CPU")


def read_xla_settings(env: Optional[Mapping[str, str]] = None) -> XLASettings:
    env = os.environ if env is None else env
    return XLASettings(pjrt_device=(env.get("PJRT_DEVICE") or "").strip().upper() or None)


def detect_xla_process(runtime: Any, spmd: bool = False) -> ProcessInfo:
    """This replica's place in an XLA job, asked of torch_xla's runtime (`torch_xla.runtime`), which owns
    it: replicas may be threads of one process (XLA's CPU device, TPU v2/v3), so environment variables,
    shared by the threads, cannot tell them apart. Under SPMD one process drives every device: world 1."""
    from fabric_lite.strategies.environments import ProcessInfo

    if spmd:
        return ProcessInfo(source=f"torch_xla SPMD over {runtime.global_runtime_device_count()} device(s)")
    world = runtime.world_size()
    if world == 1:
        return ProcessInfo(source="torch_xla (one replica)")
    local_world = runtime.local_device_count()
    return ProcessInfo(
        world_size=world, global_rank=runtime.global_ordinal(), local_rank=runtime.local_ordinal(),
        local_world_size=local_world, node_rank=runtime.host_index(),
        source=f"torch_xla ({world} replicas, {runtime.addressable_device_count()} per process)",
    )
