"""Lightning callbacks fabric_lite does not have: each class imports (a script that only names it, or checks
`isinstance` against it, runs); building one raises `NotSupportedError` naming the feature and what to do instead."""

from __future__ import annotations

from fabric_lite.callbacks.base import Callback
from fabric_lite.refusals import refused_class

__all__ = ["RichModelSummary", "Checkpoint"]

# (BatchSizeFinder and LearningRateFinder work: fabric_lite/callbacks/finders.py)
RichModelSummary = refused_class("RichModelSummary", "the model summary drawn with rich",
                                 "use ModelSummary (printed as text)", base=Callback)
Checkpoint = refused_class("Checkpoint", "Lightning's abstract Checkpoint base class",
                           "subclass ModelCheckpoint, or Callback with state_dict/on_save_checkpoint", base=Callback)
