"""Lightning's tuner callbacks: `BatchSizeFinder` (the largest batch size that fits) and `LearningRateFinder` (the
learning-rate range test). `fabric_lite.tuner.Tuner` runs them before a fit; as callbacks they run at its start.

Both probe with short runs of training steps (forward, backward, optimizer step; no other hook, no logging, no
validation) through the fit's own prepared model, optimizers and step engine, then put everything back: the
module's weights and buffers, the optimizers' and schedulers' state, the loss scaler, every random generator and
the accumulation window, so that training afterwards starts from the state it would have started from without them.

On several processes every probe ends the same way everywhere. Each training step of a probe meets the other
processes once, in one small all-reduce after the forward and before the backward, which carries whether this
process ran out of memory there and its loss: if any process did, all of them abandon the trial before DDP's
gradient all-reduce (where a lone failure would leave the others waiting). After each trial the processes also
compare outcomes through the process group's store (`ProcessAgreement`, the same notes
`find_executable_batch_size` exchanges), so an out-of-memory error anywhere else in a trial (the loader, the
optimizer step) is agreed on as well, provided every process finishes the trial. What cannot be recovered is the
same as for `find_executable_batch_size`: one process out of memory inside the backward pass while the others
wait for it in DDP's all-reduce.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lite.accelerator.memory import ProcessAgreement, clear_device_cache, should_reduce_batch_size
from fabric_lite.callbacks.base import Callback
from fabric_lite.rng_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["BatchSizeFinder", "LearningRateFinder", "LRFinder", "TrialOutOfMemory", "TuningFinished",
           "BATCH_SIZE_MODES", "LR_MODES", "find_attribute", "set_attribute", "search_batch_size"]

BATCH_SIZE_MODES = ("power", "binsearch")
LR_MODES = ("exponential", "linear")
LR_ATTRIBUTES = ("lr", "learning_rate")


class TuningFinished(Exception):
    """Raised at the end of a search that `Tuner` started, to end its fit() before training."""


class TrialOutOfMemory(MemoryError):
    """A trial ran out of memory on some process; every process raises it at the same step."""


# -- where a hyperparameter lives: the module, its hparams, the datamodule, its hparams -----------------------------
def _holders(module: Any, datamodule: Any, name: str) -> List[Tuple[Any, bool]]:
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
        holders = _holders(module, datamodule, name)
        if holders:
            owner, mapping = holders[0]
            return name, owner[name] if mapping else getattr(owner, name)
    return None


def set_attribute(module: Any, datamodule: Any, name: str, value: Any) -> None:
    """Set `name` wherever it lives (every holder, so a datamodule and its hparams agree)."""
    holders = _holders(module, datamodule, name)
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
class _Snapshot:
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


def _quiet(*_: Any, **__: Any) -> None:
    """`self.log` during a probe: nothing is recorded."""


class _Probe:
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
        module.log = module.log_dict = _quiet  # type: ignore[method-assign,assignment]
        try:
            self._run(loader, steps, before_step, after_step)
        except Exception as err:
            if not should_reduce_batch_size(err):
                raise
            failure = _describe(err)
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
                    failure = _describe(err)
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


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def _dataset_length(trainer: "Trainer") -> Optional[int]:
    source = getattr(trainer, "train_dataloader_source", None)
    dataset = getattr(source[0], "dataset", None) if source else None
    try:
        return len(dataset) if dataset is not None else None  # type: ignore[arg-type]
    except TypeError:  # (an iterable dataset)
        return None


def _say(trainer: "Trainer", text: str) -> None:
    if trainer.is_global_zero:
        print(f"fabric_lite: {text}", file=sys.stderr, flush=True)


def _skip_reason(trainer: "Trainer", what: str) -> Optional[str]:
    if trainer.fast_dev_run:
        return f"{what} skipped under fast_dev_run"
    if trainer.global_step > 0:
        return f"{what} skipped: training resumes at step {trainer.global_step}"
    return None


# -- the callbacks -------------------------------------------------------------------------------------------------
def _check_int(owner: str, name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}({name}={value!r}): pass an integer >= {low}.")


class BatchSizeFinder(Callback):
    """Find the largest batch size that fits, at the start of fit (Lightning's `BatchSizeFinder`).

    The batch size is the attribute `batch_arg_name` of the module, its hparams, the datamodule or its hparams,
    which the training loader method reads (loaders given to fit() directly cannot be resized). Each trial runs
    `steps_per_trial` optimizer steps; "power" doubles from `init_val` until a trial runs out of memory and keeps
    the last size that fit; "binsearch" then bisects between the two. The size never grows past the dataset's
    length. The size found is set on the attribute and in `optimal_batch_size`, and training starts from the
    state it had before the search, with a loader of that size.

    `keep_global_batch=True` keeps batch size x accumulate_grad_batches: it searches downwards from that global
    batch for the largest micro-batch dividing it that fits, and raises `trainer.accumulate_grad_batches` to make
    up the rest (`init_val` is not used).
    """

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                 batch_arg_name: str = "batch_size", keep_global_batch: bool = False) -> None:
        if mode not in BATCH_SIZE_MODES:
            raise ValueError(f"BatchSizeFinder(mode={mode!r}): choose one of {', '.join(map(repr, BATCH_SIZE_MODES))}.")
        _check_int("BatchSizeFinder", "steps_per_trial", steps_per_trial, 1)
        _check_int("BatchSizeFinder", "init_val", init_val, 1)
        _check_int("BatchSizeFinder", "max_trials", max_trials, 1)
        self.mode, self.steps_per_trial, self.init_val, self.max_trials = mode, steps_per_trial, init_val, max_trials
        self.batch_arg_name, self.keep_global_batch = batch_arg_name, bool(keep_global_batch)
        #: the batch size found (None before a search, or when nothing fit)
        self.optimal_batch_size: Optional[int] = None
        #: each trial's (batch size, whether it fit), in order
        self.trials: List[Tuple[int, bool]] = []
        #: set by `Tuner`: end the fit once the search is done
        self.stop_after_search = False

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self.scale_batch_size(trainer, module)
        if self.stop_after_search:
            raise TuningFinished()

    def scale_batch_size(self, trainer: "Trainer", module: "TrainModule") -> Optional[int]:
        skip = _skip_reason(trainer, "the batch size search")
        if skip is not None:
            _say(trainer, skip)
            return None
        datamodule = trainer.datamodule
        found = find_attribute(module, datamodule, (self.batch_arg_name,))
        if found is None:
            raise AttributeError(
                f"BatchSizeFinder: neither {type(module).__name__} nor its hparams"
                + (f", nor {type(datamodule).__name__} or its hparams," if datamodule is not None else "")
                + f" has {self.batch_arg_name!r}, the batch size its training loader is built with. Add it (e.g. "
                  f"self.{self.batch_arg_name} = 32, read in train_dataloader()), or name it with batch_arg_name=.")
        if not trainer.train_source.reloadable:
            raise ValueError("BatchSizeFinder: the training loader was given to fit() directly, so its batch size "
                             "cannot change; build it in train_dataloader() of the module or a DataModule from "
                             f"the attribute {self.batch_arg_name!r}.")
        original = int(found[1])
        snapshot = _Snapshot(trainer, module)
        probe = _Probe(trainer, module)
        accumulate = trainer.accumulate_grad_batches
        global_batch = original * accumulate

        def fits(size: int) -> bool:
            set_attribute(module, datamodule, self.batch_arg_name, size)
            if self.keep_global_batch:
                trainer.accumulate_grad_batches = global_batch // size
            snapshot.restore(keep_accumulation=self.keep_global_batch)
            failure = probe.trial(self.steps_per_trial)
            _say(trainer, f"batch size {size}" + (f" x {global_batch // size} accumulated" if self.keep_global_batch
                                                  else "") + (": fits" if failure is None else f": {failure}"))
            return failure is None

        try:
            if self.keep_global_batch:
                size, self.trials = search_micro_batch(fits, global_batch, self.mode, self.max_trials)
            else:
                size, self.trials = search_batch_size(fits, self.init_val, self.mode, self.max_trials,
                                                      _dataset_length(trainer))
        except BaseException:
            set_attribute(module, datamodule, self.batch_arg_name, original)
            snapshot.restore()
            raise
        if size is None:
            set_attribute(module, datamodule, self.batch_arg_name, original)
            snapshot.restore()
            raise RuntimeError(f"BatchSizeFinder: no batch size fits; every trial ran out of memory "
                               f"({', '.join(str(s) for s, _ in self.trials)}).")
        set_attribute(module, datamodule, self.batch_arg_name, size)
        if self.keep_global_batch:
            trainer.accumulate_grad_batches = global_batch // size
        snapshot.restore(keep_accumulation=self.keep_global_batch)
        self.optimal_batch_size = size
        _say(trainer, f"batch size {size} found" + (f", accumulating {global_batch // size} batches to keep the global "
                                                    f"batch of {global_batch}" if self.keep_global_batch else ""))
        if not self.stop_after_search:
            _replace_train_loader(trainer)
        return size


def _replace_train_loader(trainer: "Trainer") -> None:
    """Give the running fit a training loader built with the batch size found, in the old one's checkpoint slot."""
    accelerator = trainer.accelerator
    old = trainer.train_dataloader
    new = trainer.prepare_train_dataloader(trainer.train_source.request())
    accelerator.dataloaders.remove(new)
    accelerator.dataloaders[accelerator.dataloaders.index(old)] = new
    new.set_epoch(trainer.current_epoch)
    trainer.train_dataloader = new


class LRFinder:
    """The learning-rate range test's outcome (Lightning's `_LRFinder`): `results` holds "lr" and "loss" (the
    smoothed loss after each step at that learning rate); `suggestion()` picks the learning rate where the loss
    falls fastest; `plot()` draws them (needs matplotlib)."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: Dict[str, List[float]] = {"lr": [], "loss": []}
        self._optimal_idx: Optional[int] = None

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0 .. num_training-1): from lr_min to lr_max."""
        fraction = step / max(1, self.num_training - 1)
        if self.mode == "linear":
            return self.lr_min + fraction * (self.lr_max - self.lr_min)
        return self.lr_min * (self.lr_max / self.lr_min) ** fraction

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> Optional[float]:
        """The learning rate at the steepest fall of the smoothed loss (its most negative gradient), leaving out
        the first `skip_begin` and last `skip_end` points; None (with a note) when fewer than two remain."""
        lrs = self.results["lr"][skip_begin:len(self.results["lr"]) - skip_end]
        losses = self.results["loss"][skip_begin:len(self.results["loss"]) - skip_end]
        points = [(i, lr, loss) for i, (lr, loss) in enumerate(zip(lrs, losses)) if math.isfinite(loss)]
        if len(points) < 2:
            print(f"fabric_lite: the learning-rate finder has {len(points)} usable point(s) after skipping "
                  f"{skip_begin} at the start and {skip_end} at the end: no suggestion. Run more steps "
                  f"(num_training) or lower early_stop_threshold's effect.", file=sys.stderr, flush=True)
            self._optimal_idx = None
            return None
        values = [loss for _, _, loss in points]
        slopes = _gradient(values)
        best = min(range(len(slopes)), key=slopes.__getitem__)
        self._optimal_idx = points[best][0] + skip_begin
        return points[best][1]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """Loss against learning rate (log scale in "exponential" mode); with `suggest`, the suggestion marked.
        Returns the figure."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFinder.plot needs matplotlib: pip install matplotlib") from err
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            lr = self.suggestion()
            if lr is not None and self._optimal_idx is not None:
                ax.plot(lr, losses[self._optimal_idx], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


def _gradient(values: List[float]) -> List[float]:
    """Slopes of equally spaced values: one-sided at the ends, central inside."""
    n = len(values)
    if n == 1:
        return [0.0]
    out = [values[1] - values[0]]
    out += [(values[i + 1] - values[i - 1]) / 2 for i in range(1, n - 1)]
    out.append(values[-1] - values[-2])
    return out


class LearningRateFinder(Callback):
    """The learning-rate range test at the start of fit (Lightning's `LearningRateFinder`).

    Runs `num_training_steps` optimizer steps with the learning rate rising from `min_lr` to `max_lr`
    ("exponential" or "linear"), recording the loss (averaged over the processes and smoothed); it stops early once
    the smoothed loss exceeds `early_stop_threshold` times its best (None: never). The outcome is `optimal_lr`
    (an `LRFinder`). With `update_attr`, the suggestion is written to `attr_name` (or the first of "lr",
    "learning_rate" found on the module, its hparams, the datamodule or its hparams), and the running fit's
    optimizers take it: their learning rates (and their schedulers' base rates) are scaled by suggestion / old
    value. The module's one optimizer is used as configure_optimizers built it (its schedulers do not step
    during the test); the state is put back afterwards.
    """

    def __init__(self, min_lr: float = 1e-8, max_lr: float = 1.0, num_training_steps: int = 100,
                 mode: str = "exponential", early_stop_threshold: Optional[float] = 4.0, update_attr: bool = True,
                 attr_name: str = "") -> None:
        if mode not in LR_MODES:
            raise ValueError(f"LearningRateFinder(mode={mode!r}): choose one of {', '.join(map(repr, LR_MODES))}.")
        if not (0 < min_lr < max_lr):
            raise ValueError(f"LearningRateFinder(min_lr={min_lr!r}, max_lr={max_lr!r}): need 0 < min_lr < max_lr.")
        _check_int("LearningRateFinder", "num_training_steps", num_training_steps, 2)
        self.min_lr, self.max_lr, self.num_training_steps, self.mode = float(min_lr), float(max_lr), \
            num_training_steps, mode
        self.early_stop_threshold, self.update_attr, self.attr_name = early_stop_threshold, update_attr, attr_name
        #: the outcome of the latest test (an LRFinder), None before
        self.optimal_lr: Optional[LRFinder] = None
        #: set by `Tuner`: end the fit once the test is done
        self.stop_after_search = False

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self.lr_find(trainer, module)
        if self.stop_after_search:
            raise TuningFinished()

    def lr_find(self, trainer: "Trainer", module: "TrainModule") -> Optional[LRFinder]:
        skip = _skip_reason(trainer, "the learning-rate finder")
        if skip is not None:
            _say(trainer, skip)
            return None
        datamodule = trainer.datamodule
        attribute = None
        if self.update_attr:
            names = (self.attr_name,) if self.attr_name else LR_ATTRIBUTES
            attribute = find_attribute(module, datamodule, names)
            if attribute is None:
                raise AttributeError(f"LearningRateFinder(update_attr=True): neither {type(module).__name__}, its "
                                     f"hparams, nor the datamodule has {' or '.join(map(repr, names))} to write the "
                                     f"suggestion to. Add it, name it with attr_name=, or pass update_attr=False.")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"LearningRateFinder: configure_optimizers returned {len(trainer.optimizers)} optimizers; "
                             f"the learning-rate range test runs with exactly one.")
        optimizer = trainer.optimizers[0]
        finder = LRFinder(self.mode, self.min_lr, self.max_lr, self.num_training_steps)
        snapshot = _Snapshot(trainer, module)
        probe = _Probe(trainer, module)
        smoothed: List[float] = []
        state = {"average": 0.0, "best": math.inf}
        beta = 0.98

        def before_step(step: int) -> None:
            lr = finder.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            finder.results["lr"].append(lr)

        def after_step(step: int, loss: float) -> bool:
            state["average"] = beta * state["average"] + (1 - beta) * loss
            value = state["average"] / (1 - beta ** (step + 1))
            smoothed.append(value)
            finder.results["loss"].append(value)
            if not math.isfinite(value):
                return True
            threshold = self.early_stop_threshold
            if threshold is not None and step > 0 and value > threshold * state["best"]:
                return True
            state["best"] = min(state["best"], value)
            return False

        try:
            failure = probe.trial(self.num_training_steps, before_step, after_step)
        finally:
            snapshot.restore()
        if failure is not None:
            raise RuntimeError(f"LearningRateFinder: the range test ran out of memory ({failure}); lower the batch "
                               f"size first.")
        del finder.results["lr"][len(finder.results["loss"]):]
        self.optimal_lr = finder
        lr = finder.suggestion()
        if lr is not None and attribute is not None:
            name, old = attribute
            set_attribute(module, datamodule, name, lr)
            if not self.stop_after_search:
                _rescale_learning_rates(trainer, old, lr)
            _say(trainer, f"learning rate {lr:.3g} suggested; {name} set to it")
        return finder


def _rescale_learning_rates(trainer: "Trainer", old: Any, new: float) -> None:
    """The running fit's optimizers (built with `old`) take `new`: every rate scaled by new / old."""
    try:
        ratio = new / float(old)
    except (TypeError, ValueError, ZeroDivisionError):
        ratio = None
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * ratio if ratio is not None else new
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * ratio if ratio is not None else new
    for cfg in trainer.lr_scheduler_configs:
        base = getattr(cfg.scheduler, "base_lrs", None)
        if isinstance(base, list):
            cfg.scheduler.base_lrs = [b * ratio if ratio is not None else new for b in base]
