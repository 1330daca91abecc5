"""`Trainer(barebones=True)`: `self.log` records nothing (logging costs speed), and says so once."""

from __future__ import annotations

import warnings
from typing import Any

from fabric_lite.trainer.logged_metrics import MetricStore

__all__ = ["BarebonesMetricStore"]


class BarebonesMetricStore(MetricStore):
    """The metric store of a barebones Trainer: `self.log`/`log_dict` values are dropped, with one warning."""

    warned = False

    def log(self, module: Any, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"self.log({name!r}, ...) under Trainer(barebones=True): logging is off in barebones mode "
                          f"(it costs speed), so logged values are dropped and callback_metrics stays empty. Drop "
                          f"barebones=True to log.", UserWarning, stacklevel=4)
