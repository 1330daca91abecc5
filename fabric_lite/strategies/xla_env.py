"""What the environment tells torch_xla's PJRT runtime, and a replica's place in an XLA job (the XLA runtime's
part of the launch protocol: `environments.py` holds the rest). `read_xla_settings` is the reader the registry
names for the runtime "xla": `read_launch_environment` calls it, and keeps its answer in
`LaunchEnvironment.runtimes["xla"]` (`xla_settings` reads it back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # (imported when used: the registry imports this module while environments.py reads)
    from fabric_lite.strategies.environments import LaunchEnvironment, ProcessInfo

__all__ = ["XLASettings", "read_xla_settings", "xla_settings", "detect_xla_process"]


@dataclass(frozen=True)
class XLASettings:
    """What the environment tells torch_xla's PJRT runtime: the device kind and, on the CPU, how many."""

    pjrt_device: Optional[str] = None  # PJRT_DEVICE: "TPU", "CPU", "CUDA", ... (None: not set)

    @property
    def names_device(self) -> bool:
        """PJRT_DEVICE is set: notebook_launcher starts XLA replicas (on XLA's CPU device too)."""
        return bool(self.pjrt_device)

    @property
    def requested(self) -> bool:
        """PJRT_DEVICE names an XLA accelerator: accelerator="auto" picks XLA. Not "CPU": importing torch_xla sets
        PJRT_DEVICE=CPU where it finds no TPU, and a CPU run must not turn into one on XLA's CPU device."""
        return self.pjrt_device not in (None, "CPU")

    @property
    def reason(self) -> str:
        """The variable that says so, for messages."""
        return f"PJRT_DEVICE={self.pjrt_device}"


def read_xla_settings(env: Mapping[str, str]) -> XLASettings:
    """The XLA runtime's launch variables in `env` (the registry's reader; `read_launch_environment` calls it)."""
    return XLASettings(pjrt_device=(env.get("PJRT_DEVICE") or "").strip().upper() or None)


def xla_settings(env: "LaunchEnvironment") -> XLASettings:
    """The XLA runtime's settings in a launch environment read once (nothing set: the defaults)."""
    found = env.runtimes.get("xla")
    return found if isinstance(found, XLASettings) else XLASettings()


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
