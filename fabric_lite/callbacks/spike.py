"""SpikeDetection: a guard against loss and gradient-norm spikes (NaN/inf included) that every process decides
together, once per optimizer step, before the optimizer steps.

Lightning's arguments (`window`, `warmup`, `atol`, `rtol`, `finite_only`, `exclude_batches_path`) keep their meaning:
a value is a spike when it is worse than the previous one and differs from the running mean of the last `window`
good values by at least `atol` and by at least `rtol` times that mean (a tolerance given as None is not checked);
with `finite_only=True` (the default) a non-finite value is a spike too. Finite spikes are looked for once `warmup`
good values were seen. Each process compares its own loss with its own running mean; the gradient norm is checked
after the gradients were averaged. `mode` says what every process does about a spike on any process:

* ``"error"`` (Lightning's behaviour): raise `TrainingSpikeException` on every process at that step, after writing
  the offending batches to `exclude_batches_path`;
* ``"warn"``: warn on every process and step as usual;
* ``"skip"``: drop the gradients on every process and skip that optimizer step (parameters, optimizer state,
  schedulers and the loss scaler are left as they were; `global_step` does not advance);
* ``"rollback"``: every process restores the newest whole checkpoint and goes on from there, leaving out the batches
  of the offending step (by their position in the epoch's order). The positions left out are kept in the
  callback's checkpoint state and in `exclude_batches_path`, so a later resume leaves them out too.

Lightning's own `mode="min"`/`"max"` (the direction in which the loss improves) is accepted as ``"error"`` with that
direction; `direction` names it otherwise.

How the processes agree: under DDP (gradients averaged in backward) a process whose loss is a spike multiplies it by
NaN before backward, so the gradient all-reduce the step makes anyway carries the news to every process: each one
then finds non-finite gradients and decides the same, with no collective of its own. Elsewhere (sharded gradients,
an engine that owns the step, a loss scaler, `"warn"`) one all-reduce of two flags per step decides. One process:
no collective at all.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

import torch

from fabric_lite.callbacks.base import Callback
from fabric_lite.checkpoint import files as checkpoint_io

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["SpikeDetection", "TrainingSpikeException", "SPIKE_MODES"]

SPIKE_MODES = ("error", "warn", "skip", "rollback")


class TrainingSpikeException(RuntimeError):
    """A loss or gradient-norm spike, raised on every process by `SpikeDetection(mode="error")`."""

    def __init__(self, batch_idx: int, what: str = "loss or gradient norm", epoch: Optional[int] = None,
                 message: Optional[str] = None) -> None:
        where = f"batch {batch_idx}" + (f" of epoch {epoch}" if epoch is not None else "")
        super().__init__(message or f"Training spike detected in {where} ({what}).")
        self.batch_idx = batch_idx


class _Running:
    """The running mean of the last `window` good values, and the last one."""

    def __init__(self, window: int) -> None:
        self.values: Deque[float] = deque(maxlen=window)
        self.last: Optional[float] = None
        self.seen = 0

    def add(self, value: float) -> None:
        self.values.append(value)
        self.last = value
        self.seen += 1

    @property
    def mean(self) -> Optional[float]:
        return sum(self.values) / len(self.values) if self.values else None

    def state_dict(self) -> Dict[str, Any]:
        return {"values": list(self.values), "last": self.last, "seen": self.seen}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state.get("values", []))
        self.last, self.seen = state.get("last"), int(state.get("seen", len(self.values)))


class SpikeDetection(Callback):
    """Detect loss and gradient-norm spikes and act on them on every process together (see the module docstring).

    Args:
        mode: ``"error"``, ``"warn"``, ``"skip"`` or ``"rollback"`` (Lightning's ``"min"``/``"max"``: ``"error"``
            with that `direction`).
        window: how many good values the running mean holds.
        warmup: good values seen before finite spikes are looked for (non-finite ones always count).
        atol, rtol: absolute and relative tolerance against the running mean (None: not checked).
        exclude_batches_path: the JSON file (or a directory for ``skip_batches.json``) listing the batches left out,
            as ``[epoch, batch_idx]`` pairs; default ``<default_root_dir>/skip_batches.json``.
        finite_only: a non-finite value is a spike (False: it is only kept out of the running mean).
        direction: ``"min"`` (a higher value is worse) or ``"max"``.
        grad_norm: look for finite spikes of the total gradient norm as well as of the loss (non-finite gradients
            are spikes either way, with `finite_only`).
    """

    def __init__(self, mode: str = "error", window: int = 10, warmup: int = 1, atol: Optional[float] = None,
                 rtol: Optional[float] = 2.0, exclude_batches_path: Optional[str] = None, finite_only: bool = True,
                 direction: str = "min", grad_norm: bool = False) -> None:
        if mode in ("min", "max"):  # Lightning's meaning of `mode`
            mode, direction = "error", mode
        if mode not in SPIKE_MODES:
            raise ValueError(f"SpikeDetection(mode={mode!r}): allowed modes are {', '.join(map(repr, SPIKE_MODES))} "
                             f"(or Lightning's 'min'/'max', the direction in which the loss improves).")
        if direction not in ("min", "max"):
            raise ValueError(f"SpikeDetection(direction={direction!r}) must be 'min' or 'max'.")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"SpikeDetection(window={window!r}) must be an integer >= 1.")
        self.mode, self.window, self.warmup, self.atol, self.rtol = mode, window, warmup, atol, rtol
        self.exclude_batches_path = exclude_batches_path
        self.finite_only, self.direction, self.grad_norm = finite_only, direction, grad_norm
        self.loss_stats, self.norm_stats = _Running(window), _Running(window)
        #: positions left out, as (epoch, batch_idx); a batch_idx alone (Lightning's file) leaves it out every epoch
        self.excluded: Set[Tuple[int, int]] = set()
        self.excluded_always: Set[int] = set()
        self.spikes = 0  # steps found bad so far (each acted on)
        self.window_batches: List[int] = []  # this optimizer step's batches so far
        self.pending: List[torch.Tensor] = []  # their local losses (detached)
        self.local_flag: Optional[torch.Tensor] = None  # a local loss spike in this window (not fused)
        self.fused = False
        self.world_size = 1

    @property
    def state_key(self) -> str:
        return f"SpikeDetection{{mode={self.mode!r}}}"

    # -- set-up --------------------------------------------------------------------------------------
    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage != "fit":
            return
        if self.exclude_batches_path is None:
            self.exclude_batches_path = os.path.join(trainer.default_root_dir, "skip_batches.json")
        elif not str(self.exclude_batches_path).endswith(".json"):
            self.exclude_batches_path = os.path.join(str(self.exclude_batches_path), "skip_batches.json")
        strategy = trainer.strategy
        if self.mode in ("skip", "rollback"):
            if not module.automatic_optimization:
                raise ValueError(f"SpikeDetection(mode={self.mode!r}) acts before the optimizer step, which a module "
                                 f"with automatic_optimization=False takes itself; use mode='error' or 'warn' there.")
            if strategy.engine_step is not None:
                raise ValueError(f"SpikeDetection(mode={self.mode!r}): {type(strategy).__name__} steps its optimizer "
                                 f"inside its engine, which cannot skip a step; use mode='error' or 'warn'.")
        self.world_size = trainer.world_size
        # gradients averaged in backward and replicated on every process: the all-reduce carries the decision
        replicated = isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
        self.fused = (self.world_size > 1 and replicated and self.mode != "warn" and self.finite_only
                      and strategy.precision.scaler is None and module.automatic_optimization)
        self.read_exclusions()

    def read_exclusions(self) -> None:
        """Add the positions listed in `exclude_batches_path` (written by an earlier run) to those left out."""
        path = self.exclude_batches_path
        if path is None or not os.path.isfile(path):
            return
        with open(path) as f:
            listed = json.load(f)
        for item in listed:
            if isinstance(item, (list, tuple)):
                self.excluded.add((int(item[0]), int(item[1])))
            else:
                self.excluded_always.add(int(item))

    def write_exclusions(self, trainer: "Trainer") -> None:
        if trainer.is_global_zero and self.exclude_batches_path is not None:
            folder = os.path.dirname(self.exclude_batches_path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            listed: List[Any] = sorted([e, b] for e, b in self.excluded) + sorted(self.excluded_always)
            tmp = f"{self.exclude_batches_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(listed, f)
            os.replace(tmp, self.exclude_batches_path)

    def excluded_batches(self, epoch: int) -> Set[int]:
        """The positions of epoch `epoch` left out (the training loop asks once per epoch)."""
        return {b for e, b in self.excluded if e == epoch} | self.excluded_always

    # -- the step (called by the training loop) --------------------------------------------------------
    def spike_of(self, value: torch.Tensor, stats: _Running) -> torch.Tensor:
        """Whether `value` (a scalar tensor) is a spike against `stats`, as a bool tensor (no host read)."""
        bad = ~torch.isfinite(value) if self.finite_only else torch.zeros((), dtype=torch.bool, device=value.device)
        mean, last = stats.mean, stats.last
        if mean is None or last is None or stats.seen < self.warmup or (self.atol is None and self.rtol is None):
            return bad
        worse = value > last if self.direction == "min" else value < last
        if self.atol is not None:
            worse = worse & ((value - mean).abs() >= abs(self.atol))
        if self.rtol is not None:
            worse = worse & ((value - mean).abs() >= abs(self.rtol * mean))
        return bad | worse

    def mark(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Note this micro-step's loss; the loss to run backward on (under the fused decision, times NaN where it is
        a spike, so that the gradient all-reduce tells every process)."""
        value = loss.detach().float()
        self.window_batches.append(batch_idx)
        self.pending.append(value)
        spike = self.spike_of(value, self.loss_stats)
        if self.fused:
            return loss * torch.where(spike, torch.full((), math.nan, device=value.device),
                                      torch.ones((), device=value.device)).to(loss.dtype)
        self.local_flag = spike if self.local_flag is None else self.local_flag | spike
        return loss

    def total_grad_norm(self, trainer: "Trainer") -> Optional[torch.Tensor]:
        module = trainer.module
        assert module is not None
        norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
        return torch.stack(norms).norm() if norms else None

    def verdict(self, trainer: "Trainer", batch_idx: int) -> str:
        """At the step that closes an accumulation window, before the optimizers step: "step" or, decided on every
        process alike, "skip" (the gradients are dropped here) or "rollback" (`rollback` restores). Raises under
        "error"; warns and steps under "warn"."""
        scaler = trainer.strategy.precision.scaler  # (its scaled gradients are its own to judge)
        checks_norm = (self.grad_norm or self.finite_only) and scaler is None
        norm = self.total_grad_norm(trainer) if checks_norm else None
        device = norm.device if norm is not None else trainer.device
        norm_t = norm if norm is not None else torch.zeros((), device=device)
        if norm is None:
            norm_bad = torch.zeros((), dtype=torch.bool, device=device)
        elif self.grad_norm:
            norm_bad = self.spike_of(norm_t, self.norm_stats)
        else:  # (non-finite gradients only; under the fused decision, also the news of a process's loss spike)
            norm_bad = ~torch.isfinite(norm_t)
        losses = self.pending
        if self.fused:  # the gradients (averaged in backward) already carry every process's loss verdict
            flags = torch.stack([norm_bad.float(), torch.zeros((), device=device)])
        else:
            local = self.local_flag if self.local_flag is not None else torch.zeros((), dtype=torch.bool)
            flags = torch.stack([local.to(device).float(), norm_bad.float()])
            if self.world_size > 1:
                flags = trainer.strategy.collectives.all_reduce(flags, "max")
        parts = [flags.float(), norm_t.detach().float().reshape(1)]
        if losses:
            parts.append(torch.stack(losses).to(device))
        read = torch.cat(parts).tolist()  # (the step's one host read)
        loss_bad, grad_bad = (bool(read[1]), bool(read[0])) if self.fused else (bool(read[0]), bool(read[1]))
        batches, self.window_batches, self.pending, self.local_flag = self.window_batches, [], [], None
        if not (loss_bad or grad_bad):
            for value in read[3:]:
                if math.isfinite(value):
                    self.loss_stats.add(value)
            if norm is not None and math.isfinite(read[2]):
                self.norm_stats.add(read[2])
            return "step"
        self.spikes += 1
        what = ("the loss of some process" if loss_bad else "the gradient norm") if not self.fused else \
            "the loss of some process, or the gradient norm"
        epoch = trainer.current_epoch
        if self.mode == "warn":
            norm_note = f" (gradient norm {read[2]:.4g})" if norm is not None else ""
            warnings.warn(f"SpikeDetection: a spike in {what} at batch {batch_idx} of epoch {epoch}{norm_note}; "
                          f"stepping as usual (mode='warn').", UserWarning, stacklevel=3)
            return "step"  # (its values are kept out of the running means, as a spike's are)
        self.excluded.update((epoch, b) for b in batches)
        if self.mode == "error":
            self.write_exclusions(trainer)
            raise TrainingSpikeException(batch_idx, what, epoch)
        for opt in trainer.optimizers:  # the gradients are dropped on every process
            opt.zero_grad(set_to_none=True)
        if self.mode == "skip":
            return "skip"
        self.write_exclusions(trainer)
        return "rollback"

    def rollback(self, trainer: "Trainer") -> None:
        """Restore the newest whole checkpoint on every process, keeping the positions left out."""
        trainer.accelerator.wait_for_checkpoint()
        root = trainer.checkpoint_dir()
        found = checkpoint_io.newest_whole_checkpoint(root) if trainer.is_global_zero else None
        found = trainer.strategy.collectives.broadcast_object(found)
        if found is None:
            raise TrainingSpikeException(-1, message=f"SpikeDetection(mode='rollback'): a spike, and no whole "
                                                     f"checkpoint under {root} to go back to; save checkpoints during "
                                                     f"training (ModelCheckpoint).")
        excluded, always, spikes = set(self.excluded), set(self.excluded_always), self.spikes
        trainer.accelerator.load_state(found)
        self.excluded |= excluded
        self.excluded_always |= always
        self.spikes = spikes
        self.window_batches, self.pending, self.local_flag = [], [], None
        if trainer.is_global_zero:
            print(f"fabric_lite: SpikeDetection rolled back to {found}; leaving out batches "
                  f"{sorted(self.excluded)}", flush=True)

    # -- manual optimization (Lightning's check after the batch) ---------------------------------------
    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if module.automatic_optimization:
            return  # (checked before the optimizer step: `verdict`)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        self.mark(loss, batch_idx)
        self.verdict(trainer, batch_idx)

    # -- checkpoint state ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"loss": self.loss_stats.state_dict(), "grad_norm": self.norm_stats.state_dict(),
                "excluded": sorted([e, b] for e, b in self.excluded), "excluded_always": sorted(self.excluded_always),
                "spikes": self.spikes, "exclude_batches_path": self.exclude_batches_path}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loss_stats.load_state_dict(state.get("loss", {}))
        self.norm_stats.load_state_dict(state.get("grad_norm", {}))
        self.excluded |= {(int(e), int(b)) for e, b in state.get("excluded", [])}
        self.excluded_always |= {int(b) for b in state.get("excluded_always", [])}
        self.spikes = int(state.get("spikes", 0))
