"""Reading what `TrainModule.configure_optimizers` returns, in every form Lightning users write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from fabric_lite.accelerator.wrappers import AcceleratedOptimizer

__all__ = ["SchedulerConfig", "parse_optimizers"]

_FORMS = (
    "an optimizer; a list of optimizers; (optimizers, schedulers); {'optimizer': opt, 'lr_scheduler': "
    "sched or {'scheduler': sched, 'interval': 'step'|'epoch', 'frequency': n, 'monitor': 'val/loss'}}; "
    "or a list of such dicts"
)


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: Optional[str] = None
    optimizer: Any = None

    @property
    def needs_metric(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler(entry: Any, optimizer: Any = None) -> SchedulerConfig:
    if isinstance(entry, dict):
        unknown = set(entry) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if "scheduler" not in entry or unknown:
            raise ValueError(f"lr_scheduler dict {entry!r} is not understood: it needs 'scheduler' and may have "
                             f"'interval', 'frequency', 'monitor'" + (f"; unknown keys {sorted(unknown)}" if unknown else "."))
        config = SchedulerConfig(entry["scheduler"], entry.get("interval", "epoch"), int(entry.get("frequency", 1)),
                                 entry.get("monitor"), optimizer)
    else:
        config = SchedulerConfig(entry, optimizer=optimizer)
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"lr_scheduler interval={config.interval!r}: allowed values are 'step' and 'epoch'.")
    if config.needs_metric and config.monitor is None:
        raise ValueError("ReduceLROnPlateau needs a metric: return {'scheduler': sched, 'monitor': 'val/loss'}.")
    return config


def parse_optimizers(config: Any, prepare: Callable[[List[torch.optim.Optimizer]], List["AcceleratedOptimizer"]]
                     ) -> Tuple[List["AcceleratedOptimizer"], List[SchedulerConfig]]:
    """Optimizers prepared by `prepare` (one call for all of them), and schedulers with their stepping rules."""
    optimizers, schedulers = _parse(config)
    prepared = prepare(optimizers)
    by_id = {id(raw): p for raw, p in zip(optimizers, prepared)}
    for s in schedulers:
        owner = s.optimizer or getattr(s.scheduler, "optimizer", None)
        s.optimizer = by_id.get(id(owner), prepared[0] if prepared else None)
    return prepared, schedulers


def _parse(config: Any) -> Tuple[List[torch.optim.Optimizer], List[SchedulerConfig]]:
    optimizers: List[Any] = []
    schedulers: List[SchedulerConfig] = []
    if isinstance(config, torch.optim.Optimizer):
        optimizers = [config]
    elif isinstance(config, dict):
        if "optimizer" not in config:
            raise ValueError(f"configure_optimizers returned a dict without 'optimizer'. Accepted forms: {_FORMS}.")
        optimizers = [config["optimizer"]]
        if config.get("lr_scheduler") is not None:
            schedulers = [_scheduler(config["lr_scheduler"], config["optimizer"])]
    elif isinstance(config, (list, tuple)) and len(config) == 2 and all(isinstance(c, (list, tuple)) for c in config):
        optimizers = list(config[0])
        schedulers = [_scheduler(s) for s in config[1]]
    elif isinstance(config, (list, tuple)) and config and all(isinstance(c, dict) for c in config):
        for entry in config:
            o, s = _parse(entry)
            optimizers.extend(o)
            schedulers.extend(s)
        return optimizers, schedulers
    elif isinstance(config, (list, tuple)) and config and all(isinstance(c, torch.optim.Optimizer) for c in config):
        optimizers = list(config)
    else:
        raise ValueError(f"configure_optimizers returned {config!r}, which is not one of the accepted forms: {_FORMS}.")
    if not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(f"configure_optimizers must return torch optimizers; accepted forms: {_FORMS}.")
    return optimizers, schedulers
