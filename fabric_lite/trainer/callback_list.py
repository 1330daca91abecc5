"""The Trainer's list of callbacks: the defaults it adds (logger, progress bar, checkpoints, model summary), the
module's own (`TrainModule.configure_callbacks`, joined by Lightning's rule), and their order."""

from __future__ import annotations

from typing import Any, List, Union

from fabric_lite.callbacks.base import Callback, is_logger

__all__ = ["merge_module_callbacks", "add_default_callbacks", "add_model_summary", "order_callbacks"]


def add_default_callbacks(callbacks: List[Callback], root: str, progress_bar: bool, checkpointing: bool,
                          model_summary: bool, logger: Union[List[Callback], bool, None]) -> None:
    """Add the Trainer's defaults to `callbacks` (in place), refusing a default turned off next to one given."""
    from fabric_lite.callbacks.checkpoint import ModelCheckpoint
    from fabric_lite.callbacks.progress import ProgressBar, ProgressBarBase
    from fabric_lite.callbacks.summary import ModelSummary
    from fabric_lite.trainer.settings import default_logger

    # logger=: True adds a default logger (unless callbacks hold one), False refuses loggers in callbacks,
    # loggers given go ahead of the other callbacks, in their order.
    if logger is False:
        given = next((c for c in callbacks if is_logger(c)), None)
        if given is not None:
            raise ValueError(f"logger=False, but a {type(given).__name__} is in callbacks; drop one of them.")
    elif logger is True:
        if not any(is_logger(c) for c in callbacks):
            callbacks.insert(0, default_logger(root))
    elif logger is not None:  # (in the order given, ahead of the other callbacks; each once)
        ids = {id(c) for c in logger}
        callbacks[:] = [*logger, *(c for c in callbacks if id(c) not in ids)]
    summary = next((c for c in callbacks if isinstance(c, ModelSummary)), None)
    if not model_summary and summary is not None:
        raise ValueError("enable_model_summary=False, but a ModelSummary is in callbacks; drop one of them.")
    bar = next((c for c in callbacks if isinstance(c, ProgressBarBase)), None)
    if not progress_bar:
        if bar is not None:
            raise ValueError(f"enable_progress_bar=False, but a {type(bar).__name__} is in callbacks; "
                             f"drop one of them.")
    elif bar is None:
        callbacks.append(ProgressBar())
    if not checkpointing:
        if any(isinstance(c, ModelCheckpoint) for c in callbacks):
            raise ValueError("enable_checkpointing=False, but a ModelCheckpoint is in callbacks; drop one of them.")
    elif not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(ModelCheckpoint())
    order_callbacks(callbacks)


def order_callbacks(callbacks: List[Callback]) -> None:
    """Callbacks that report what the others did at a hook (`Callback.runs_last`) go last, in their order."""
    callbacks.sort(key=lambda c: bool(getattr(c, "runs_last", False)))  # (a stable sort)


def add_model_summary(callbacks: List[Callback]) -> None:
    """The default ModelSummary joins the callbacks when fit starts, unless one is there already: after
    `fabric-lite explain`'s return (which trains nothing and prints no summary), and not at construction, so
    that `callbacks` then holds what was given plus the progress bar and checkpoint defaults."""
    from fabric_lite.callbacks.summary import ModelSummary

    if not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(ModelSummary())
        order_callbacks(callbacks)


def merge_module_callbacks(trainer_callbacks: List[Callback], module_callbacks: Any) -> List[Callback]:
    """The Trainer's callbacks with the module's added: a module callback replaces every Trainer callback whose
    type it is an instance of (a subclass replaces its parent; a plain `Callback` replaces nothing), and
    checkpoint callbacks go after the others (they save what the others have done at the same hook)."""
    from fabric_lite.callbacks.checkpoint import ModelCheckpoint

    if module_callbacks is None:
        return list(trainer_callbacks)
    given = [module_callbacks] if isinstance(module_callbacks, Callback) else list(module_callbacks)
    for cb in given:
        if not isinstance(cb, Callback):
            raise TypeError(f"configure_callbacks() returned a {type(cb).__name__}; it must return Callback "
                            f"instances (a callback or a list of them).")
    if not given:
        return list(trainer_callbacks)
    replaced = {type(t) for t in trainer_callbacks if type(t) is not Callback
                and any(isinstance(m, type(t)) for m in given)}
    ids = {id(m) for m in given}
    merged = [c for c in trainer_callbacks if type(c) not in replaced and id(c) not in ids] + given
    return [c for c in merged if not isinstance(c, ModelCheckpoint)] + [c for c in merged
                                                                        if isinstance(c, ModelCheckpoint)]
