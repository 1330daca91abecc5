"""The MLflow tracker (`log_with="mlflow"`) and the MLflow helpers it shares with the Trainer's `MLFlowLogger`."""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from typing import Any, Dict, Mapping, Optional, Union

from fabric_lite.accelerator.tracker_base import GeneralTracker, flatten, is_number, require, scalar

__all__ = ["MLflowTracker", "mlflow_local_uri", "mlflow_experiment_id", "mlflow_key", "mlflow_log_metrics",
           "mlflow_log_params", "MLFLOW_MAX_METRICS_PER_BATCH", "MLFLOW_MAX_PARAMS_PER_BATCH",
           "MLFLOW_MAX_PARAM_LENGTH"]


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
