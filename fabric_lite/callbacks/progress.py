"""Progress bars on the main process (tqdm by default, or rich), with `prog_bar` metrics refreshed every few steps.

`TQDMProgressBar` and `RichProgressBar` take Lightning's arguments; `ProgressBar` is the Trainer's default: a
TQDMProgressBar that refreshes every 20 batches (metric values are read from the device only then) and keeps
each epoch's bar on screen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from rich.console import Console

    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ProgressBarBase", "TQDMProgressBar", "ProgressBar", "RichProgressBar", "RichProgressBarTheme"]


class ProgressBarBase(Callback):
    """What every progress bar shares: main process only, one bar per train epoch, a refresh every
    `refresh_rate` batches (the only time metric values are read from the device); `refresh_rate=0` or
    `disable()` draws nothing.

    Subclasses draw: `_open_train`, `_update_train`, `_close_train`, `_close_all`, and optionally the
    evaluation counterparts `_open_eval`, `_update_eval`, `_close_eval`. Override `get_metrics` to change what
    the bar shows (as in Lightning).
    """

    def __init__(self, refresh_rate: int = 20) -> None:
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
            raise ValueError(f"{type(self).__name__}(refresh_rate={refresh_rate!r}) must be an integer >= 0: redraw "
                             f"every N batches, 0 to draw nothing.")
        self.refresh_rate = refresh_rate
        self._enabled = True
        self._trainer: Optional["Trainer"] = None
        self._train_shown = False
        self._eval_shown = False
        self._batches = 0

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        """Draw nothing from now on (e.g. on processes other than the main one)."""
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def trainer(self) -> "Trainer":
        """The Trainer this bar draws for (once a stage has started)."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} has no trainer yet: it is attached when fit, validate or test "
                               f"starts.")
        return self._trainer

    def get_metrics(self, trainer: "Trainer", pl_module: "TrainModule") -> Dict[str, Union[int, float, str]]:
        """The values the bar shows: the `prog_bar` metrics (override to add, rename or hide some)."""
        return {k: float(v) for k, v in trainer.progress_bar_metrics.items()}

    # -- what subclasses draw ----------------------------------------------------------------------
    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        raise NotImplementedError

    def _update_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _close_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _close_all(self) -> None:
        raise NotImplementedError

    def _open_eval(self, trainer: "Trainer", description: str) -> None: ...
    def _update_eval(self, completed: int) -> None: ...
    def _close_eval(self) -> None: ...

    # -- shared logic ------------------------------------------------------------------------------
    def _metrics(self, trainer: "Trainer") -> Dict[str, Any]:
        """What `get_metrics` gives, numbers as floats (reads device values: call once per refresh)."""
        values = self.get_metrics(trainer, trainer.module)  # type: ignore[arg-type]
        return {k: v if isinstance(v, str) else float(v) for k, v in values.items()}

    @staticmethod
    def _train_total(trainer: "Trainer") -> Optional[int]:
        """Batches this train epoch will run (the loader length under `limit_train_batches`), if known."""
        from fabric_lite.data.limits import batch_limit, loader_length

        return batch_limit(trainer.limits["train"], loader_length(trainer.train_dataloader))

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not trainer.is_global_zero or self.is_disabled:
            return
        self._trainer = trainer
        self._batches = 0
        self._open_train(trainer, f"Epoch {trainer.current_epoch}", self._train_total(trainer))
        self._train_shown = True

    def on_train_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._train_shown:
            return
        self._batches = batch_idx + 1
        if self._batches % self.refresh_rate == 0:
            self._update_train(self._batches, self._metrics(trainer))

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._train_shown:
            self._train_shown = False
            self._close_train(self._batches, self._metrics(trainer))

    def _start_eval(self, trainer: "Trainer", description: str) -> None:
        if trainer.is_global_zero and self.is_enabled:
            self._trainer = trainer
            self._open_eval(trainer, description)
            self._eval_shown = True

    def _eval_batch_end(self, batch_idx: int) -> None:
        if self._eval_shown and (batch_idx + 1) % self.refresh_rate == 0:
            self._update_eval(batch_idx + 1)

    def _end_eval(self) -> None:
        if self._eval_shown:
            self._eval_shown = False
            self._close_eval()

    def on_validation_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._start_eval(trainer, "Sanity checking" if trainer.sanity_checking else "Validation")

    def on_validation_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_end(batch_idx)

    def on_validation_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._end_eval()

    def on_test_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._start_eval(trainer, "Testing")

    def on_test_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_end(batch_idx)

    def on_test_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._end_eval()

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        self._train_shown = self._eval_shown = False
        self._close_all()


class TQDMProgressBar(ProgressBarBase):
    """tqdm bars (Lightning's default bar): one for training, reset at each epoch (a new one per epoch, the
    finished ones kept on screen, with `leave`), and one below it while validating or testing.

    `refresh_rate`: redraw every N batches (0: draw nothing); `process_position`: start that many bar pairs
    down, to share the screen with other bars.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate)
        if not isinstance(process_position, int) or isinstance(process_position, bool) or process_position < 0:
            raise ValueError(f"{type(self).__name__}(process_position={process_position!r}) must be an integer >= 0 "
                             f"(the bars start that many bar pairs down).")
        if not isinstance(leave, bool):
            raise TypeError(f"{type(self).__name__}(leave={leave!r}) must be True (keep each epoch's bar) or False.")
        self.process_position = process_position
        self.leave = leave
        self._bar: Any = None
        self._eval_bar: Any = None

    @staticmethod
    def _tqdm(**kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        return tqdm(dynamic_ncols=True, **kwargs)

    # Lightning's customization points: override one, call super() and change the bar it returns.
    def init_train_tqdm(self) -> Any:
        """The training bar (its total and description are set at each epoch start)."""
        return self._tqdm(desc="Training", leave=True, position=2 * self.process_position)

    def init_sanity_tqdm(self) -> Any:
        """The bar of the sanity check before training."""
        return self._tqdm(desc="Sanity checking", leave=False, position=2 * self.process_position)

    def init_validation_tqdm(self) -> Any:
        """The validation bar: under the training bar during fit (cleared when done), alone otherwise."""
        below = self._bar is not None
        return self._tqdm(desc="Validation", leave=not below, position=2 * self.process_position + int(below))

    def init_test_tqdm(self) -> Any:
        """The bar of trainer.test()."""
        return self._tqdm(desc="Testing", leave=True, position=2 * self.process_position)

    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        if self._bar is None or self.leave:
            self._close_all()
            self._bar = self.init_train_tqdm()
        self._bar.set_description(description, refresh=False)
        self._bar.reset(total=total)

    def _update_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        self._bar.update(completed - self._bar.n)
        self._bar.set_postfix(_short(metrics), refresh=False)

    def _close_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        self._bar.update(completed - self._bar.n)
        self._bar.set_postfix(_short(metrics))
        if self.leave:  # this epoch's bar stays as it is; the next epoch draws a new one
            self._close_all()

    def _open_eval(self, trainer: "Trainer", description: str) -> None:
        if trainer.sanity_checking:
            self._eval_bar = self.init_sanity_tqdm()
        elif description == "Testing":
            self._eval_bar = self.init_test_tqdm()
        else:
            self._eval_bar = self.init_validation_tqdm()

    def _update_eval(self, completed: int) -> None:
        self._eval_bar.update(completed - self._eval_bar.n)

    def _close_eval(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def _close_all(self) -> None:
        self._close_eval()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressBar(TQDMProgressBar):
    """The Trainer's default bar: a TQDMProgressBar redrawn (and its metrics read) every 20 batches, keeping each
    epoch's bar on screen."""

    def __init__(self, refresh_rate: int = 20, process_position: int = 0, leave: bool = True) -> None:
        super().__init__(refresh_rate, process_position, leave)


@dataclass
class RichProgressBarTheme:
    """The styles RichProgressBar draws with (rich style strings), and how it writes metrics."""

    description: str = ""
    progress_bar: str = "#6206E0"
    progress_bar_finished: str = "#6206E0"
    progress_bar_pulse: str = "#6206E0"
    batch_progress: str = ""
    time: str = "dim"
    processing_speed: str = "dim underline"
    metrics: str = "italic"
    metrics_text_delimiter: str = ", "
    metrics_format: str = ".4g"


class RichProgressBar(ProgressBarBase):
    """A rich progress display: a task per train epoch (kept on screen when done if `leave`), and one
    that disappears when done for validation and testing. Writes to `console` (a `rich.console.Console`),
    by default stderr.

    Needs rich: ``pip install 'fabric-lite[rich]'``.
    """

    def __init__(self, refresh_rate: int = 20, leave: bool = True, theme: Optional[RichProgressBarTheme] = None,
                 console_kwargs: Optional[Dict[str, Any]] = None, console: Optional["Console"] = None) -> None:
        try:
            import rich  # noqa: F401
        except ImportError as err:
            raise ImportError("RichProgressBar needs rich: pip install 'fabric-lite[rich]'") from err
        super().__init__(refresh_rate)
        if theme is not None and not isinstance(theme, RichProgressBarTheme):
            raise TypeError(f"RichProgressBar(theme={theme!r}) must be a RichProgressBarTheme.")
        self.console = console
        self.console_kwargs = dict(console_kwargs or {})
        self.leave = leave
        self.theme = theme or RichProgressBarTheme()
        self._progress: Any = None
        self._train_task: Any = None
        self._eval_task: Any = None
        self._eval_owns_progress = False

    def _start(self, transient: bool) -> Any:
        from rich.progress import Progress

        if self.console is None:
            from rich.console import Console

            self.console = Console(**{"stderr": True, **self.console_kwargs})
        progress = Progress(*_rich_columns(self.theme), console=self.console, auto_refresh=False, transient=transient)
        progress.start()
        return progress

    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        self._close_all()
        self._progress = self._start(transient=not self.leave)
        self._train_task = self._progress.add_task(description, total=total, metrics="")
        self._progress.refresh()

    def _update_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        self._progress.update(self._train_task, completed=completed, metrics=self._join(metrics), refresh=True)

    def _close_train(self, completed: int, metrics: Dict[str, Any]) -> None:
        if self._progress is not None and self._train_task is not None:
            self._progress.update(self._train_task, completed=completed, metrics=self._join(metrics))
        self._close_all()

    def _open_eval(self, trainer: "Trainer", description: str) -> None:
        if self._progress is None:
            self._progress = self._start(transient=True)
            self._eval_owns_progress = True
        self._eval_task = self._progress.add_task(description, total=None, metrics="")
        self._progress.refresh()

    def _update_eval(self, completed: int) -> None:
        self._progress.update(self._eval_task, completed=completed, refresh=True)

    def _close_eval(self) -> None:
        if self._progress is None:
            return
        if self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
        if self._eval_owns_progress:
            self._close_all()
        else:
            self._progress.refresh()

    def _join(self, metrics: Dict[str, Any]) -> str:
        """`key=value` pairs in the theme's number format, joined by its delimiter."""
        spec = self.theme.metrics_format
        return self.theme.metrics_text_delimiter.join(
            f"{k}={v if isinstance(v, str) else format(v, spec)}" for k, v in metrics.items())

    def _close_all(self) -> None:
        if self._progress is not None:
            if self._progress.live.transient:
                self._progress.live.stop()  # Progress.stop adds a blank line on a non-interactive console
            else:
                self._progress.stop()
        self._progress = self._train_task = self._eval_task = None
        self._eval_owns_progress = False


def _short(metrics: Dict[str, Any]) -> Dict[str, str]:
    return {k: v if isinstance(v, str) else f"{v:.4g}" for k, v in metrics.items()}


def _rich_columns(theme: RichProgressBarTheme) -> List[Any]:
    from rich.progress import (
        BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Iterations per second: rich's windowed estimate, or the task's average until it has one."""

        def render(self, task: Any) -> Text:
            speed = task.speed
            if speed is None and task.elapsed:
                speed = task.completed / task.elapsed
            return Text("? it/s" if not speed else f"{speed:.2f} it/s", style=theme.processing_speed)

    return [
        TextColumn("[progress.description]{task.description}", style=theme.description),
        BarColumn(style="bar.back", complete_style=theme.progress_bar, finished_style=theme.progress_bar_finished,
                  pulse_style=theme.progress_bar_pulse),
        MofNCompleteColumn(table_column=Column(style=theme.batch_progress)),
        TimeElapsedColumn(table_column=Column(style=theme.time)),
        TimeRemainingColumn(table_column=Column(style=theme.time)), RateColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[metrics]}", markup=False, style=theme.metrics),
    ]
