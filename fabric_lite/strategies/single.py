"""One process, one device (cpu, cuda:N or mps)."""

from __future__ import annotations

from typing import ClassVar, Tuple

from fabric_lite.strategies.base import Strategy

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(Strategy):
    """Train in this process on `root_device`; every collective is an identity."""

    aliases: ClassVar[Tuple[str, ...]] = ("single", "single_device")

    def setup_environment(self) -> None:
        if self.world_size > 1:
            raise RuntimeError(
                f"strategy='single' was asked for, but this process is rank {self.global_rank} of "
                f"{self.world_size} ({self.process.source}). Independent copies would train without "
                f"exchanging gradients. Use strategy='ddp' (or 'auto'), or launch a single process."
            )
        super().setup_environment()
