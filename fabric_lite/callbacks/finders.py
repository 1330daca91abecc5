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

import math
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from fabric_lite.callbacks.base import Callback
from fabric_lite.callbacks.probing import (
    BATCH_SIZE_MODES, LR_ATTRIBUTES, LR_MODES, Probe, TrainingSnapshot, TrialOutOfMemory, TuningFinished,
    dataset_length, find_attribute, say, search_batch_size, search_micro_batch, set_attribute,
    skip_reason,
)

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["BatchSizeFinder", "LearningRateFinder", "LRFinder", "TrialOutOfMemory", "TuningFinished",
           "BATCH_SIZE_MODES", "LR_MODES", "find_attribute", "set_attribute", "search_batch_size",
           "search_micro_batch"]


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
        skip = skip_reason(trainer, "the batch size search")
        if skip is not None:
            say(trainer, skip)
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
        snapshot = TrainingSnapshot(trainer, module)
        probe = Probe(trainer, module)
        accumulate = trainer.accumulate_grad_batches
        global_batch = original * accumulate

        def fits(size: int) -> bool:
            set_attribute(module, datamodule, self.batch_arg_name, size)
            if self.keep_global_batch:
                trainer.accumulate_grad_batches = global_batch // size
            snapshot.restore(keep_accumulation=self.keep_global_batch)
            failure = probe.trial(self.steps_per_trial)
            say(trainer, f"batch size {size}" + (f" x {global_batch // size} accumulated" if self.keep_global_batch
                                                  else "") + (": fits" if failure is None else f": {failure}"))
            return failure is None

        try:
            if self.keep_global_batch:
                size, self.trials = search_micro_batch(fits, global_batch, self.mode, self.max_trials)
            else:
                size, self.trials = search_batch_size(fits, self.init_val, self.mode, self.max_trials,
                                                      dataset_length(trainer))
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
        say(trainer, f"batch size {size} found" + (f", accumulating {global_batch // size} batches to keep the global "
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
        skip = skip_reason(trainer, "the learning-rate finder")
        if skip is not None:
            say(trainer, skip)
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
        snapshot = TrainingSnapshot(trainer, module)
        probe = Probe(trainer, module)
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
            say(trainer, f"learning rate {lr:.3g} suggested; {name} set to it")
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
