"""The MLflow backend: one run, reached through an `MlflowClient`, that metrics, params and artifacts go to.

A run is opened one of two ways: `start_active` makes it MLflow's active run (the fluent API in the user's
script logs to it; the raw door's tracker), `create` opens or resumes it through the client alone (the
Trainer's logger). Where it goes: a tracking URI when one is given or set, else a SQLite store in a local
folder (`folder/mlflow.db`, artifacts in `folder/mlartifacts`).
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from typing import Any, Dict, Mapping, Optional, Union

from fabric_lite.trackers.base import flatten, is_number, require, scalar

__all__ = ["MLflowBackend"]

PathLike = Union[str, "os.PathLike[str]"]


class MLflowBackend:
    """An MLflow run: `client`, `run_id`, `experiment_id`, `tracking_uri`; `active_run` when it was started as
    the active run."""

    # MLflow's limits: a batch takes up to 1000 metrics and 100 params; a param value up to 6000 characters.
    MAX_METRICS_PER_BATCH = 1000
    MAX_PARAMS_PER_BATCH = 100
    MAX_PARAM_LENGTH = 6000
    BAD_KEY = re.compile(r"[^\w/.\- :]")

    def __init__(self, client: Any, run_id: str, experiment_id: str, tracking_uri: str,
                 active_run: Any = None, previous_uri: Optional[str] = None, set_uri: bool = False) -> None:
        self.client, self.run_id, self.experiment_id = client, run_id, experiment_id
        self.tracking_uri, self.active_run = tracking_uri, active_run
        self.previous_uri, self.set_uri = previous_uri, set_uri
        self.warned: set = set()

    # -- opening ------------------------------------------------------------------------------------------

    @staticmethod
    def local_uri(directory: PathLike) -> str:
        """The tracking URI of a SQLite store in `directory` (mlflow.db)."""
        os.makedirs(directory, exist_ok=True)
        return "sqlite:///" + os.path.abspath(os.path.join(os.fspath(directory), "mlflow.db"))

    @staticmethod
    def experiment_id_of(client: Any, name: str, artifact_location: Optional[str] = None,
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

    @classmethod
    def create(cls, who: str, experiment_name: str, tracking_uri: Optional[str], save_dir: Optional[str],
               artifact_location: Optional[str] = None, tags: Optional[Dict[str, Any]] = None,
               run_name: Optional[str] = None, run_id: Optional[str] = None) -> "MLflowBackend":
        """A new run in `experiment_name` (or the run `run_id`, set RUNNING again), through a client only."""
        mlflow = require("mlflow", who, "mlflow")
        uri = tracking_uri
        if uri is None:
            if save_dir is None:
                raise ValueError(f"{who} needs a tracking_uri, MLFLOW_TRACKING_URI or a save_dir.")
            uri = cls.local_uri(save_dir)
            if artifact_location is None:
                artifact_location = os.path.abspath(os.path.join(save_dir, "mlartifacts"))
        client = mlflow.MlflowClient(uri)
        if run_id is None:
            experiment_id = cls.experiment_id_of(client, experiment_name, artifact_location)
            run_id = client.create_run(experiment_id, tags=tags or None, run_name=run_name).info.run_id
        else:
            run = client.get_run(run_id)
            experiment_id = run.info.experiment_id
            if run.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
        return cls(client, run_id, experiment_id, uri)

    @classmethod
    def start_active(cls, who: str, experiment_name: str, logging_dir: Optional[PathLike] = None,
                     run_id: Optional[str] = None, tags: Optional[Union[Dict[str, Any], str]] = None,
                     nested_run: bool = False, run_name: Optional[str] = None, description: Optional[str] = None,
                     tracking_uri: Optional[str] = None, artifact_location: Optional[str] = None) -> "MLflowBackend":
        """A run started as MLflow's active run. MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID and MLFLOW_TAGS (JSON) win
        over the arguments. The global tracking URI is set for the run when it is chosen here, and put back by
        `finish`."""
        mlflow = require("mlflow", who, "mlflow")
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name
        run_id = os.environ.get("MLFLOW_RUN_ID") or run_id
        given_tags = os.environ.get("MLFLOW_TAGS") or tags
        tags_dict = json.loads(given_tags) if isinstance(given_tags, str) else given_tags
        previous_uri, set_uri = None, False
        if tracking_uri is None and not _uri_is_set(mlflow) and logging_dir is not None:
            tracking_uri = cls.local_uri(logging_dir)
            if artifact_location is None:
                artifact_location = os.path.abspath(os.path.join(os.fspath(logging_dir), "mlartifacts"))
        if tracking_uri is not None:  # the fluent API (the active run) follows the global URI: set it for the run
            previous_uri = mlflow.get_tracking_uri() if _uri_is_set(mlflow) else None
            mlflow.set_tracking_uri(tracking_uri)
            set_uri = True
        try:
            uri = mlflow.get_tracking_uri()
            client = mlflow.MlflowClient(uri)
            experiment_id = None
            if run_id is None:
                experiment_id = cls.experiment_id_of(client, experiment_name, artifact_location, tags_dict)
            active = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=run_name,
                                      nested=nested_run, tags=tags_dict, description=description)
        except BaseException:
            if set_uri:
                mlflow.set_tracking_uri(previous_uri)
            raise
        return cls(client, active.info.run_id, active.info.experiment_id, uri, active, previous_uri, set_uri)

    # -- logging ------------------------------------------------------------------------------------------

    def key(self, key: str) -> str:
        """`key` with the characters MLflow refuses in names replaced by '_' (once warned about)."""
        clean = self.BAD_KEY.sub("_", key)
        if clean != key and key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"MLflow names allow letters, digits and '_-./ :'; {key!r} is logged as {clean!r}.")
        return clean

    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """The numbers of `metrics` (nested dicts flattened with '/') at `step`; others are warned about, skipped."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        items = []
        for key, value in flatten(metrics).items():
            value = scalar(value)
            if not is_number(value):
                if key not in self.warned:
                    self.warned.add(key)
                    warnings.warn(f"MLflow logs numbers: {key}={value!r} is not logged (log_params takes other "
                                  f"values).")
                continue
            items.append(Metric(self.key(key), float(value), timestamp, int(step or 0)))
        for start in range(0, len(items), self.MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[start:start + self.MAX_METRICS_PER_BATCH])

    def log_config(self, params: Any) -> None:
        """`params` flattened with '/', each value as its str(); values over MLflow's limit are skipped (warned)."""
        from mlflow.entities import Param

        items = []
        for key, value in flatten(params).items():
            text = str(scalar(value))
            if len(text) > self.MAX_PARAM_LENGTH:
                warnings.warn(f"MLflow params hold up to {self.MAX_PARAM_LENGTH} characters: {key!r} "
                              f"({len(text)}) is not logged.")
                continue
            items.append(Param(self.key(key), text))
        for start in range(0, len(items), self.MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + self.MAX_PARAMS_PER_BATCH])

    def log_artifact(self, local_path: PathLike, artifact_path: Optional[str] = None) -> None:
        self.client.log_artifact(self.run_id, os.fspath(local_path), artifact_path)

    def log_artifacts(self, local_dir: PathLike, artifact_path: Optional[str] = None) -> None:
        self.client.log_artifacts(self.run_id, os.fspath(local_dir), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        if save_kwargs:
            self.client.log_figure(self.run_id, figure, artifact_file, save_kwargs=save_kwargs)
        else:
            self.client.log_figure(self.run_id, figure, artifact_file)

    # -- ending -------------------------------------------------------------------------------------------

    def reopen(self) -> None:
        """Set the run RUNNING again (a second fit goes on in it)."""
        self.client.update_run(self.run_id, status="RUNNING")

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with `status`: as the active run when it is still the active one, else through the
        client; the global tracking URI goes back to what it was."""
        try:
            if self.active_run is None:
                self.client.set_terminated(self.run_id, status)
                return
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run(status)
            else:  # no longer the active run (ended, or a nested one is on top): end this one only
                self.client.set_terminated(self.run_id, status)
        finally:
            if self.set_uri:
                import mlflow

                mlflow.set_tracking_uri(self.previous_uri)  # type: ignore[arg-type]  # (None: unset again)
                self.set_uri = False


def _uri_is_set(mlflow: Any) -> bool:
    """Whether a tracking URI was chosen (MLFLOW_TRACKING_URI or `mlflow.set_tracking_uri`)."""
    is_set = getattr(mlflow, "is_tracking_uri_set", None)
    return bool(is_set()) if is_set is not None else bool(os.environ.get("MLFLOW_TRACKING_URI"))
