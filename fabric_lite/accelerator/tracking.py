"""Experiment trackers for the raw door: `Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv"])`.

Each tracker's package is an extra (`pip install 'fabric-lite[mlflow]'`) imported only when the tracker starts,
so `import fabric_lite` stays fast and a missing package is named when it is needed, in one sentence. Trackers run
on the main process only (`Accelerator.init_trackers` starts none elsewhere).

The helpers below the trackers (`require`, `flatten`, `scalar`, the `mlflow_*` functions) are shared with the
Trainer's logger callbacks (fabric_lite/callbacks/loggers.py).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import json
import numbers
import os
import re
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

__all__ = ["GeneralTracker", "TensorBoardTracker", "MLflowTracker", "WandBTracker", "CSVTracker", "make_trackers",
           "KNOWN_TRACKERS"]


# -- shared helpers ------------------------------------------------------------------------------------

def require(module: str, who: str, extra: str) -> Any:
    """Import `module`, or raise ModuleNotFoundError saying in one sentence what to install.

    `who` names what needs it (``"log_with='mlflow'"``, ``"MLFlowLogger"``); `extra` is the fabric-lite extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        message = f"{who} needs {top}: pip install 'fabric-lite[{extra}]'"
        if (err.name or "").split(".")[0] == top:
            raise ModuleNotFoundError(message, name=top) from None
        # the package is there but something it imports is not: say which
        raise ModuleNotFoundError(f"{message} (importing {top} failed: {err})", name=err.name) from err


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flatten(values: Any, sep: str = "/", prefix: str = "") -> Dict[str, Any]:
    """{"opt": {"lr": 0.1}} -> {"opt/lr": 0.1}; an argparse.Namespace counts as a dict."""
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


def scalar(value: Any) -> Any:
    """A one-element tensor or array as a Python number; anything else as it is."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        numel = getattr(value, "numel", None)
        count = numel() if callable(numel) else getattr(value, "size", 1)
        if count == 1:
            return value.item()
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def config_for_file(values: Any) -> Any:
    """`values` made of plain JSON/YAML types (anything else as its str())."""
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    return json.loads(json.dumps(values, default=str))


# MLflow's limits: a batch takes up to 1000 metrics and 100 params; a param value up to 6000 characters.
MLFLOW_MAX_METRICS_PER_BATCH = 1000
MLFLOW_MAX_PARAMS_PER_BATCH = 100
MLFLOW_MAX_PARAM_LENGTH = 6000
_MLFLOW_BAD_KEY = re.compile(r"[^\w/.\- :]")


def mlflow_local_uri(directory: Union[str, os.PathLike]) -> str:
    """The tracking URI of a SQLite store in `directory` (mlflow.db)."""
    os.makedirs(directory, exist_ok=True)
    return "sqlite:///" + os.path.abspath(os.path.join(os.fspath(directory), "mlflow.db"))


def mlflow_experiment_id(client: Any, name: str, artifact_location: Optional[str] = None,
                         tags: Optional[Dict[str, Any]] = None) -> str:
    """The id of the experiment called `name`, created when there is none."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location, tags=tags)
        except MlflowException:  # created meanwhile by another job
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise ValueError(
            f"The MLflow experiment {name!r} (id {experiment.experiment_id}) is deleted: restore it "
            f"(`mlflow experiments restore --experiment-id {experiment.experiment_id}`) or use another name."
        )
    return experiment.experiment_id


def mlflow_key(key: str, warned: set) -> str:
    """`key` with the characters MLflow refuses in names replaced by '_' (once warned about)."""
    clean = _MLFLOW_BAD_KEY.sub("_", key)
    if clean != key and key not in warned:
        warned.add(key)
        warnings.warn(f"MLflow names allow letters, digits and '_-./ :'; {key!r} is logged as {clean!r}.")
    return clean


def mlflow_log_metrics(client: Any, run_id: str, metrics: Mapping[str, Any], step: Optional[int],
                       warned: set) -> None:
    """Log the numbers of `metrics` (nested dicts flattened with '/') at `step`; warn about, and skip, others."""
    from mlflow.entities import Metric

    timestamp = int(time.time() * 1000)
    items = []
    for key, value in flatten(metrics).items():
        value = scalar(value)
        if not is_number(value):
            if key not in warned:
                warned.add(key)
                warnings.warn(f"MLflow logs numbers: {key}={value!r} is not logged (log_params takes other values).")
            continue
        items.append(Metric(mlflow_key(key, warned), float(value), timestamp, int(step or 0)))
    for start in range(0, len(items), MLFLOW_MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=items[start:start + MLFLOW_MAX_METRICS_PER_BATCH])


def mlflow_log_params(client: Any, run_id: str, params: Any, warned: set) -> None:
    """Log `params` flattened with '/', each value as its str(); skip (with a warning) values over MLflow's limit."""
    from mlflow.entities import Param

    items = []
    for key, value in flatten(params).items():
        text = str(scalar(value))
        if len(text) > MLFLOW_MAX_PARAM_LENGTH:
            warnings.warn(f"MLflow params hold up to {MLFLOW_MAX_PARAM_LENGTH} characters: {key!r} "
                          f"({len(text)}) is not logged.")
            continue
        items.append(Param(mlflow_key(key, warned), text))
    for start in range(0, len(items), MLFLOW_MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start:start + MLFLOW_MAX_PARAMS_PER_BATCH])


# -- trackers ------------------------------------------------------------------------------------------

class GeneralTracker:
    """A tracker: `store_init_configuration`, `log`, `finish`; `tracker` is the underlying object.

    `requires_logging_directory`: whether it needs `Accelerator(project_dir=...)`; `package`: the module it
    imports (None: nothing beyond fabric_lite), which `log_with="all"` checks for.
    """

    name = "general"
    requires_logging_directory = False
    main_process_only = True
    package: Optional[str] = None

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
    requires_logging_directory = True
    package = "tensorboard"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        require("tensorboard", "log_with='tensorboard'", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

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
            value = scalar(value)
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


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment named after the project (`init_trackers(project_name)`).

    Where it goes: `tracking_uri` (`init_kwargs={"mlflow": {"tracking_uri": "http://host:5000"}}`), else a URI
    already set (MLFLOW_TRACKING_URI or `mlflow.set_tracking_uri`), else a SQLite store in the logging
    directory (`project_dir/mlflow.db`, artifacts in `project_dir/mlartifacts`), else MLflow's default. As in
    Accelerate, MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID and MLFLOW_TAGS (JSON) win over the arguments.

    The run is MLflow's active run until `finish()`, so `mlflow.log_artifact(...)` in the training script goes
    to it; `tracker` is that `mlflow.ActiveRun`. The configuration is logged as params (nested dicts flattened
    with '/'); `log` logs numbers as metrics at `step` and warns about other values.
    """

    name = "mlflow"
    package = "mlflow"

    def __init__(self, experiment_name: str, logging_dir: Optional[Union[str, os.PathLike]] = None,
                 run_id: Optional[str] = None, tags: Optional[Union[Dict[str, Any], str]] = None,
                 nested_run: bool = False, run_name: Optional[str] = None, description: Optional[str] = None,
                 tracking_uri: Optional[str] = None, artifact_location: Optional[str] = None) -> None:
        mlflow = require("mlflow", "log_with='mlflow'", "mlflow")
        from mlflow import MlflowClient

        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name
        run_id = os.environ.get("MLFLOW_RUN_ID") or run_id
        tags = os.environ.get("MLFLOW_TAGS") or tags
        if isinstance(tags, str):
            tags = json.loads(tags)
        self._previous_uri: Optional[str] = None
        self._set_uri = False
        if tracking_uri is None and not _uri_is_set(mlflow) and logging_dir is not None:
            tracking_uri = mlflow_local_uri(logging_dir)
            if artifact_location is None:
                artifact_location = os.path.abspath(os.path.join(os.fspath(logging_dir), "mlartifacts"))
        if tracking_uri is not None:  # the fluent API (the active run) follows the global URI: set it for the run
            self._previous_uri = mlflow.get_tracking_uri() if _uri_is_set(mlflow) else None
            mlflow.set_tracking_uri(tracking_uri)
            self._set_uri = True
        self._warned: set = set()
        try:
            self.tracking_uri = mlflow.get_tracking_uri()
            self.client = MlflowClient(self.tracking_uri)
            experiment_id = None
            if run_id is None:
                experiment_id = mlflow_experiment_id(self.client, experiment_name, artifact_location, tags)
            self.active_run = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=run_name,
                                               nested=nested_run, tags=tags, description=description)
        except BaseException:
            self._restore_uri()
            raise
        self.run_id = self.active_run.info.run_id
        self.experiment_id = self.active_run.info.experiment_id

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        mlflow_log_params(self.client, self.run_id, values, self._warned)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        mlflow_log_metrics(self.client, self.run_id, values, step, self._warned)

    def log_artifact(self, local_path: Union[str, os.PathLike], artifact_path: Optional[str] = None) -> None:
        """Upload a file to the run's artifacts (under `artifact_path`)."""
        self.client.log_artifact(self.run_id, os.fspath(local_path), artifact_path)

    def log_artifacts(self, local_dir: Union[str, os.PathLike], artifact_path: Optional[str] = None) -> None:
        """Upload a folder's files to the run's artifacts (under `artifact_path`)."""
        self.client.log_artifacts(self.run_id, os.fspath(local_dir), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib (or plotly) figure as the artifact `artifact_file` ("plots/loss.png")."""
        if save_kwargs:
            self.client.log_figure(self.run_id, figure, artifact_file, save_kwargs=save_kwargs)
        else:
            self.client.log_figure(self.run_id, figure, artifact_file)

    def finish(self) -> None:
        import mlflow

        try:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run()
            else:  # no longer the active run (ended, or a nested one is on top): end this one only
                self.client.set_terminated(self.run_id)
        finally:
            self._restore_uri()

    def _restore_uri(self) -> None:
        if self._set_uri:
            import mlflow

            mlflow.set_tracking_uri(self._previous_uri)
            self._set_uri = False


def _uri_is_set(mlflow: Any) -> bool:
    """Whether a tracking URI was chosen (MLFLOW_TRACKING_URI or `mlflow.set_tracking_uri`)."""
    is_set = getattr(mlflow, "is_tracking_uri_set", None)
    return bool(is_set()) if is_set is not None else bool(os.environ.get("MLFLOW_TRACKING_URI"))


class WandBTracker(GeneralTracker):
    """A Weights & Biases run in the project named by `init_trackers(project_name)`.

    `init_kwargs={"wandb": {...}}` go to `wandb.init` (`name`, `entity`, `tags`, `mode="offline"`, ...); its
    files go under the logging directory (`dir=`) when there is one. Offline: WANDB_MODE=offline or
    `mode="offline"`. `tracker` is the `wandb` run.
    """

    name = "wandb"
    package = "wandb"

    def __init__(self, run_name: str, logging_dir: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> None:
        wandb = require("wandb", "log_with='wandb'", "wandb")
        if logging_dir is not None and kwargs.get("dir") is None:
            os.makedirs(logging_dir, exist_ok=True)
            kwargs["dir"] = os.fspath(logging_dir)
        self.run_name = run_name
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.run.config.update(config_for_file(values), allow_val_change=True)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log({key: scalar(value) for key, value in values.items()}, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class CSVTracker(GeneralTracker):
    """Rows of `step` plus the values logged at it in `logging_dir/run_name/metrics.csv`; the configuration in
    `hparams.yaml` beside it.

    The file is written as values come (a new column rewrites it with the wider header); one that is there
    already (a resumed run) is read first and added to.
    """

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike]) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.metrics_file = os.path.join(self.logging_dir, "metrics.csv")
        self.hparams_file = os.path.join(self.logging_dir, "hparams.yaml")
        self.columns: List[str] = ["step"]
        self.rows: List[Dict[str, Any]] = []
        if os.path.exists(self.metrics_file):
            with open(self.metrics_file, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        import yaml

        with open(self.hparams_file, "w") as f:
            yaml.safe_dump(config_for_file(values), f, sort_keys=False)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        row: Dict[str, Any] = {"step": "" if step is None else step}
        for key, value in flatten(values).items():
            value = scalar(value)
            if not (is_number(value) or isinstance(value, str)):
                raise ValueError(f"Cannot log {key!r}={value!r} to CSV: pass a number, a one-element tensor, "
                                 f"a string or a dict of them.")
            row[key] = value
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns += new
            self._write(self.rows, "w")
        else:
            self._write([row], "a")

    def _write(self, rows: List[Dict[str, Any]], mode: str) -> None:
        with open(self.metrics_file, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def finish(self) -> None:
        pass


KNOWN_TRACKERS = {cls.name: cls for cls in (TensorBoardTracker, MLflowTracker, WandBTracker, CSVTracker)}


def available_trackers() -> List[str]:
    """The names `log_with="all"` starts: every tracker whose package is installed."""
    return [name for name, cls in KNOWN_TRACKERS.items() if cls.package is None or is_installed(cls.package)]


def make_trackers(
    log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]],
    run_name: str, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]],
) -> List[GeneralTracker]:
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, GeneralTracker)) else list(log_with)
    if "all" in items:
        items = [i for i in items if i != "all"] + available_trackers()
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
            started[name] = cls(run_name, logging_dir, **init_kwargs.get(cls.name, {}))
            trackers.append(started[name])
    except BaseException:
        for tracker in started.values():  # those started here are not left open (an MLflow run, a wandb process)
            try:
                tracker.finish()
            except Exception:
                pass
        raise
    return trackers
