"""Progress bars on the main process (tqdm by default, or rich), with `prog_bar` metrics refreshed every few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from rich.console import Console

    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ProgressBarBase", "ProgressBar", "RichProgressBar"]


class ProgressBarBase(Callback):
    """What every progress bar shares: main process only, one bar per train epoch, a refresh every
    `refresh_rate` batches (the only time metric values are read from the device).

    Subclasses draw: `_open_train`, `_update_train`, `_close_train`, `_close_all`, and optionally the
    evaluation counterparts `_open_eval`, `_update_eval`, `_close_eval`.
    """

    def __init__(self, refresh_rate: int = 20) -> None:
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 1:
            raise ValueError(f"{type(self).__name__}(refresh_rate={refresh_rate!r}) must be an integer >= 1.")
        self.refresh_rate = refresh_rate
        self._train_shown = False
        self._eval_shown = False
        self._batches = 0

    # -- what subclasses draw ----------------------------------------------------------------------
    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        raise NotImplementedError

    def _update_train(self, completed: int, metrics: Dict[str, str]) -> None:
        raise NotImplementedError

    def _close_train(self, completed: int, metrics: Dict[str, str]) -> None:
        raise NotImplementedError

    def _close_all(self) -> None:
        raise NotImplementedError

    def _open_eval(self, trainer: "Trainer", description: str) -> None: ...
    def _update_eval(self, completed: int) -> None: ...
    def _close_eval(self) -> None: ...

    # -- shared logic ------------------------------------------------------------------------------
    @staticmethod
    def _metrics(trainer: "Trainer") -> Dict[str, str]:
        """The `prog_bar` metrics as short strings (reads device values: call once per refresh)."""
        return {k: f"{float(v):.4g}" for k, v in trainer.progress_bar_metrics.items()}

    @staticmethod
    def _train_total(trainer: "Trainer") -> Optional[int]:
        """Batches this train epoch will run (the loader length under `limit_train_batches`), if known."""
        from fabric_lite.trainer.loops import batch_limit, loader_length

        return batch_limit(trainer.limits["train"], loader_length(trainer.train_dataloader))

    def on_train_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not trainer.is_global_zero:
            return
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
        if trainer.is_global_zero:
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
                                batch_idx: int) -> None:
        self._eval_batch_end(batch_idx)

    def on_validation_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._end_eval()

    def on_test_epoch_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._start_eval(trainer, "Testing")

    def on_test_batch_end(self, trainer: "Trainer", module: "TrainModule", outputs: Any, batch: Any,
                          batch_idx: int) -> None:
        self._eval_batch_end(batch_idx)

    def on_test_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._end_eval()

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        self._train_shown = self._eval_shown = False
        self._close_all()


class ProgressBar(ProgressBarBase):
    """A tqdm bar per epoch with it/s; metric values are read from the device only every `refresh_rate` steps."""

    def __init__(self, refresh_rate: int = 20) -> None:
        super().__init__(refresh_rate)
        self._bar: Any = None

    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        from tqdm.auto import tqdm

        self._close_all()
        self._bar = tqdm(total=total, desc=description, leave=True, dynamic_ncols=True)

    def _update_train(self, completed: int, metrics: Dict[str, str]) -> None:
        self._bar.update(completed - self._bar.n)
        self._bar.set_postfix(metrics, refresh=False)

    def _close_train(self, completed: int, metrics: Dict[str, str]) -> None:
        self._bar.update(completed - self._bar.n)
        self._bar.set_postfix(metrics)
        self._close_all()

    def _close_all(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class RichProgressBar(ProgressBarBase):
    """A rich progress display: a task per train epoch (kept on screen when done if `leave`), and one
    that disappears when done for validation and testing. Writes to `console` (a `rich.console.Console`),
    by default stderr.

    Needs rich: ``pip install 'fabric-lite[rich]'``.
    """

    def __init__(self, refresh_rate: int = 20, console: Optional["Console"] = None, leave: bool = True) -> None:
        try:
            import rich  # noqa: F401
        except ImportError as err:
            raise ImportError("RichProgressBar needs rich: pip install 'fabric-lite[rich]'") from err
        super().__init__(refresh_rate)
        self.console = console
        self.leave = leave
        self._progress: Any = None
        self._train_task: Any = None
        self._eval_task: Any = None
        self._eval_owns_progress = False

    def _start(self, transient: bool) -> Any:
        from rich.progress import Progress

        if self.console is None:
            from rich.console import Console

            self.console = Console(stderr=True)
        progress = Progress(*_rich_columns(), console=self.console, auto_refresh=False, transient=transient)
        progress.start()
        return progress

    def _open_train(self, trainer: "Trainer", description: str, total: Optional[int]) -> None:
        self._close_all()
        self._progress = self._start(transient=not self.leave)
        self._train_task = self._progress.add_task(description, total=total, metrics="")
        self._progress.refresh()

    def _update_train(self, completed: int, metrics: Dict[str, str]) -> None:
        self._progress.update(self._train_task, completed=completed, metrics=_join(metrics), refresh=True)

    def _close_train(self, completed: int, metrics: Dict[str, str]) -> None:
        if self._progress is not None and self._train_task is not None:
            self._progress.update(self._train_task, completed=completed, metrics=_join(metrics))
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

    def _close_all(self) -> None:
        if self._progress is not None:
            if self._progress.live.transient:
                self._progress.live.stop()  # Progress.stop adds a blank line on a non-interactive console
            else:
                self._progress.stop()
        self._progress = self._train_task = self._eval_task = None
        self._eval_owns_progress = False


def _join(metrics: Dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in metrics.items())


def _rich_columns() -> List[Any]:
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
            return Text("? it/s" if not speed else f"{speed:.2f} it/s", style="progress.data.speed")

    return [
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), RateColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[metrics]}", markup=False),
    ]
