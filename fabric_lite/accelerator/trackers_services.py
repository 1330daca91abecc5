"""Trackers for hosted services that also run offline: Comet (`log_with="comet_ml"`), ClearML (`"clearml"`),
SwanLab (`"swanlab"`) and Trackio (`"trackio"`).

Each has Accelerate's class name and constructor (`run_name`, then the keyword arguments its package's start
function takes, from `init_kwargs={"<name>": {...}}`); `logging_dir` (the Accelerator's project directory) is
where its offline files go unless the package is told otherwise. The package is imported when the tracker
starts; a missing one is named with the extra to install.

Offline use, with nothing sent anywhere:
  comet_ml  COMET_START_ONLINE=false (or `init_kwargs={"comet_ml": {"online": False}}`): an archive
            `<project_dir>/comet_ml/<id>.zip` (or COMET_OFFLINE_DIRECTORY) that `comet upload` sends later;
  clearml   CLEARML_OFFLINE_MODE=1 (or `Task.set_offline(True)` first): a session folder and zip under
            CLEARML_CACHE_DIR/offline that `Task.import_offline_session` sends later;
  swanlab   SWANLAB_MODE=offline (or `init_kwargs={"swanlab": {"mode": "offline"}}`): a run folder in
            `<project_dir>/swanlog` that `swanlab sync` sends later;
  trackio   local by default: a SQLite database per project in TRACKIO_DIR.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Union

from fabric_lite.accelerator.tracker_base import (
    GeneralTracker, config_for_file, flatten, is_number, on_main_process, require, scalar, warn_once,
)
from fabric_lite.accelerator.tracker_setup import (
    clearml_setup_missing, comet_setup_missing, swanlab_setup_missing, trackio_setup_missing,
)

__all__ = ["CometMLTracker", "ClearMLTracker", "SwanLabTracker", "TrackioTracker"]

PathLike = Union[str, "os.PathLike[str]"]


def _numbers_and_texts(values: Dict[str, Any], where: str, warned: set) -> Dict[str, Any]:
    """`values` flattened with '/', tensors as numbers; values that are neither numbers nor strings are left
    out with a warning (once per name)."""
    out = {}
    for key, value in flatten(values).items():
        value = scalar(value)
        if is_number(value) or isinstance(value, str):
            out[key] = value
        else:
            warn_once(warned, key, f"{where} logs numbers and strings: {key}={value!r} is not logged.")
    return out


class CometMLTracker(GeneralTracker):
    """A Comet experiment in the project `run_name`, started by `comet_ml.start(project_name=run_name, **kwargs)`
    (`api_key`, `workspace`, `experiment_key`, `online`, `mode`, `experiment_config`, ...; comet_ml >= 3.41).

    Numbers are metrics at `step`, strings are "others", the configuration is parameters (nested dicts are
    kept, Comet shows them as `a|b`). With a `logging_dir` and no offline directory chosen, an offline
    experiment's archive goes to `logging_dir/comet_ml`. `tracker` is the `comet_ml` experiment.
    """

    name = "comet_ml"
    requires_logging_directory = False
    package = "comet_ml"

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """An API key (COMET_API_KEY, ~/.comet.config) unless offline (COMET_START_ONLINE=false)."""
        return comet_setup_missing(init_kwargs)

    def __init__(self, run_name: str, *, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None
        self._warned: set = set()
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.writer is not None:
            return
        comet_ml = require("comet_ml", "log_with='comet_ml'", "comet")
        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None:
            config = kwargs.get("experiment_config") or comet_ml.ExperimentConfig()
            if getattr(config, "has_default_offline_directory", lambda: False)():
                config.offline_directory = os.path.join(os.fspath(self.logging_dir), "comet_ml")
                os.makedirs(config.offline_directory, exist_ok=True)
            kwargs["experiment_config"] = config
        self.writer = comet_ml.start(project_name=self.run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.writer.log_parameters(config_for_file(values))

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers (and one-element tensors) as metrics at `step`, strings as others; nested dicts are
        flattened with '/'. `kwargs` go to `log_metric` (`epoch=`, ...)."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in _numbers_and_texts(values, "Comet", self._warned).items():
            if isinstance(value, str):
                self.writer.log_other(key, value)
            else:
                self.writer.log_metric(key, value, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """End the experiment (an offline one writes its archive now)."""
        self.writer.end()


class ClearMLTracker(GeneralTracker):
    """A ClearML task, started by `Task.init(**kwargs)` with `project_name` and `task_name` from CLEARML_PROJECT
    and CLEARML_TASK or else `run_name`; a task already started by the script (`Task.current_task()`) is used
    as it is, and not closed by `finish`.

    `log` reports numbers as scalars at `step` (the plot's title is the name, the series is "train", or "eval",
    "test" or "train" for a name starting with that and '_', which is taken off), or as single values without
    a step. The configuration is the task's configuration. `tracker` is the `clearml.Task`.
    """

    name = "clearml"
    requires_logging_directory = False
    package = "clearml"

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """Credentials (~/clearml.conf, CLEARML_API_*_KEY) unless offline (CLEARML_OFFLINE_MODE=1)."""
        return clearml_setup_missing(init_kwargs)

    def __init__(self, run_name: Optional[str] = None, *, logging_dir: Optional[PathLike] = None,
                 **kwargs: Any) -> None:
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self.task: Any = None
        self.initialized_externally = False
        self._warned: set = set()
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.task is not None:
            return
        require("clearml", "log_with='clearml'", "clearml")
        from clearml import Task

        current = Task.current_task()
        if current is not None:
            self.task, self.initialized_externally = current, True
            return
        if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes", "on") and \
                not Task.is_offline():  # clearml read the variable when first imported: it may have been set since
            Task.set_offline(True)
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> Any:
        return self.task.connect_configuration(config_for_file(values))

    @staticmethod
    def title_and_series(name: str) -> "tuple[str, str]":
        """"eval_loss" -> ("loss", "eval"); "loss" -> ("loss", "train")."""
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers as scalars at `step` (single values when `step` is None); other values are left out with a
        warning. `kwargs` go to `report_scalar` / `report_single_value`."""
        logger = self.task.get_logger()
        for key, value in flatten(values).items():
            value = scalar(value)
            if not is_number(value):
                warn_once(self._warned, key, f"ClearML logs numbers: {key}={value!r} is not logged.")
                continue
            if step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self.title_and_series(key)
                logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Report each image (a numpy array or PIL image) under its name at `step`."""
        logger = self.task.get_logger()
        for key, image in values.items():
            title, series = self.title_and_series(key)
            logger.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[List[str]] = None,
                  data: Optional[Sequence[Sequence[Any]]] = None, dataframe: Any = None,
                  step: Optional[int] = None, **kwargs: Any) -> None:
        """Report a table: a pandas `dataframe`, or rows `data` (with `columns` as its header when given)."""
        if dataframe is None:
            if data is None:
                raise ValueError(f"ClearMLTracker.log_table({table_name!r}) needs `data` (rows) or `dataframe`.")
            table = [list(columns)] + [list(row) for row in data] if columns else [list(row) for row in data]
        else:
            table = dataframe
        title, series = self.title_and_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Close the task (an offline one writes its session zip now), unless the script started it."""
        if self.task is not None and not self.initialized_externally:
            self.task.close()


class SwanLabTracker(GeneralTracker):
    """A SwanLab run in the project `run_name`, started by `swanlab.init(project=run_name, **kwargs)`
    (`experiment_name`, `mode`, `logdir`, ...); its files go to `logging_dir/swanlog` when there is a logging
    directory and no `logdir` or SWANLAB_LOG_DIR. Runs on every process (`main_process_only = False`), as in
    Accelerate. `tracker` is the swanlab run.
    """

    name = "swanlab"
    requires_logging_directory = False
    main_process_only = False
    package = "swanlab"

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """An API key (SWANLAB_API_KEY, `swanlab login`) unless offline (SWANLAB_MODE=offline)."""
        return swanlab_setup_missing(init_kwargs)

    def __init__(self, run_name: str, *, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir
        self.init_kwargs = kwargs
        self.run: Any = None
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.run is not None:
            return
        swanlab = require("swanlab", "log_with='swanlab'", "swanlab")
        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None and kwargs.get("logdir") is None and not os.environ.get("SWANLAB_LOG_DIR"):
            kwargs["logdir"] = os.path.join(os.fspath(self.logging_dir), "swanlog")
            os.makedirs(kwargs["logdir"], exist_ok=True)
        self.run = swanlab.init(project=self.run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.run.config.update(config_for_file(values))

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """`values` (numbers, one-element tensors, swanlab media) at `step`; `kwargs` go to `swanlab.log`."""
        self.run.log({key: scalar(value) for key, value in values.items()}, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Log each list of images (numpy arrays or PIL images) under its name at `step`."""
        import swanlab

        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class TrackioTracker(GeneralTracker):
    """A Trackio run in the project `run_name`, started by `trackio.init(project=run_name, **kwargs)` (`name`,
    `space_id`, ...); without a `space_id` it stays local (SQLite under TRACKIO_DIR). Runs on every process
    (`main_process_only = False`), as in Accelerate. `tracker` is the trackio run.
    """

    name = "trackio"
    requires_logging_directory = False
    main_process_only = False
    package = "trackio"

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """A Hugging Face token, only to log to a Space (`space_id`, TRACKIO_SPACE_ID)."""
        return trackio_setup_missing(init_kwargs)

    def __init__(self, run_name: str, *, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None
        self._warned: set = set()
        self.start()

    @on_main_process
    def start(self) -> None:
        if self.run is not None:
            return
        trackio = require("trackio", "log_with='trackio'", "trackio")
        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        import trackio

        trackio.config.update(config_for_file(values), allow_val_change=True)

    @on_main_process
    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers and strings (nested dicts flattened with '/') at `step`; `kwargs` go to the run's `log`."""
        self.run.log(_numbers_and_texts(values, "Trackio", self._warned), step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()
