"""The step of an engine that owns it (DeepSpeed): one collaborator, `strategy.engine_step` (None elsewhere).

Such an engine is built once over the model *and* its optimizer (the doors hand both to `strategy.setup` in
one call), is configured with what the door knows before that (`set_run_hints`), and counts the gradient
accumulation window itself: every backward that does not close a window must run inside `micro_step()`,
whether or not the door skips gradient reduction there (`sync_each_batch`); `closing_step()` makes the next
backward close it after all. The strategy reads `boundary` in its backward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

__all__ = ["EngineStep"]


class EngineStep:
    """Joint set-up, run hints and the accumulation boundary of an engine that owns the step."""

    def __init__(self) -> None:
        self.micro_batch_size: Optional[int] = None
        self.accumulation_steps = 1
        self.gradient_clip_val: Optional[float] = None
        #: The next backward closes the accumulation window (False inside `micro_step`).
        self.boundary = True

    def set_run_hints(self, micro_batch_size: Optional[int] = None, accumulation_steps: int = 1,
                      gradient_clip_val: Optional[float] = None) -> None:
        """What the door knows about the run before `setup`: micro-batch size, accumulation, gradient clipping."""
        if micro_batch_size is not None:
            self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        if gradient_clip_val is not None:
            self.gradient_clip_val = gradient_clip_val

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """Backward passes inside are accumulation micro-steps: they do not close the window."""
        saved, self.boundary = self.boundary, False
        try:
            yield
        finally:
            self.boundary = saved

    @contextlib.contextmanager
    def closing_step(self) -> Iterator[None]:
        """Inside `micro_step`, the next backward closes the window after all."""
        saved, self.boundary = self.boundary, True
        try:
            yield
        finally:
            self.boundary = saved
