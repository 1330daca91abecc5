"""What `TrainModule.log` records: step values and epoch aggregates, kept on the device.

Nothing here reads a value back to the host on a training step; the Trainer converts to floats only
when a logger writes (every `log_every_n_steps`), at an epoch end, or when the progress bar reads.
Values are kept per loop ("train", "validate", "test"), per hook and per evaluation dataloader, as
Lightning keeps them; the names they come out under follow Lightning too (`_step`/`_epoch` when a
value is logged both ways, `/dataloader_idx_N` when several evaluation loaders run).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from fabric_lite.strategies.base import Strategy
from fabric_lite.trainer.log_rules import (
    DATALOADER_SUFFIX, STEP_HOOKS, as_scalar_tensor, check_levels, hook_rule, infer_batch_size, is_metric,
    parse_reduce_fx,
)
from fabric_lite.trainer.log_sync import check_same_sync_names, reduce_value

__all__ = ["MetricStore"]

_FLOATS = (torch.float32, torch.float64)
_OPTION_NAMES = ("on_step", "on_epoch", "prog_bar", "logger", "reduce_fx", "sync_dist", "sync_dist_group",
                 "add_dataloader_idx", "enable_graph", "rank_zero_only")


class _Entry:
    """One name logged in one hook (and, with several evaluation loaders, from one loader)."""

    def __init__(self, fx: str, name: str, source_idx: Optional[int], options: Tuple[Any, ...]) -> None:
        self.fx, self.name, self.source_idx, self.options = fx, name, source_idx, options
        (self.on_step, self.on_epoch, self.prog_bar, self.logger, self.reduce_fx, self.sync_dist, self.group,
         add_idx, self.enable_graph, self.rank_zero_only) = options
        suffix = f"{DATALOADER_SUFFIX}{source_idx}" if add_idx and source_idx is not None else ""
        both = self.on_step and self.on_epoch
        self.plain_name = name + suffix
        self.step_name = (f"{name}_step" if both else name) + suffix
        self.epoch_name = (f"{name}_epoch" if both else name) + suffix
        self.metric: Any = None
        self.metric_path: Optional[str] = None
        self.total: Optional[torch.Tensor] = None
        self.weight = 0.0
        self.last: Optional[torch.Tensor] = None
        self.last_synced = False
        self.fresh = False  # logged since the last epoch end
        self.restored = False  # from a checkpoint: the next call's arguments are adopted

    @property
    def synced(self) -> bool:
        return self.sync_dist and self.metric is None and not self.rank_zero_only

    def reset(self) -> None:
        self.total, self.weight, self.last, self.fresh = None, 0.0, None, False
        if self.metric is not None:
            self.metric.reset()


class MetricStore:
    """The Trainer's logged values. The loops set `stage` (which loop), `fx` (which hook runs) and
    `dataloader_idx` (None unless several evaluation loaders run); `self.log` files values under them."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.stage = "train"
        self.fx: Optional[str] = None
        self.dataloader_idx: Optional[int] = None
        self.batch: Any = None  # the current batch: the default weight of an epoch mean is its size
        self._sized: Tuple[Any, int] = (None, 1)  # (batch, its size): read once per batch
        self._collections: Dict[str, Dict[Tuple[str, str, Optional[int]], _Entry]] = {"train": {}, "validate": {},
                                                                                      "test": {}}
        self._eval_steps: Dict[Tuple[str, int], int] = {}  # logger step of each evaluation loader's step values
        self._common_steps: Optional[int] = None  # evaluation steps every process runs (synced step values)
        self._loader_step = 0
        self._metric_paths: Tuple[Any, Dict[int, str]] = (None, {})
        self._checked: Dict[Tuple[Any, ...], _Entry] = {}  # calls already checked -> their entry
        self.callback_metrics: Dict[str, torch.Tensor] = {}
        self.logged_metrics: Dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: Dict[str, float] = {}

    # -- recording ---------------------------------------------------------------------------------
    def log(self, module: torch.nn.Module, name: str, value: Any, *, prog_bar: bool, logger: Optional[bool],
            on_step: Optional[bool], on_epoch: Optional[bool], reduce_fx: Any, enable_graph: bool, sync_dist: bool,
            sync_dist_group: Any, add_dataloader_idx: bool, batch_size: Optional[int],
            metric_attribute: Optional[str], rank_zero_only: bool) -> None:
        """`TrainModule.log`: check the call against the running hook's rules, then record the value."""
        # A call already checked (same hook, loader, name and arguments) goes straight to its entry:
        # self.log runs on every training step.
        call = (self.stage, self.fx, self.dataloader_idx, name, prog_bar, logger, on_step, on_epoch, reduce_fx,
                enable_graph, sync_dist, sync_dist_group, add_dataloader_idx, metric_attribute, rank_zero_only)
        hashable = True
        try:
            entry = self._checked.get(call)
        except TypeError:  # an unhashable argument: checked every time
            entry, hashable = None, False
        if entry is None:
            entry = self._entry(name, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph, sync_dist,
                                sync_dist_group, add_dataloader_idx, rank_zero_only)
            if hashable:
                self._checked[call] = entry
        entry.fresh = True
        if value.__class__ is torch.Tensor and not enable_graph:
            tensor = value.detach()
            if tensor.numel() != 1 or tensor.dim() or tensor.dtype not in _FLOATS:
                tensor = as_scalar_tensor(name, tensor, self.strategy.root_device, False)
        elif is_metric(value):
            if entry.metric is not value:
                entry.metric = value
                entry.metric_path = metric_attribute or self._metric_path(module, value, name)
            cached = getattr(value, "_forward_cache", None) if entry.on_step else None
            if isinstance(cached, torch.Tensor):
                entry.last, entry.last_synced = cached.detach(), True  # (torchmetrics syncs its own values)
            return
        else:
            tensor = as_scalar_tensor(name, value, self.strategy.root_device, enable_graph)
        if entry.on_step:
            entry.last, entry.last_synced = tensor, False  # a synced step value is reduced when it is written
        if entry.on_epoch:
            self._accumulate(entry, name, tensor.detach() if enable_graph else tensor, batch_size)

    def _accumulate(self, entry: _Entry, name: str, tensor: torch.Tensor, batch_size: Optional[int]) -> None:
        reduce = entry.reduce_fx
        if reduce == "mean":
            weight = float(batch_size) if batch_size is not None else self._batch_size(name)
            tensor = tensor * weight
            entry.weight += weight
        if entry.total is None:
            entry.total = tensor if reduce == "mean" else tensor.clone()
        elif reduce in ("mean", "sum"):
            entry.total = entry.total + tensor
        else:
            entry.total = torch.maximum(entry.total, tensor) if reduce == "max" else torch.minimum(entry.total, tensor)

    def _entry(self, name: str, prog_bar: bool, logger: Optional[bool], on_step: Optional[bool],
               on_epoch: Optional[bool], reduce_fx: Any, enable_graph: bool, sync_dist: bool, sync_dist_group: Any,
               add_dataloader_idx: bool, rank_zero_only: bool) -> _Entry:
        """The entry a first call of its kind logs to, after checking it against Lightning's rules."""
        fx = self.fx
        rule = hook_rule(name, fx)
        assert fx is not None  # (hook_rule refuses a call outside the loops)
        on_step = rule.step_default if on_step is None else bool(on_step)
        on_epoch = rule.epoch_default if on_epoch is None else bool(on_epoch)
        check_levels(name, fx, rule, on_step, on_epoch)
        if DATALOADER_SUFFIX in name:
            raise ValueError(f"self.log({name!r}): the name must not contain {DATALOADER_SUFFIX!r}; the Trainer adds "
                             f"that suffix itself when several evaluation dataloaders run.")
        reduce = parse_reduce_fx(name, reduce_fx)
        if rank_zero_only and sync_dist:
            raise ValueError(f"self.log({name!r}, rank_zero_only=True, sync_dist=True): a value logged from rank 0 "
                             f"only cannot be reduced across processes (the others never send theirs). Drop one "
                             f"of the two.")
        source = self.dataloader_idx
        options = (on_step, on_epoch, bool(prog_bar), True if logger is None else bool(logger), reduce,
                   bool(sync_dist), sync_dist_group, bool(add_dataloader_idx), bool(enable_graph), bool(rank_zero_only))
        entries = self._collections[self.stage]
        key = (fx, name, source if add_dataloader_idx else None)
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = _Entry(fx, name, source, options)
        elif entry.restored:
            restored, entry = entry, _Entry(fx, name, source, options)
            entry.total, entry.weight, entry.metric, entry.metric_path = (restored.total, restored.weight,
                                                                          restored.metric, restored.metric_path)
            entries[key] = entry
        elif entry.options != options:
            changed = [f"{n}={new!r} (before: {old!r})" for n, old, new in zip(_OPTION_NAMES, entry.options, options)
                       if old != new]
            raise ValueError(f"self.log({name!r}) was called twice in {fx} with different arguments: "
                             f"{', '.join(changed)}. Log it with the same arguments each time, or under another name.")
        elif entry.source_idx != source:
            raise ValueError(f"self.log({name!r}, add_dataloader_idx=False) was called from dataloader {source} after "
                             f"dataloader {entry.source_idx} logged the same name: without the "
                             f"'{DATALOADER_SUFFIX}N' suffix each dataloader needs a name of its own (e.g. "
                             f"f'{name}_{{dataloader_idx}}'), or keep add_dataloader_idx=True.")
        return entry

    def _batch_size(self, name: str) -> float:
        batch, size = self._sized
        if batch is not self.batch or batch is None:
            size = infer_batch_size(name, self.batch)
            self._sized = (self.batch, size)
        return float(size)

    def _metric_path(self, module: torch.nn.Module, metric: Any, name: str) -> str:
        owner, paths = self._metric_paths
        if owner is not module or id(metric) not in paths:
            paths = {id(m): path for path, m in module.named_modules() if is_metric(m)}
            self._metric_paths = (module, paths)
        if id(metric) not in paths:
            raise ValueError(
                f"self.log({name!r}) got a torchmetrics {type(metric).__name__} that is not an attribute of "
                f"{type(module).__name__}; its state could not be saved with checkpoints. Assign it in __init__ "
                f"(self.my_metric = ...), or name it with self.log(..., metric_attribute='my_metric').")
        return paths[id(metric)]

    # -- the loops' side ---------------------------------------------------------------------------
    def start_train_epoch(self, fresh: bool) -> None:
        """A training epoch begins: step-level aggregates start empty (unless resumed mid-epoch)."""
        self.stage, self.dataloader_idx = "train", None
        if fresh:
            for entry in self._collections["train"].values():
                if entry.fx not in ("on_train_start", "on_train_epoch_start"):
                    entry.reset()

    def begin_evaluation(self, stage: str, fresh_steps: bool) -> Tuple[Any, ...]:
        """An evaluation run begins with empty values; returns what `end_evaluation` restores."""
        saved = (self.stage, self.fx, self.dataloader_idx, self.batch)
        self.stage, self.dataloader_idx = stage, None
        for entry in self._collections[stage].values():
            if entry.metric is not None:
                entry.metric.reset()
        self._collections[stage] = {}
        self._checked.clear()
        if fresh_steps:  # trainer.validate/test count logger steps from 0; validation within fit goes on counting
            self._eval_steps = {k: v for k, v in self._eval_steps.items() if k[0] != stage}
        return saved

    def end_evaluation(self, saved: Tuple[Any, ...]) -> None:
        self.stage, self.fx, self.dataloader_idx, self.batch = saved

    def start_eval_loader(self, index: Optional[int], batches: Optional[int]) -> None:
        """Evaluation loader `index` (None when it is the only one) starts, running `batches` steps here."""
        self.dataloader_idx, self.fx = index, f"{'validation' if self.stage == 'validate' else 'test'}_step"
        self._common_steps, self._loader_step = None, 0
        if self.strategy.world_size > 1:
            # Loaders are not padded in evaluation, so processes may run different numbers of steps; synced
            # step values are reduced only on the steps every process runs (one collective per loader).
            mine = torch.tensor([batches if batches is not None else -1], device=self.strategy.root_device)
            self._common_steps = max(0, int(self.strategy.collectives.all_reduce(mine, "min").item()))

    def clear_outputs(self) -> None:
        """Forget every output (after the sanity check, as Lightning does)."""
        self.callback_metrics.clear()
        self.logged_metrics.clear()
        self.progress_bar_metrics.clear()

    # -- step values -------------------------------------------------------------------------------
    def _current_step_entries(self) -> List[_Entry]:
        return [e for e in self._collections[self.stage].values()
                if e.on_step and e.last is not None and e.source_idx == self.dataloader_idx]

    def _publish_steps(self, entries: Iterable[_Entry]) -> Dict[str, torch.Tensor]:
        training, source = self.stage == "train", self.dataloader_idx
        out: Dict[str, torch.Tensor] = {}
        for e in entries:
            value = e.last
            if value is None or not e.on_step or e.source_idx != source:
                continue
            if training:  # (evaluation step values stay out of callback_metrics, as in Lightning)
                self.callback_metrics[e.plain_name] = value
                self.callback_metrics[e.step_name] = value
            if e.logger:
                out[e.step_name] = value
            if e.prog_bar:
                self.progress_bar_metrics[e.step_name] = float(value.detach() if value.requires_grad else value)
        self.logged_metrics.update(out)
        return out

    def refresh(self) -> None:
        """Bring the outputs up to date with the running step's values (when the Trainer's properties are read)."""
        if self.fx in STEP_HOOKS:
            self._publish_steps(self._collections[self.stage].values())

    def flush_step(self) -> Dict[str, torch.Tensor]:
        """The training step values to write now; every process calls it at the same step, so synced ones
        are reduced here (one collective per name), after checking every process logged the same names."""
        entries = self._current_step_entries()
        self._sync_steps(entries)
        return self._publish_steps(entries)

    def flush_eval_step(self, dataloader_idx: int) -> Tuple[int, Dict[str, torch.Tensor]]:
        """This evaluation step's values to write, and their logger step (counted per dataloader)."""
        key = (self.stage, dataloader_idx)
        step = self._eval_steps.get(key, 0)
        self._eval_steps[key] = step + 1
        run_step, self._loader_step = self._loader_step, self._loader_step + 1
        entries = self._current_step_entries()
        if self._common_steps is None or run_step < self._common_steps:
            self._sync_steps(entries)
        return step, self._publish_steps(entries)

    def _sync_steps(self, entries: List[_Entry]) -> None:
        pending = [e for e in entries if e.synced and not e.last_synced]
        check_same_sync_names(self.strategy, self.stage, [e.step_name for e in pending], "per-step ")
        for e in pending:
            last = e.last
            assert last is not None  # (a step's entries hold its value: `_current_step_entries`)
            e.last = reduce_value(self.strategy, last, e.reduce_fx, e.group)
            e.last_synced = True

    # -- epoch values ------------------------------------------------------------------------------
    def epoch_end(self) -> Dict[str, torch.Tensor]:
        """Reduce the running loop's epoch values logged from the current dataloader (syncing where asked),
        publish them, reset them, and return the ones for the loggers."""
        items = [e for e in self._collections[self.stage].values() if e.fresh and e.source_idx == self.dataloader_idx]
        check_same_sync_names(self.strategy, self.stage, [e.epoch_name for e in items if e.on_epoch and e.synced])
        out: Dict[str, torch.Tensor] = {}
        for e in items:
            value = self._epoch_value(e) if e.on_epoch else None
            e.reset()
            if value is None:
                continue
            self.callback_metrics[e.plain_name] = value
            self.callback_metrics[e.epoch_name] = value
            if e.logger:
                out[e.epoch_name] = value
            if e.prog_bar:
                self.progress_bar_metrics[e.epoch_name] = float(value)
        self.logged_metrics.update(out)
        return out

    def _epoch_value(self, e: _Entry) -> Optional[torch.Tensor]:
        if e.metric is not None:
            value = e.metric.compute()  # torchmetrics syncs across processes itself
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return value.detach().float().reshape(())
            if isinstance(value, (int, float)):
                return torch.tensor(float(value), device=self.strategy.root_device)
            raise ValueError(f"The torchmetrics {type(e.metric).__name__} logged as {e.name!r} computed "
                             f"{type(value).__name__} {getattr(value, 'shape', '')}; self.log takes metrics that "
                             f"compute one number. Log a MetricCollection with self.log_dict, or log the parts by name.")
        if e.total is None:
            return None
        total = e.total
        if e.synced:
            total = reduce_value(self.strategy, total, "sum" if e.reduce_fx == "mean" else e.reduce_fx, e.group)
        if e.reduce_fx != "mean":
            return total
        weight = torch.tensor(e.weight, device=total.device, dtype=total.dtype)
        if e.synced:
            weight = reduce_value(self.strategy, weight, "sum", e.group)
        return total / weight

    # -- checkpoints: a mid-epoch checkpoint carries the epoch aggregates logged so far ------------
    def state_dict(self, module: torch.nn.Module) -> Dict[str, Any]:
        """The training loop's unfinished epoch aggregates: running totals, and the state of each logged
        torchmetrics Metric (found by its place in `module`; its own state is not in the weights)."""
        saved_entries = []
        for e in self._collections["train"].values():
            if not e.fresh or not e.on_epoch or (e.total is None and e.metric is None):
                continue
            options = list(e.options)
            # (a process group is not saved: the next log call sets it)
            options[_OPTION_NAMES.index("sync_dist_group")] = None
            saved: Dict[str, Any] = {"fx": e.fx, "name": e.name, "options": options, "total": e.total,
                                     "weight": e.weight}
            if e.metric is not None:
                saved["metric_path"] = e.metric_path
                saved["metric_state"] = dict(e.metric.metric_state)
            saved_entries.append(saved)
        return {"train": saved_entries}

    def load_state_dict(self, state: Dict[str, Any], module: torch.nn.Module) -> None:
        device = self.strategy.root_device
        for saved in state.get("train", []):
            if "options" in saved:
                fx, options = saved["fx"], tuple(saved["options"])
            else:  # written before entries were kept per hook
                fx = "training_step"
                options = (saved["on_step"], saved["on_epoch"], saved["prog_bar"], saved["logger"], saved["reduce_fx"],
                           saved["sync_dist"], None, True, False, False)
            entry = _Entry(fx, saved["name"], None, options)
            entry.fresh = entry.restored = True
            if saved["total"] is not None:
                entry.total, entry.weight = saved["total"].to(device), float(saved["weight"])
            if "metric_path" in saved:
                entry.metric, entry.metric_path = module.get_submodule(saved["metric_path"]), saved["metric_path"]
                for attr, value in saved["metric_state"].items():
                    moved = [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
                    setattr(entry.metric, attr, moved)
            self._collections["train"][(entry.fx, entry.name, None)] = entry
        self._checked.clear()
