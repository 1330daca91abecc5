"""Experiment trackers for the raw door (`Accelerator(log_with="tensorboard")`).

TensorBoard is imported only when a tracker is started, so `import fabric_lite` stays fast.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

__all__ = ["GeneralTracker", "TensorBoardTracker", "make_trackers", "KNOWN_TRACKERS"]


class GeneralTracker:
    """A tracker: `store_init_configuration`, `log`, `finish`; `tracker` is the underlying object."""

    name = "general"

    @property
    def tracker(self) -> Any:
        return None

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        pass

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass


class TensorBoardTracker(GeneralTracker):
    """Write scalars, texts and the run configuration to TensorBoard event files under `logging_dir/run_name`."""

    name = "tensorboard"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # the tensorboard package is missing
            raise ImportError(
                "log_with='tensorboard' needs the tensorboard package: pip install 'fabric-lite[tensorboard]'"
            ) from err
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=2, default=str) + "\n```")
        self.writer.flush()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                raise ValueError(
                    f"Cannot log {key!r}={value!r} to TensorBoard: pass a number, a one-element tensor, "
                    f"a string or a dict of numbers."
                )
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


KNOWN_TRACKERS = {"tensorboard": TensorBoardTracker}


def make_trackers(
    log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]],
    run_name: str, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]],
) -> List[GeneralTracker]:
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, GeneralTracker)) else list(log_with)
    if "all" in items:
        items = [i for i in items if i != "all"] + list(KNOWN_TRACKERS)
    trackers: List[GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            trackers.append(item)
            continue
        cls = KNOWN_TRACKERS.get(str(item).lower())
        if cls is None:
            raise ValueError(f"Unknown tracker {item!r}. Allowed: {', '.join(KNOWN_TRACKERS)}, 'all', or a GeneralTracker.")
        if logging_dir is None:
            raise ValueError(
                f"log_with={item!r} needs a directory: pass Accelerator(project_dir='runs/') or a ProjectConfiguration."
            )
        trackers.append(cls(run_name, logging_dir, **init_kwargs.get(cls.name, {})))
    return trackers
