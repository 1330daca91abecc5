"""How many batches a loop runs over a loader: its length, where it has one, under a batch limit (the Trainer's
`limit_*_batches`, `overfit_batches`)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["batch_limit", "loader_length"]


def batch_limit(limit: Any, length: Optional[int]) -> Optional[int]:
    """How many batches to run: `limit` as a count (int) or a fraction of the loader (float)."""
    if limit is None:
        return length
    if isinstance(limit, float) and 0.0 <= limit <= 1.0:
        if length is None:
            raise ValueError(f"A fractional batch limit ({limit}) needs a dataloader with a length.")
        return int(length * limit)
    if isinstance(limit, int) and limit >= 0:
        return limit if length is None else min(limit, length)
    raise ValueError(f"Batch limit {limit!r} must be an int >= 0 or a float in [0.0, 1.0].")


def loader_length(loader: Any) -> Optional[int]:
    """`len(loader)`, or None for a loader without a length (an iterable dataset's)."""
    try:
        return len(loader)
    except TypeError:
        return None
