"""Lightning callbacks fabric_lite does not have: each class imports (a script that only names it, or checks
`isinstance` against it, runs); building one raises `NotSupportedError` naming the feature and what to do instead."""

from __future__ import annotations

from fabric_lite.callbacks.base import Callback
from fabric_lite.refusals import refused_class

__all__ = ["BatchSizeFinder", "LearningRateFinder", "RichModelSummary", "Checkpoint"]

_TUNER_INSTEAD = "set it yourself after a short run"
BatchSizeFinder = refused_class("BatchSizeFinder", "searching the largest batch size that fits (Lightning's tuner)",
                                f"{_TUNER_INSTEAD}, or use fabric_lite.find_executable_batch_size in a loop of "
                                f"your own", base=Callback)
LearningRateFinder = refused_class("LearningRateFinder", "the learning-rate range test (Lightning's tuner)",
                                   _TUNER_INSTEAD, base=Callback)
RichModelSummary = refused_class("RichModelSummary", "the model summary drawn with rich",
                                 "use ModelSummary (printed as text)", base=Callback)
Checkpoint = refused_class("Checkpoint", "Lightning's abstract Checkpoint base class",
                           "subclass ModelCheckpoint, or Callback with state_dict/on_save_checkpoint", base=Callback)
