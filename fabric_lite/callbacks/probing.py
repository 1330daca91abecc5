"""How the tuner's finders probe a fit: short trials of training steps through the fit's own prepared model,
optimizers and step engine, agreed on by every process, and the state put back afterwards.

`Probe.trial` runs a few steps with no other hook, no logging and no validation. Each step meets the other processes
once, in one small all-reduce after the forward and before the backward, carrying whether this process ran out of
memory and its loss: if any did, all of them abandon the trial before DDP's gradient all-reduce. After each trial the
processes compare outcomes through the process group's store (`ProcessAgreement`, as `find_executable_batch_size`
does). `TrainingSnapshot` keeps the module's weights and buffers, the optimizers', schedulers' and loss scaler's
state, every random generator and the accumulation window, and puts them back. `search_batch_size` and
`search_micro_batch` are the searches themselves, over a `fits(size)` answer.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lite.accelerator.memory import ProcessAgreement, clear_device_cache, should_reduce_batch_size
from fabric_lite.rng_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["BATCH_SIZE_MODES", "LR_MODES", "LR_ATTRIBUTES", "TuningFinished", "TrialOutOfMemory", "find_attribute",
           "set_attribute", "search_batch_size", "search_micro_batch", "TrainingSnapshot", "Probe", "describe_error",
           "dataset_length", "say", "skip_reason", "quiet", "attribute_holders"]


BATCH_SIZE_MODES = ("power", "binsearch")
LR_MODES = ("exponential", "linear")
LR_ATTRIBUTES = ("lr", "learning_rate")


class TuningFinished(Exception):
    """Raised at the end of a search that `Tuner` started, to end its fit() before training."""


class TrialOutOfMemory(MemoryError):
    """A trial ran out of memory on some process; every process raises it at the same step."""


# -- where a hyperparameter lives: the module, its hparams, the datamodule, its hparams -----------------------------
def attribute_holders(module: Any, datamodule: Any, name: str) -> List[Tuple[Any, bool]]:
    """Each (object, is_mapping) holding `name`, in Lightning's order: module, module.hparams, datamodule,
    datamodule.hparams."""
    found: List[Tuple[Any, bool]] = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if name in vars(owner) or (hasattr(type(owner), name) and not callable(getattr(type(owner), name))):
            found.append((owner, False))
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            found.append((hparams, True))
        elif hparams is not None and not isinstance(hparams, dict) and hasattr(hparams, name):
            found.append((hparams, False))
    return found


def find_attribute(module: Any, datamodule: Any, names: Tuple[str, ...]) -> Optional[Tuple[str, Any]]:
    """The first of `names` that the module, its hparams, the datamodule or its hparams holds, and its value."""
    for name in names:
        holders = attribute_holders(module, datamodule, name)
        if holders:
            owner, mapping = holders[0]
            return name, owner[name] if mapping else getattr(owner, name)
    return None


def set_attribute(module: Any, datamodule: Any, name: str, value: Any) -> None:
    """Set `name` wherever it lives (every holder, so a datamodule and its hparams agree)."""
    holders = attribute_holders(module, datamodule, name)
    if not holders:
        raise AttributeError(f"{name!r} is neither an attribute nor an hparams entry of the module or datamodule.")
    for owner, mapping in holders:
        if mapping:
            owner[name] = value
        else:
            setattr(owner, name, value)


# -- the searches (pure: `fits(size)` says whether a trial ran) -------------------------------------------------------
def search_batch_size(fits: Callable[[int], bool], start: int, mode: str, max_trials: int,
                      largest: Optional[int] = None) -> Tuple[Optional[int], List[Tuple[int, bool]]]:
    """Grow from `start` (doubling) while trials fit; "power" keeps the last size that fit, "binsearch" then
    bisects between it and the first that did not. A failure before any success halves the size. `largest`
    (the dataset's length) caps the growth. Returns the size found (None: nothing fit) and the trials run."""
    trials: List[Tuple[int, bool]] = []
    size, low, high = start, 0, None  # low: the largest size that fit; high: the smallest that did not
    while len(trials) < max_trials and size >= 1:
        ok = fits(size)
        trials.append((size, ok))
        if ok:
            low = size
            if high is None:
                if largest is not None and size >= largest:
                    break
                size = size * 2 if largest is None else min(size * 2, largest)
                continue
            if mode == "power":  # (it fit after halving from a size that did not)
                break
        else:
            high = size
            if low == 0:
                size //= 2
                continue
            if mode == "power":
                break
        if high - low <= 1:
            break
        size = (low + high) // 2
    return (low or None), trials


def search_micro_batch(fits: Callable[[int], bool], global_batch: int, mode: str,
                       max_trials: int) -> Tuple[Optional[int], List[Tuple[int, bool]]]:
    """For a fixed global batch: the largest divisor of it that fits as the micro-batch (the rest made up by
    accumulation). "power" halves (to the largest divisor at most half) until one fits; "binsearch" then bisects
    among the divisors between it and the last that did not."""
    divisors = [d for d in range(global_batch, 0, -1) if global_batch % d == 0]  # descending
    trials: List[Tuple[int, bool]] = []
    index: Optional[int] = 0  # index into divisors of the next size
    failed_at: Optional[int] = None
    fit_at: Optional[int] = None
    while len(trials) < max_trials and index is not None:
        size = divisors[index]
        ok = fits(size)
        trials.append((size, ok))
        if ok:
            fit_at = index
            if mode == "power" or failed_at is None:
                break
        else:
            failed_at = index
            if fit_at is None:
                smaller = [i for i, d in enumerate(divisors) if d <= size // 2]
                index = smaller[0] if smaller else None
                continue
        if fit_at - failed_at <= 1:
            break
        index = (fit_at + failed_at) // 2
    return (divisors[fit_at] if fit_at is not None else None), trials


# -- the probe: training steps through the fit's prepared objects, and the state put back after --------------------
class TrainingSnapshot:
    """What a probe changes, kept so that it can be put back."""

    def __init__(self, trainer: "Trainer", module: "TrainModule") -> None:
        self.trainer, self.module = trainer, module
        self.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.optimizers = [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers]
        self.schedulers = [copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs
                           if hasattr(cfg.scheduler, "state_dict")]
        scaler = trainer.strategy.precision.scaler
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.rng = capture_rng_state()
        self.accumulate = trainer.accumulate_grad_batches
        self.engine_step = trainer.accelerator.step
        self.training = module.training
        self.should_stop = trainer.should_stop
        self.source = getattr(trainer, "train_dataloader_source", None)
        self.loaders = list(trainer.accelerator.dataloaders)

    def restore(self, keep_accumulation: bool = False) -> None:
        trainer, module = self.trainer, self.module
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            module.load_state_dict(self.weights)
        for opt, state in zip(trainer.optimizers, self.optimizers):
            opt.load_state_dict(state)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs if hasattr(cfg.scheduler, "state_dict")]
        for scheduler, state in zip(schedulers, self.schedulers):
            scheduler.load_state_dict(state)
        scaler = trainer.strategy.precision.scaler
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        restore_rng_state(self.rng)
        if not keep_accumulation:
            trainer.accumulate_grad_batches = self.accumulate
        trainer.accelerator.step = self.engine_step
        trainer.accelerator.gradient_state.sync_gradients = True
        module.train(self.training)
        trainer.should_stop = self.should_stop
        if self.source is not None:
            trainer.train_dataloader_source = self.source
        trainer.accelerator.dataloaders[:] = self.loaders


def quiet(*_: Any, **__: Any) -> None:
    """`self.log` during a probe: nothing is recorded."""


class Probe:
    """Runs trials: `steps` optimizer steps over a freshly requested training loader, agreed across processes."""

    def __init__(self, trainer: "Trainer", module: "TrainModule") -> None:
        self.trainer, self.module = trainer, module
        self.world = trainer.world_size
        #: per optimizer step of the latest trial: the loss averaged over its micro-batches and the processes
        self.losses: List[float] = []
        self.window_losses: List[float] = []

    def trial(self, steps: int, before_step: Optional[Callable[[int], None]] = None,
              after_step: Optional[Callable[[int, float], bool]] = None) -> Optional[str]:
        """Run `steps` optimizer steps; None when they ran on every process, else what ran out of memory (agreed
        on every process). `before_step(i)` runs before step i's first micro-batch; `after_step(i, loss)` after its
        optimizer step, and may end the trial early by returning True."""
        trainer, module = self.trainer, self.module
        loader = trainer.prepare_train_dataloader(trainer.train_source.request())
        failure: Optional[str] = None
        saved: Dict[str, Any] = {name: vars(module)[name] for name in ("training_step", "log", "log_dict") if name in vars(module)}
        module.training_step = self._agreeing(module.training_step)  # type: ignore[method-assign]
        module.log = module.log_dict = quiet  # type: ignore[method-assign,assignment]
        try:
            self._run(loader, steps, before_step, after_step)
        except Exception as err:
            if not should_reduce_batch_size(err):
                raise
            failure = describe_error(err)
        finally:
            for name in ("training_step", "log", "log_dict"):
                vars(module).pop(name, None)
            vars(module).update(saved)
            if loader in trainer.accelerator.dataloaders:
                trainer.accelerator.dataloaders.remove(loader)
            del loader
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
        # (a failed trial's tensors may sit in reference cycles through its error's frames: collected before the next)
        clear_device_cache(garbage_collection=failure is not None)
        agreement = ProcessAgreement.current()
        if agreement is not None:  # (an out-of-memory error outside the step, where every process finished)
            notes = agreement.exchange({"oom": failure})
            failed = [f"process {rank}: {note['oom']}" for rank, note in enumerate(notes) if note.get("oom")]
            failure = "; ".join(failed) if failed else None
        return failure

    def _agreeing(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The training step, followed by one all-reduce of (ran out of memory here, loss) over the processes."""
        trainer, world, probe = self.trainer, self.world, self

        @functools.wraps(step)
        def probing_step(*args: Any, **kwargs: Any) -> Any:
            out, failure, error = None, None, None
            try:
                out = step(*args, **kwargs)
            except Exception as err:
                if world == 1:
                    raise
                if should_reduce_batch_size(err):
                    failure = describe_error(err)
                else:
                    error = err  # (raised below, once the others know: they stop instead of waiting for it)
            loss = out.get("loss") if isinstance(out, dict) else out
            value = float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else math.nan
            if world > 1:
                # (one all-reduce: processes out of memory here, processes stopped by another error, the loss)
                flags = torch.tensor([float(failure is not None), float(error is not None),
                                      0.0 if math.isnan(value) else value], device=trainer.device)
                oom, errors, total = trainer.strategy.collectives.all_reduce(flags, "sum").tolist()
                if error is not None:
                    raise error
                if errors > 0:
                    raise RuntimeError(f"{int(errors)} other process(es) stopped with an error in training_step "
                                       f"during the tuner's probe; this process stops too (see their output).")
                if oom > 0:
                    out = loss = None
                    raise TrialOutOfMemory(failure or f"another process ran out of memory ({int(oom)} of {world})")
                value = math.nan if math.isnan(value) else total / world
            probe.window_losses.append(value)
            return out

        return probing_step

    def _run(self, loader: Any, steps: int, before_step: Optional[Callable[[int], None]],
             after_step: Optional[Callable[[int, float], bool]]) -> None:
        trainer, module = self.trainer, self.module
        engine, model = trainer.accelerator, trainer.model
        assert model is not None
        module.train()
        self.losses = []
        done, batch_idx, epoch = 0, 0, 0
        window_open = False
        while done < steps:
            drew = False
            for batch in loader:
                drew = True
                if trainer.batch_transfer is not None:
                    batch = trainer.batch_transfer(batch, 0)
                if not window_open:
                    if before_step is not None:
                        before_step(done)
                    self.window_losses = []
                    window_open = True
                if module.automatic_optimization:
                    with engine.begin_micro_step(batch_idx, None, (model,)):
                        out = model(batch, batch_idx)
                        loss = out.get("loss") if isinstance(out, dict) else out
                        if not isinstance(loss, torch.Tensor):
                            raise ValueError(f"training_step returned {type(out).__name__}; with automatic "
                                             f"optimization it must return the loss or a dict with a 'loss' key.")
                        engine.backward(loss, model)
                    closes = engine.gradient_state.sync_gradients
                    if closes:
                        engine.step_optimizers(trainer.optimizers, trainer.gradient_clip_val,
                                               trainer.gradient_clip_algorithm)
                else:
                    model(batch, batch_idx)
                    closes = True
                batch_idx += 1
                if closes:
                    window_open = False
                    finite = [v for v in self.window_losses if not math.isnan(v)]
                    mean = sum(finite) / len(finite) if finite else math.nan
                    self.losses.append(mean)
                    done += 1
                    if after_step is not None and after_step(done - 1, mean):
                        return
                    if done >= steps:
                        return
            if not drew:
                raise ValueError("The training loader yielded no batches: the finders need at least one batch.")
            epoch += 1
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)


def describe_error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def dataset_length(trainer: "Trainer") -> Optional[int]:
    source = getattr(trainer, "train_dataloader_source", None)
    dataset = getattr(source[0], "dataset", None) if source else None
    try:
        return len(dataset) if dataset is not None else None  # type: ignore[arg-type]
    except TypeError:  # (an iterable dataset)
        return None


def say(trainer: "Trainer", text: str) -> None:
    if trainer.is_global_zero:
        print(f"fabric_lite: {text}", file=sys.stderr, flush=True)


def skip_reason(trainer: "Trainer", what: str) -> Optional[str]:
    if trainer.fast_dev_run:
        return f"{what} skipped under fast_dev_run"
    if trainer.global_step > 0:
        return f"{what} skipped: training resumes at step {trainer.global_step}"
    return None
