"""One process, one device (cpu, cuda:N or mps)."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn

from fabric_lite.strategies.base import Strategy, Traits

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(Strategy):
    """Train in this process on `root_device`; every collective is an identity."""

    traits = Traits(names=("single", "single_device"))

    def setup_environment(self) -> None:
        if self.world_size > 1:
            raise RuntimeError(
                f"strategy='single' was asked for, but this process is rank {self.global_rank} of "
                f"{self.world_size} ({self.process.source}). Independent copies would train without "
                f"exchanging gradients. Use strategy='ddp' (or 'auto'), or launch a single process."
            )
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.precision.convert_module(module).to(self.root_device)

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        return module

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        return contextlib.nullcontext()  # nothing to all-reduce

    def teardown(self) -> None:
        pass
