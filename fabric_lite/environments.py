"""Who this process is in the job, read once from the launch environment.

Every environment variable fabric_lite understands is read here and nowhere else; the rest of the
package receives plain values. `detect_process` is a pure function of a mapping, so tests pass a
dict instead of patching ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["ProcessInfo", "LaunchSettings", "detect_process", "read_launch_settings"]

# Variables the `fabric-lite launch` command and `notebook_launcher` use to hand settings to the
# Accelerator running inside each worker.
ENV_MIXED_PRECISION = "FABRIC_LITE_MIXED_PRECISION"
ENV_GRAD_ACCUM = "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS"
ENV_USE_CPU = "FABRIC_LITE_USE_CPU"


@dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job: ranks, sizes and where the rendezvous lives."""

    world_size: int = 1
    global_rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    restart_count: int = 0
    uses_agent_store: bool = False
    source: str = "lone process"

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class LaunchSettings:
    """Settings a launcher passed to the workers (None where the launcher said nothing)."""

    mixed_precision: Optional[str] = None
    gradient_accumulation_steps: Optional[int] = None
    use_cpu: bool = False


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={raw!r} is not an integer; the launcher that set it is "
            f"misconfigured. Unset it or set it to a whole number."
        ) from None


def detect_process(env: Optional[Mapping[str, str]] = None) -> ProcessInfo:
    """Return this process's ranks from torchrun / torch elastic variables, or a lone process.

    >>> detect_process({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).global_rank
    1
    """
    env = os.environ if env is None else env
    world_size = _int(env, "WORLD_SIZE")
    if world_size is None:
        return ProcessInfo()
    rank = _int(env, "RANK", 0)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    assert rank is not None and local_rank is not None and local_world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"Inconsistent launch environment: RANK={rank}, WORLD_SIZE={world_size}. RANK must lie in "
            f"[0, WORLD_SIZE). Check the launcher command line."
        )
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"Inconsistent launch environment: LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size}."
        )
    node_rank = _int(env, "GROUP_RANK", None)
    if node_rank is None:
        node_rank = _int(env, "NODE_RANK", rank // local_world_size)
    elastic = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env
    return ProcessInfo(
        world_size=world_size,
        global_rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank or 0,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT"),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0) or 0,
        uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        source="torchrun" if elastic else "environment variables",
    )


def read_launch_settings(env: Optional[Mapping[str, str]] = None) -> LaunchSettings:
    """Settings that `fabric-lite launch --mixed-precision ...` passed down to this worker."""
    env = os.environ if env is None else env
    return LaunchSettings(
        mixed_precision=env.get(ENV_MIXED_PRECISION) or None,
        gradient_accumulation_steps=_int(env, ENV_GRAD_ACCUM),
        use_cpu=env.get(ENV_USE_CPU, "").lower() in {"1", "true", "yes"},
    )
