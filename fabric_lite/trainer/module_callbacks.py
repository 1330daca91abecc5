"""`TrainModule.configure_callbacks`: the module's callbacks joined to the Trainer's, by Lightning's rule."""

from __future__ import annotations

from typing import Any, List

from fabric_lite.callbacks.base import Callback

__all__ = ["merge_module_callbacks"]


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
