"""Trackers that keep everything in local files: DVCLive (`log_with="dvclive"`: plain TSV/JSON/YAML files a DVC
repository can version) and Aim (`log_with="aim"`: an Aim repository that `aim up` shows).

Each has Accelerate's class name and constructor; the package is imported when the tracker starts, and a
missing one is named with the extra to install.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from fabric_lite.accelerator.tracker_base import (
    GeneralTracker, config_for_file, flatten, on_main_process, require, scalar, warn_once,
)

__all__ = ["DVCLiveTracker", "AimTracker"]

PathLike = Union[str, "os.PathLike[str]"]


class DVCLiveTracker(GeneralTracker):
    """A `dvclive.Live` run: `live` when given, else `Live(**kwargs)` (`dir`, `resume`, `save_dvc_exp`, ...).

    `run_name` is not used by DVCLive. Its files go to `dir`, else `logging_dir/dvclive` when there is a
    logging directory, else DVCLive's default (`./dvclive`): `params.yaml` (the configuration),
    `metrics.json` (the latest values), `plots/metrics/<name>.tsv` (one row per step). Each `log` call is
    one step: at `step` when given, and the next one after it. `tracker` is the `Live`.
    """

    name = "dvclive"
    requires_logging_directory = False
    package = "dvclive"

    def __init__(self, run_name: Optional[str] = None, live: Optional[Any] = None, *,
                 logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.live = live
        self.logging_dir = logging_dir
        self.init_kwargs = kwargs
        self._warned: set = set()
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.live is not None:
            return
        require("dvclive", "log_with='dvclive'", "dvclive")
        from dvclive import Live

        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None and kwargs.get("dir") is None:
            kwargs["dir"] = os.path.join(os.fspath(self.logging_dir), "dvclive")
        self.live = Live(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        """Write `values` (nested dicts kept) to params.yaml."""
        self.live.log_params(config_for_file(values))

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers (and one-element tensors; nested dicts flattened with '/') as metrics at `step`, then move
        to the next step; other values are left out with a warning. `kwargs` go to `Live.log_metric`."""
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in flatten(values).items():
            value = scalar(value)
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                warn_once(self._warned, key, f"DVCLive logs numbers: {key}={value!r} is not logged.")
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at `logging_dir` (`aim.Run(repo=logging_dir, **kwargs)`), named `run_name`.

    The configuration is the run's "hparams"; `log` tracks each value under its name at `step` (`kwargs`, such
    as `context={"subset": "train"}` or `epoch=`, go to `Run.track`). `tracker` is the `aim.Run`.
    """

    name = "aim"
    requires_logging_directory = True
    package = "aim"

    def __init__(self, run_name: str, logging_dir: Optional[PathLike] = ".", **kwargs: Any) -> None:
        self.run_name = run_name
        self.aim_repo_path = os.fspath(logging_dir) if logging_dir is not None else "."
        self.init_kwargs = kwargs
        self.writer: Any = None
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.writer is not None:
            return
        aim = require("aim", "log_with='aim'", "aim")
        self.writer = aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.writer["hparams"] = config_for_file(values)

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.writer.track(scalar(value), name=key, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None,
                   kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Track each image (a numpy array or PIL image, or an `(image, caption)` pair) under its name at
        `step`; `kwargs={"aim_image": {...}, "track": {...}}` go to `aim.Image` and `Run.track`."""
        import aim

        image_kwargs = (kwargs or {}).get("aim_image", {})
        track_kwargs = (kwargs or {}).get("track", {})
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption=caption, **image_kwargs), name=key, step=step, **track_kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()
