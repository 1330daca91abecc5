"""Backends for hosted services that also run offline: Weights & Biases, Comet, ClearML, SwanLab and Trackio.

Each opens its run from the keyword arguments its package's start function takes; `logging_dir` (a project
directory) is where offline files go unless the package is told otherwise (`<logging_dir>/comet_ml/<id>.zip`,
`<logging_dir>/swanlog`; W&B under `dir`/wandb; ClearML under CLEARML_CACHE_DIR/offline; Trackio in
TRACKIO_DIR). The package is imported when the backend opens; a missing one is named with the extra to
install (`who` says which front asked). Whether one can start here without an account, and each service's
offline switch, is in trackers/setup.py.
"""

from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from fabric_lite.trackers.base import config_for_file, flatten, is_number, numbers_and_texts, require, scalar, \
    warn_once

__all__ = ["WandbBackend", "CometBackend", "ClearMLBackend", "SwanLabBackend", "TrackioBackend"]

PathLike = Union[str, "os.PathLike[str]"]


class WandbBackend:
    """A W&B run: `wandb.init(**kwargs)` (its folder `dir` made first), or `run` when one is given."""

    def __init__(self, who: str, run: Any = None, **kwargs: Any) -> None:
        if run is None:
            wandb = require("wandb", who, "wandb")
            if kwargs.get("dir") is not None:
                os.makedirs(kwargs["dir"], exist_ok=True)
            run = wandb.init(**kwargs)
        self.run = run

    def log_config(self, values: Any) -> None:
        self.run.config.update(config_for_file(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log({key: scalar(value) for key, value in values.items()}, step=step, **kwargs)

    def finish(self, exit_code: Optional[int] = None) -> None:
        if exit_code is None:
            self.run.finish()
        else:
            self.run.finish(exit_code=exit_code)


class CometBackend:
    """A Comet experiment: `comet_ml.start(project_name=project, **kwargs)` (comet_ml >= 3.41). Numbers are
    metrics, strings "others", the configuration parameters (nested dicts kept: Comet shows `a|b`)."""

    def __init__(self, who: str, project: str, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        comet_ml = require("comet_ml", who, "comet")
        if logging_dir is not None:
            config = kwargs.get("experiment_config") or comet_ml.ExperimentConfig()
            if getattr(config, "has_default_offline_directory", lambda: False)():
                config.offline_directory = os.path.join(os.fspath(logging_dir), "comet_ml")
                os.makedirs(config.offline_directory, exist_ok=True)
            kwargs["experiment_config"] = config
        self.run = comet_ml.start(project_name=project, **kwargs)
        self.warned: set = set()

    def log_config(self, values: Any) -> None:
        self.run.log_parameters(config_for_file(values))

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers (nested dicts flattened with '/') as metrics at `step`, strings as others; `kwargs` go to
        `log_metric`."""
        if step is not None:
            self.run.set_step(step)
        for key, value in numbers_and_texts(values, "Comet", self.warned).items():
            if isinstance(value, str):
                self.run.log_other(key, value)
            else:
                self.run.log_metric(key, value, step=step, **kwargs)

    def finish(self) -> None:
        """End the experiment (an offline one writes its archive now)."""
        self.run.end()


class ClearMLBackend:
    """A ClearML task: the one the script started (`Task.current_task()`, used as it is and not closed), else
    `Task.init(**kwargs)` with `project_name` and `task_name` from CLEARML_PROJECT and CLEARML_TASK or else
    `name`. Numbers are scalars at a step (the plot's title is the name, the series "train", or "eval", "test"
    or "train" for a name starting with that and '_', which is taken off), or single values without one."""

    def __init__(self, who: str, name: Optional[str] = None, **kwargs: Any) -> None:
        require("clearml", who, "clearml")
        from clearml import Task

        self.warned: set = set()
        current: Any = Task.current_task()
        self.initialized_externally = current is not None
        if current is not None:
            self.run = current
            return
        if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes", "on") and \
                not Task.is_offline():  # clearml read the variable when first imported: it may have been set since
            Task.set_offline(True)
        kwargs.setdefault("project_name", os.environ.get("CLEARML_PROJECT", name))
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK", name))
        self.run = Task.init(**kwargs)

    @staticmethod
    def title_and_series(name: str) -> Tuple[str, str]:
        """"eval_loss" -> ("loss", "eval"); "loss" -> ("loss", "train")."""
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"

    def log_config(self, values: Any) -> Any:
        return self.run.connect_configuration(config_for_file(values))

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers as scalars at `step` (single values when `step` is None); others are left out with a warning.
        `kwargs` go to `report_scalar` / `report_single_value`."""
        logger = self.run.get_logger()
        for key, value in flatten(values).items():
            value = scalar(value)
            if not is_number(value):
                warn_once(self.warned, key, f"ClearML logs numbers: {key}={value!r} is not logged.")
                continue
            if step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self.title_and_series(key)
                logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        logger = self.run.get_logger()
        for key, image in values.items():
            title, series = self.title_and_series(key)
            logger.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    def log_table(self, table_name: str, columns: Optional[List[str]] = None,
                  data: Optional[Sequence[Sequence[Any]]] = None, dataframe: Any = None,
                  step: Optional[int] = None, **kwargs: Any) -> None:
        """A pandas `dataframe`, or rows `data` (with `columns` as its header when given)."""
        if dataframe is None:
            if data is None:
                raise ValueError(f"ClearMLTracker.log_table({table_name!r}) needs `data` (rows) or `dataframe`.")
            table = [list(columns)] + [list(row) for row in data] if columns else [list(row) for row in data]
        else:
            table = dataframe
        title, series = self.title_and_series(table_name)
        self.run.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    def finish(self) -> None:
        """Close the task (an offline one writes its session zip now), unless the script started it."""
        if not self.initialized_externally:
            self.run.close()


class SwanLabBackend:
    """A SwanLab run: `swanlab.init(project=project, **kwargs)`, its files in `logging_dir/swanlog` when there is
    a logging directory and no `logdir` or SWANLAB_LOG_DIR."""

    def __init__(self, who: str, project: str, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        swanlab = require("swanlab", who, "swanlab")
        if logging_dir is not None and kwargs.get("logdir") is None and not os.environ.get("SWANLAB_LOG_DIR"):
            kwargs["logdir"] = os.path.join(os.fspath(logging_dir), "swanlog")
            os.makedirs(kwargs["logdir"], exist_ok=True)
        self.run = swanlab.init(project=project, **kwargs)

    def log_config(self, values: Any) -> None:
        self.run.config.update(config_for_file(values))

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """`values` (numbers, one-element tensors, swanlab media) at `step`; `kwargs` go to `swanlab.log`."""
        self.run.log({key: scalar(value) for key, value in values.items()}, step=step, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Each list of images (arrays or PIL images) under its name at `step`."""
        import swanlab

        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class TrackioBackend:
    """A Trackio run: `trackio.init(project=project, **kwargs)`; without a `space_id` it stays local (SQLite
    under TRACKIO_DIR)."""

    def __init__(self, who: str, project: str, **kwargs: Any) -> None:
        trackio = require("trackio", who, "trackio")
        self.run = trackio.init(project=project, **kwargs)
        self.warned: set = set()

    def log_config(self, values: Any) -> None:
        import trackio

        trackio.config.update(config_for_file(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers and strings (nested dicts flattened with '/') at `step`; `kwargs` go to the run's `log`."""
        self.run.log(numbers_and_texts(values, "Trackio", self.warned), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()

