"""Experiment trackers for the raw door: `Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv", "comet_ml",
"aim", "clearml", "dvclive", "swanlab", "trackio"])`, with the names and constructors of Accelerate's
`accelerate.tracking`.

Each tracker is a thin adapter over its service's backend in `fabric_lite.trackers` (the Trainer's loggers use
the same ones): it keeps Accelerate's arguments and attributes and hands the work on. A service's package is
an extra (`pip install 'fabric-lite[mlflow]'`) imported only when the tracker starts, so `import fabric_lite`
stays fast and a missing package is named when it is needed, in one sentence. Trackers run on the main
process only (`Accelerator.init_trackers` starts none elsewhere).

`log_with="all"` starts the installed trackers that can start here as things are: one that would need an
account nobody set up (no API key or login, and no offline mode switched on; trackers/setup.py decides, from
the environment and config files) or a project directory that was not given is left out, and one warning
names each with what it needs. A tracker named in `log_with` is started anyway, and fails loudly.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Type, Union

from fabric_lite.accelerator.tracker_base import BackendTracker, GeneralTracker, on_main_process
from fabric_lite.trackers.base import is_installed
from fabric_lite.trackers.local import AimBackend, CSVBackend, DVCLiveBackend, TensorBoardBackend
from fabric_lite.trackers.mlflow_run import MLflowBackend
from fabric_lite.trackers.services import ClearMLBackend, CometBackend, SwanLabBackend, TrackioBackend, WandbBackend
from fabric_lite.trackers.setup import (
    clearml_setup_missing, comet_setup_missing, swanlab_setup_missing, trackio_setup_missing, wandb_setup_missing,
)

__all__ = ["GeneralTracker", "on_main_process", "TensorBoardTracker", "MLflowTracker", "WandBTracker", "CSVTracker",
           "CometMLTracker", "AimTracker", "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker", "TrackioTracker",
           "KNOWN_TRACKERS", "LOGGER_TYPE_TO_CLASS", "available_trackers", "get_available_trackers", "make_trackers",
           "is_installed"]

PathLike = Union[str, "os.PathLike[str]"]


class TensorBoardTracker(GeneralTracker):
    """Scalars, texts and the run configuration in TensorBoard event files under `logging_dir/run_name`, flushed
    at each call. `writer` (and `tracker`) is the SummaryWriter."""

    name = "tensorboard"
    requires_logging_directory = True
    package = "tensorboard"

    def __init__(self, run_name: str, logging_dir: PathLike, **kwargs: Any) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.backend = TensorBoardBackend(self.logging_dir, "log_with='tensorboard'", **kwargs)
        self.writer = self.backend.writer

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.backend.log_config("config", values)
        self.backend.flush()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.backend.log(values, step, **kwargs)
        self.backend.flush()

    def finish(self) -> None:
        self.backend.close()


class CSVTracker(GeneralTracker):
    """Rows of `step` plus the values logged at it in `logging_dir/run_name/metrics.csv`; the configuration in
    `hparams.yaml` beside it. The file is written as values come (a new column rewrites it with the wider
    header); one that is there already (a resumed run) is read first and added to."""

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: PathLike) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.backend = CSVBackend(self.logging_dir, resume=True)

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.backend.log_config(values)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        if self.backend.log(values, step):
            self.backend.write_all()
        else:
            self.backend.write_last()


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment named after the project, MLflow's active run until `finish()` (so
    `mlflow.log_artifact(...)` in the script goes to it; `tracker` is that `mlflow.ActiveRun`).

    Where it goes: `tracking_uri` (`init_kwargs={"mlflow": {"tracking_uri": "http://host:5000"}}`), else a URI
    already set, else a SQLite store in the project directory (`mlflow.db`, artifacts in `mlartifacts`). As in
    Accelerate, MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID and MLFLOW_TAGS (JSON) win over the arguments. The
    configuration is params (nested dicts flattened with '/'); `log` logs numbers as metrics.
    """

    name = "mlflow"
    package = "mlflow"

    def __init__(self, experiment_name: str, logging_dir: Optional[PathLike] = None,
                 run_id: Optional[str] = None, tags: Optional[Union[Dict[str, Any], str]] = None,
                 nested_run: bool = False, run_name: Optional[str] = None, description: Optional[str] = None,
                 tracking_uri: Optional[str] = None, artifact_location: Optional[str] = None) -> None:
        self.backend = MLflowBackend.start_active(
            "log_with='mlflow'", experiment_name, logging_dir, run_id=run_id, tags=tags, nested_run=nested_run,
            run_name=run_name, description=description, tracking_uri=tracking_uri,
            artifact_location=artifact_location)
        backend = self.backend
        self.tracking_uri, self.client, self.active_run = backend.tracking_uri, backend.client, backend.active_run
        self.run_id, self.experiment_id = backend.run_id, backend.experiment_id

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.backend.log_config(values)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.backend.log(values, step)

    def log_artifact(self, local_path: PathLike, artifact_path: Optional[str] = None) -> None:
        """Upload a file to the run's artifacts (under `artifact_path`)."""
        self.backend.log_artifact(local_path, artifact_path)

    def log_artifacts(self, local_dir: PathLike, artifact_path: Optional[str] = None) -> None:
        """Upload a folder's files to the run's artifacts (under `artifact_path`)."""
        self.backend.log_artifacts(local_dir, artifact_path)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib (or plotly) figure as the artifact `artifact_file` ("plots/loss.png")."""
        self.backend.log_figure(figure, artifact_file, **save_kwargs)

    def finish(self) -> None:
        self.backend.finish()


class WandBTracker(GeneralTracker):
    """A Weights & Biases run in the project named by `init_trackers(project_name)`: `init_kwargs={"wandb":
    {...}}` go to `wandb.init`; its files go under the project directory (`dir=`) when there is one. Offline:
    WANDB_MODE=offline or `mode="offline"`. `run` (and `tracker`) is the `wandb` run."""

    name = "wandb"
    package = "wandb"
    setup_missing = staticmethod(wandb_setup_missing)

    def __init__(self, run_name: str, logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        if logging_dir is not None and kwargs.get("dir") is None:
            kwargs["dir"] = os.fspath(logging_dir)
        self.run_name = run_name
        self.backend = WandbBackend("log_with='wandb'", project=run_name, **kwargs)
        self.run = self.backend.run

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.backend.log_config(values)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.backend.log(values, step, **kwargs)

    def finish(self) -> None:
        self.backend.finish()


class CometMLTracker(BackendTracker):
    """A Comet experiment in the project `run_name`: `comet_ml.start(project_name=run_name, **kwargs)` (`api_key`,
    `workspace`, `online`, `experiment_config`, ...). Offline (COMET_START_ONLINE=false), its archive goes to
    `logging_dir/comet_ml` unless an offline directory is chosen. `writer` (and `tracker`) is the experiment."""

    name = "comet_ml"
    package = "comet_ml"
    setup_missing = staticmethod(comet_setup_missing)
    writer = BackendTracker.tracker

    def open_backend(self) -> Any:
        return CometBackend(self.who, self.run_name, self.logging_dir, **self.init_kwargs)


class ClearMLTracker(BackendTracker):
    """A ClearML task: `Task.init(**kwargs)`, named from CLEARML_PROJECT / CLEARML_TASK or else `run_name`; a task
    the script started is used as it is, and not closed by `finish`. `log` reports numbers as scalars (series
    "eval", "test" or "train" from the name's prefix). Offline: CLEARML_OFFLINE_MODE=1. `task` (and `tracker`)
    is the `clearml.Task`."""

    name = "clearml"
    package = "clearml"
    setup_missing = staticmethod(clearml_setup_missing)
    title_and_series = staticmethod(ClearMLBackend.title_and_series)
    task = BackendTracker.tracker

    def __init__(self, run_name: Optional[str] = None, *, logging_dir: Optional[PathLike] = None,
                 **kwargs: Any) -> None:
        self.user_provided_run_name = run_name
        super().__init__(run_name, logging_dir=logging_dir, **kwargs)  # type: ignore[arg-type]

    def open_backend(self) -> Any:
        return ClearMLBackend(self.who, self.run_name, **self.init_kwargs)

    @property
    def initialized_externally(self) -> bool:
        return bool(self.backend is not None and self.backend.initialized_externally)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Report each image (a numpy array or PIL image) under its name at `step`."""
        self.backend.log_images(values, step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[List[str]] = None,
                  data: Optional[Sequence[Sequence[Any]]] = None, dataframe: Any = None,
                  step: Optional[int] = None, **kwargs: Any) -> None:
        """Report a table: a pandas `dataframe`, or rows `data` (with `columns` as its header when given)."""
        self.backend.log_table(table_name, columns, data, dataframe, step, **kwargs)


class SwanLabTracker(BackendTracker):
    """A SwanLab run in the project `run_name`: `swanlab.init(project=run_name, **kwargs)`, its files in
    `logging_dir/swanlog` unless `logdir` or SWANLAB_LOG_DIR says otherwise; offline: SWANLAB_MODE=offline. Runs
    on every process (`main_process_only = False`), as in Accelerate. `run` (and `tracker`) is the run."""

    name = "swanlab"
    main_process_only = False
    package = "swanlab"
    setup_missing = staticmethod(swanlab_setup_missing)
    run = BackendTracker.tracker

    def open_backend(self) -> Any:
        return SwanLabBackend(self.who, self.run_name, self.logging_dir, **self.init_kwargs)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Log each list of images (numpy arrays or PIL images) under its name at `step`."""
        self.backend.log_images(values, step, **kwargs)


class TrackioTracker(BackendTracker):
    """A Trackio run in the project `run_name`: `trackio.init(project=run_name, **kwargs)`, local (SQLite under
    TRACKIO_DIR) unless a `space_id` is given. Runs on every process (`main_process_only = False`), as in
    Accelerate. `run` (and `tracker`) is the run."""

    name = "trackio"
    main_process_only = False
    package = "trackio"
    setup_missing = staticmethod(trackio_setup_missing)
    run = BackendTracker.tracker

    def open_backend(self) -> Any:
        return TrackioBackend(self.who, self.run_name, **self.init_kwargs)


class DVCLiveTracker(BackendTracker):
    """A `dvclive.Live` run: `live` when given, else `Live(**kwargs)`, its files in `dir`, else
    `logging_dir/dvclive`, else `./dvclive` (`run_name` is not used). Each `log` call is one step: at `step`
    when given, and the next one after it. `live` (and `tracker`) is the `Live`."""

    name = "dvclive"
    package = "dvclive"

    def __init__(self, run_name: Optional[str] = None, live: Optional[Any] = None, *,
                 logging_dir: Optional[PathLike] = None, **kwargs: Any) -> None:
        self.given_live = live
        super().__init__(run_name, logging_dir=logging_dir, **kwargs)  # type: ignore[arg-type]

    def open_backend(self) -> Any:
        return DVCLiveBackend(self.who, self.given_live, self.logging_dir, **self.init_kwargs)

    @property
    def live(self) -> Any:
        return self.given_live if self.backend is None else self.backend.run

    tracker = live


class AimTracker(BackendTracker):
    """An Aim run named `run_name` in the repository at `logging_dir`: `aim.Run(repo=logging_dir, **kwargs)`; the
    configuration is its "hparams", `log` kwargs (`context=`, `epoch=`) go to `Run.track`. `writer` (and
    `tracker`) is the `aim.Run`."""

    name = "aim"
    requires_logging_directory = True
    package = "aim"
    writer = BackendTracker.tracker

    def __init__(self, run_name: str, logging_dir: Optional[PathLike] = ".", **kwargs: Any) -> None:
        self.aim_repo_path = os.fspath(logging_dir) if logging_dir is not None else "."
        super().__init__(run_name, logging_dir=logging_dir, **kwargs)

    def open_backend(self) -> Any:
        return AimBackend(self.who, self.run_name, self.aim_repo_path, **self.init_kwargs)

    @on_main_process
    def log_images(self, values: Dict[str, Any], step: Optional[int] = None,
                   kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Track each image (an array or PIL image, or an `(image, caption)` pair) under its name at `step`;
        `kwargs={"aim_image": {...}, "track": {...}}` go to `aim.Image` and `Run.track`."""
        self.backend.log_images(values, step, kwargs)


KNOWN_TRACKERS = {cls.name: cls for cls in (TensorBoardTracker, MLflowTracker, WandBTracker, CSVTracker, CometMLTracker,
                                             AimTracker, ClearMLTracker, DVCLiveTracker, SwanLabTracker,
                                             TrackioTracker)}
LOGGER_TYPE_TO_CLASS = KNOWN_TRACKERS  # Accelerate's name for it


def available_trackers() -> List[str]:
    """Every tracker whose package is installed (what `log_with="all"` tries; it skips those `setup_missing`
    says lack an account here)."""
    return [name for name, cls in KNOWN_TRACKERS.items() if cls.package is None or is_installed(cls.package)]


def get_available_trackers() -> List[str]:
    """Accelerate's name for `available_trackers`."""
    return available_trackers()


def make_trackers(
    log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]],
    run_name: str, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]],
) -> List[GeneralTracker]:
    """The trackers `log_with` names, started.

    A name given in `log_with` is started whatever it lacks: an error of its package comes with what
    `setup_missing` says is missing. `"all"` adds every installed tracker that can start here as things are,
    and names the others in one warning with what each needs: a project directory, or an account (an API key,
    a login) for a service where no offline mode is switched on.
    """
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, GeneralTracker)) else list(log_with)
    named = {str(i).lower() for i in items if isinstance(i, str) and i != "all"}
    skipped: List[str] = []
    if "all" in items:
        items = [i for i in items if i != "all"]
        for name in available_trackers():
            reason = None if name in named else _cannot_start(KNOWN_TRACKERS[name], logging_dir, init_kwargs)
            if reason is None:
                items.append(name)
            else:
                skipped.append(f"{name} ({reason})")
    if skipped:
        warnings.warn(f"log_with='all' skips {'; '.join(skipped)}. A tracker named in log_with is started anyway.",
                      UserWarning, stacklevel=3)
    trackers: List[GeneralTracker] = []
    started: Dict[str, GeneralTracker] = {}
    try:
        for item in items:
            if isinstance(item, GeneralTracker):
                trackers.append(item)
                continue
            name = str(item).lower()
            cls = KNOWN_TRACKERS.get(name)
            if cls is None:
                raise ValueError(f"Unknown tracker {item!r}. Allowed: {', '.join(KNOWN_TRACKERS)}, 'all', or a "
                                 f"GeneralTracker.")
            if name in started:  # ["tensorboard", "all"]: one of each
                continue
            if cls.requires_logging_directory and logging_dir is None:
                raise ValueError(
                    f"log_with={item!r} needs a directory: pass Accelerator(project_dir='runs/') or a "
                    f"ProjectConfiguration."
                )
            started[name] = _start(cls, run_name, logging_dir, init_kwargs.get(cls.name, {}))
            trackers.append(started[name])
    except BaseException:
        for tracker in started.values():  # those started here are not left open (an MLflow run, a wandb process)
            try:
                tracker.finish()
            except Exception:
                pass
        raise
    return trackers


def _cannot_start(cls: Type[GeneralTracker], logging_dir: Optional[str],
                  init_kwargs: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why `log_with="all"` leaves `cls` out here, or None."""
    if cls.requires_logging_directory and logging_dir is None:
        return "no directory: pass Accelerator(project_dir=...)"
    return cls.setup_missing(init_kwargs.get(cls.name, {}))


def _start(cls: Type[GeneralTracker], run_name: str, logging_dir: Optional[str],
           kwargs: Dict[str, Any]) -> GeneralTracker:
    """`cls` started; when its package refuses and `setup_missing` knows why, the error says what to set."""
    try:
        return cls(run_name, logging_dir=logging_dir, **kwargs)  # type: ignore[call-arg]  # (each tracker takes them)
    except ImportError:
        raise
    except Exception as err:
        missing = cls.setup_missing(kwargs)
        if missing is None:
            raise
        said = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"log_with={cls.name!r} could not start ({missing}). {cls.name} said: "
                         f"{type(err).__name__}: {said}") from err
