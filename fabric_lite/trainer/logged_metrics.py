"""What `TrainModule.log` records: step values and epoch aggregates, kept on the device.

Nothing here reads a value back to the host; the Trainer converts to floats only when a logger
writes (every `log_every_n_steps`) or at an epoch end.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from fabric_lite._tree import batch_size_of
from fabric_lite.strategies.base import Strategy

__all__ = ["MetricStore"]

_REDUCE = ("mean", "sum", "max", "min")


def _is_metric(value: Any) -> bool:  # a torchmetrics Metric, without importing torchmetrics
    return callable(getattr(value, "compute", None)) and callable(getattr(value, "reset", None)) and hasattr(value, "update")


@dataclass
class _Entry:
    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    reduce_fx: str
    sync_dist: bool
    metric: Any = None
    total: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    last: Optional[torch.Tensor] = None


class MetricStore:
    """Per-stage store of logged values. `stage` and `epoch_end_hook` pick `on_step`/`on_epoch` defaults."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.stage = "train"
        self.in_epoch_end_hook = False
        self.batch: Any = None  # the current batch: the default weight of an epoch mean is its size
        self._entries: Dict[str, _Entry] = {}
        self.callback_metrics: Dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: Dict[str, torch.Tensor] = {}

    def reset_stage(self, stage: str) -> None:
        self.stage = stage
        self._entries = {k: v for k, v in self._entries.items() if not k.startswith(f"{stage}\0")}

    def log(self, name: str, value: Any, *, prog_bar: bool, logger: bool, on_step: Optional[bool],
            on_epoch: Optional[bool], reduce_fx: str, sync_dist: bool, batch_size: Optional[int]) -> None:
        step_default = self.stage == "train" and not self.in_epoch_end_hook
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if self.in_epoch_end_hook or self.stage != "train":
            if on_step and self.stage != "train":
                raise ValueError(f"self.log({name!r}, on_step=True) is only allowed during training steps.")
            on_step = on_step and not self.in_epoch_end_hook
        if reduce_fx not in _REDUCE:
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): allowed values are {', '.join(_REDUCE)}.")
        key = f"{self.stage}\0{name}"
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist)
        if _is_metric(value):
            entry.metric = value
            cached = getattr(value, "_forward_cache", None)
            if on_step and isinstance(cached, torch.Tensor):
                entry.last = cached.detach()
            return
        tensor = self._as_tensor(name, value)
        entry.last = tensor  # a synced step value is reduced when it is written (flush_step), by every rank at once
        if on_epoch:
            weight = float(batch_size or batch_size_of(self.batch) or 1) if reduce_fx == "mean" else 1.0
            if entry.total is None:
                entry.total = tensor * weight if reduce_fx in ("mean", "sum") else tensor.clone()
                entry.weight = torch.tensor(weight, device=tensor.device)
            elif reduce_fx in ("mean", "sum"):
                entry.total = entry.total + tensor * weight
                entry.weight = entry.weight + weight
            else:
                entry.total = torch.maximum(entry.total, tensor) if reduce_fx == "max" else torch.minimum(entry.total, tensor)

    def _as_tensor(self, name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars (e.g. .mean()), "
                    f"or a torchmetrics Metric."
                )
            value = value.detach()
            if value.dim():
                value = value.reshape(())
            return value if value.dtype == torch.float32 else value.float()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(float(value), device=self.strategy.root_device)
        raise ValueError(
            f"self.log({name!r}) got {type(value).__name__}; log a number, a one-element tensor or a torchmetrics Metric."
        )

    def _names(self, entry: _Entry, name: str) -> Tuple[str, str]:
        both = entry.on_step and entry.on_epoch
        return (f"{name}_step" if both else name), (f"{name}_epoch" if both else name)

    def step_values(self) -> Dict[str, torch.Tensor]:
        """The latest per-step values of this stage (tensors; nothing is read back)."""
        out: Dict[str, torch.Tensor] = {}
        prefix = f"{self.stage}\0"
        for key, entry in self._entries.items():
            if key.startswith(prefix) and entry.on_step and entry.last is not None:
                step_name, _ = self._names(entry, key[len(prefix):])
                out[step_name] = entry.last
                self.callback_metrics[step_name] = entry.last
                if entry.prog_bar:
                    self.progress_bar_metrics[step_name] = entry.last
        return out

    def flush_step(self) -> Dict[str, torch.Tensor]:
        """The step values to write now; every process calls it at the same step, so synced ones are
        reduced here (one collective per name), after checking every process logged the same names."""
        prefix = f"{self.stage}\0"
        mine = [(k[len(prefix):], e) for k, e in self._entries.items()
                if k.startswith(prefix) and e.on_step and e.last is not None]
        synced = [(n, e) for n, e in mine if e.sync_dist and e.metric is None]
        self._check_same_sync_keys([n for n, _ in synced], "per-step ")
        for _, entry in synced:
            if self.strategy.world_size > 1:
                op = entry.reduce_fx if entry.reduce_fx in ("max", "min") else ("sum" if entry.reduce_fx == "sum" else "mean")
                entry.last = self.strategy.all_reduce(entry.last, op)
        values = self.step_values()
        names = {self._names(e, n)[0] for n, e in mine if e.logger}
        return {k: v for k, v in values.items() if k in names}

    def epoch_end(self) -> Dict[str, torch.Tensor]:
        """Reduce this stage's epoch values (syncing where asked), reset them, return the loggable ones."""
        prefix = f"{self.stage}\0"
        items = [(k[len(prefix):], e) for k, e in self._entries.items() if k.startswith(prefix) and e.on_epoch]
        self._check_same_sync_keys([n for n, e in items if e.sync_dist and e.metric is None])
        loggable: Dict[str, torch.Tensor] = {}
        for name, entry in items:
            if entry.metric is not None:
                value = entry.metric.compute()  # torchmetrics syncs across processes itself
                entry.metric.reset()
                value = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            elif entry.total is None:
                continue
            else:
                total, weight = entry.total, entry.weight
                if entry.sync_dist and self.strategy.world_size > 1:
                    op = entry.reduce_fx if entry.reduce_fx in ("max", "min") else "sum"
                    total = self.strategy.all_reduce(total, op)
                    weight = self.strategy.all_reduce(weight, "sum") if entry.reduce_fx == "mean" else weight
                value = total / weight if entry.reduce_fx == "mean" else total
                entry.total = entry.weight = None
            _, epoch_name = self._names(entry, name)
            self.callback_metrics[epoch_name] = value
            if entry.prog_bar:
                self.progress_bar_metrics[epoch_name] = value
            if entry.logger:
                loggable[epoch_name] = value
        return loggable

    # -- checkpoints: a mid-epoch checkpoint carries the epoch aggregates logged so far ------------
    def state_dict(self, module: torch.nn.Module) -> Dict[str, Any]:
        """The training stage's unfinished epoch aggregates: running totals, and the state of each
        logged torchmetrics Metric (found by its place in `module`; its own state is not in the weights)."""
        paths = {id(m): name for name, m in module.named_modules()}
        entries = []
        for key, e in self._entries.items():
            stage, name = key.split("\0", 1)
            if stage != "train" or not e.on_epoch or (e.total is None and e.metric is None):
                continue
            saved: Dict[str, Any] = {"name": name, "on_step": e.on_step, "on_epoch": e.on_epoch,
                                     "prog_bar": e.prog_bar, "logger": e.logger, "reduce_fx": e.reduce_fx,
                                     "sync_dist": e.sync_dist, "total": e.total, "weight": e.weight}
            if e.metric is not None:
                if id(e.metric) not in paths:
                    continue  # a metric that is not an attribute of the module cannot be found again on load
                saved["metric_path"] = paths[id(e.metric)]
                saved["metric_state"] = dict(e.metric.metric_state)
            entries.append(saved)
        return {"train": entries}

    def load_state_dict(self, state: Dict[str, Any], module: torch.nn.Module) -> None:
        for saved in state.get("train", []):
            entry = _Entry(saved["on_step"], saved["on_epoch"], saved["prog_bar"], saved["logger"],
                           saved["reduce_fx"], saved["sync_dist"], total=saved["total"], weight=saved["weight"])
            device = self.strategy.root_device
            if entry.total is not None:
                entry.total, entry.weight = entry.total.to(device), entry.weight.to(device)
            if "metric_path" in saved:
                entry.metric = module.get_submodule(saved["metric_path"])
                for attr, value in saved["metric_state"].items():
                    moved = [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
                    setattr(entry.metric, attr, moved)
            self._entries[f"train\0{saved['name']}"] = entry

    def _check_same_sync_keys(self, names: List[str], kind: str = "") -> None:
        if self.strategy.world_size == 1:
            return
        # One tiny all-reduce compares a fingerprint of each process's names (max and -min at once);
        # only when they differ are the names themselves gathered, to say which process logged what.
        digest = hashlib.blake2b("\0".join(sorted(names)).encode(), digest_size=8).digest()
        fingerprint = int.from_bytes(digest, "little") >> 1  # 63 bits: -fingerprint fits an int64 too
        spread = self.strategy.all_reduce(
            torch.tensor([fingerprint, -fingerprint], dtype=torch.long, device=self.strategy.root_device), "max")
        highest, minus_lowest = spread.tolist()
        if highest == -minus_lowest:
            return
        everyone = self.strategy.all_gather_object(sorted(names))
        if any(keys != everyone[0] for keys in everyone):
            detail = "; ".join(f"rank {r}: {keys}" for r, keys in enumerate(everyone))
            raise RuntimeError(
                f"self.log(..., sync_dist=True) was called for different {kind}names on different processes in "
                f"stage {self.stage!r} ({detail}). Every process must log the same synced names, or a collective would hang."
            )
