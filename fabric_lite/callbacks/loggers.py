"""Loggers are callbacks (rank 0 only): TensorBoardLogger writes event files, CSVLogger a metrics.csv,
MLFlowLogger an MLflow run, WandbLogger a Weights & Biases run. All are `Logger`s, which `Trainer(logger=...)`
takes. Each is a thin adapter over its service's backend in `fabric_lite.trackers` (the raw door's `log_with`
trackers use the same ones): it keeps Lightning's arguments and decides when, and on which process, to write.

mlflow and wandb are extras (`pip install 'fabric-lite[mlflow]'`), imported when the logger starts its run.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union

from fabric_lite.callbacks.base import Callback
from fabric_lite.trackers.local import CSVBackend, TensorBoardBackend
from fabric_lite.trackers.mlflow_run import MLflowBackend
from fabric_lite.trackers.services import WandbBackend

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "MLFlowLogger", "WandbLogger"]


class Logger(Callback):
    """The base of the loggers: the Trainer sends it metrics (`on_log`) and the module's hyperparameters
    (`on_hyperparameters`, once a fit), and on the main process it writes them with `log_metrics` and
    `log_hyperparams`. As in Lightning, `experiment` is the underlying object (a SummaryWriter, an MLflow client, a
    wandb run), and `name`, `version` and `save_dir` say where the run is.
    """

    name: Optional[str] = None
    version: Any = None
    save_dir: Optional[str] = None

    @property
    def experiment(self) -> Any:
        return None

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        """Write `metrics` (names to floats) at `step`."""

    def log_hyperparams(self, params: Any) -> None:
        """Write the hyperparameters (a dict, nested dicts allowed, or an argparse.Namespace)."""

    def finalize(self, status: str) -> None:
        """The run is over: `status` is "success", "failed" or "killed"."""

    def on_log(self, trainer: "Trainer", metrics: Dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            self.log_metrics(metrics, step)

    def on_hyperparameters(self, trainer: "Trainer", params: Dict[str, Any]) -> None:
        if trainer.is_global_zero and params:
            self.log_hyperparams(params)


def version_dir(root: str, name: str, version: Optional[int]) -> str:
    from fabric_lite.checkpoint import files as checkpoint_io

    base = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
    if version is None:
        fs, path = checkpoint_io.filesystem(base)
        existing = []
        if fs.exists(path):
            for entry in fs.ls(path, detail=False):
                tail = entry.rstrip("/").rsplit("/", 1)[-1]
                if tail.startswith("version_") and tail[8:].isdigit():
                    existing.append(int(tail[8:]))
        version = max(existing) + 1 if existing else 0
    return f"{base}/version_{version}"


class VersionedLogger(Logger):
    """A logger writing under save_dir/name/version_N, N chosen by rank 0 (the next free one)."""

    save_dir: str
    name: str

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None) -> None:
        self.save_dir, self.name, self.version = os.fspath(save_dir), name, version
        self.log_dir: Optional[str] = None

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self.log_dir is None:
            version = self.version
            if version is None and trainer.is_global_zero:
                version = int(version_dir(self.save_dir, self.name, None).rsplit("_", 1)[-1])
            self.log_dir = version_dir(self.save_dir, self.name, trainer.strategy.collectives.broadcast_object(version))


class TensorBoardLogger(VersionedLogger):
    """Scalars at every `log_every_n_steps` and epoch end, hyperparameters as text, under save_dir/name/version_N.

    With `log_graph=True`, the module's graph is traced once at fit start from `module.example_input_array`.
    """

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None, log_graph: bool = False,
                 **writer_kwargs: Any):
        super().__init__(save_dir, name, version)
        self.log_graph = log_graph
        self.writer_kwargs = writer_kwargs
        self.backend: Optional[TensorBoardBackend] = None
        self._graph_logged = False
        self._warned_no_example = False

    def open(self) -> TensorBoardBackend:
        """The backend, in `log_dir`."""
        if self.backend is None:
            self.backend = TensorBoardBackend(self.log_dir, "TensorBoardLogger", **self.writer_kwargs)
        return self.backend

    @property
    def writer(self) -> Any:
        """The SummaryWriter, opened on first use."""
        return self.open().writer

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.log_graph and trainer.is_global_zero and not self._graph_logged:
            self._add_graph(trainer, module)

    def _add_graph(self, trainer: "Trainer", module: "TrainModule") -> None:
        """Trace `module` on its example input, leaving its modes, gradients and the RNG streams as they were."""
        import torch

        example = getattr(module, "example_input_array", None)
        if example is None:
            if not self._warned_no_example:
                self._warned_no_example = True
                warnings.warn(
                    f"TensorBoardLogger(log_graph=True) has no input to trace {type(module).__name__} with; set "
                    f"`self.example_input_array` (a tensor or a tuple of tensors) in its __init__. No graph is "
                    f"written."
                )
            return
        if isinstance(example, torch.Tensor):
            args: Any = (example,)
        elif isinstance(example, (tuple, list)) and example and all(isinstance(t, torch.Tensor) for t in example):
            args = tuple(example)
        else:
            raise TypeError(
                f"{type(module).__name__}.example_input_array must be a tensor or a tuple of tensors to log the "
                f"graph, got {type(example).__name__}."
            )
        device = module.device
        args = trainer.strategy.precision.convert_input(tuple(t.to(device) for t in args))
        modes = [(m, m.training) for m in module.modules()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"`torch\.jit\.trace", category=DeprecationWarning)
                self.writer.add_graph(module, args)
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            for m, training in modes:
                m.training = training
        self.writer.flush()
        self._graph_logged = True

    @property
    def experiment(self) -> Any:
        return self.writer

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self.open().log(metrics, step)

    def log_hyperparams(self, params: Any) -> None:
        if params:
            self.open().log_config("hparams", params)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.backend is not None:
            self.backend.flush()

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self.backend is not None:
            self.backend.close()


class CSVLogger(VersionedLogger):
    """Rows of `step` plus every metric logged at that step, in save_dir/name/version_N/metrics.csv (columns:
    `step`, then the names sorted), written at each epoch end and at the end of the run."""

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None):
        super().__init__(save_dir, name, version)
        self.backend = CSVBackend(None, sort_columns=True)

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self.backend.rows

    @property
    def experiment(self) -> Any:
        return self

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self.backend.log(metrics, step, strict=False)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._write(trainer)

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        self._write(trainer)

    def _write(self, trainer: "Trainer") -> None:
        if trainer.is_global_zero and self.backend.rows:
            self.backend.directory = self.log_dir
            self.backend.write_all()


class _NoOpExperiment:
    """What `experiment` is on the other processes: every attribute and call does nothing."""

    def __getattr__(self, name: str) -> "_NoOpExperiment":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_NoOpExperiment":
        return self

    def __getitem__(self, key: Any) -> "_NoOpExperiment":
        return self


def _main_process_by_environment() -> bool:
    return int(os.environ.get("RANK", "0") or 0) == 0


def _status_of(exception: BaseException) -> str:
    return "killed" if isinstance(exception, KeyboardInterrupt) else "failed"


class _RunLogger(Logger):
    """A logger whose run starts on first use (main process only) and ends with the fit: finalize("success") at
    teardown, "failed" (or "killed", on KeyboardInterrupt) when the fit raises."""

    def __init__(self) -> None:
        self._main_process = _main_process_by_environment()
        self._finalized = False

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        self._main_process = trainer.is_global_zero
        self._finalized = False

    def on_exception(self, trainer: "Trainer", module: "TrainModule", exception: BaseException) -> None:
        if trainer.is_global_zero and not self._finalized:
            self.finalize(_status_of(exception))

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if trainer.is_global_zero and not self._finalized:
            self.finalize("success")


def _with_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> Dict[str, Any]:
    return {f"{prefix}{separator}{k}" if prefix else k: v for k, v in metrics.items()}


class MLFlowLogger(_RunLogger):
    """Log to an MLflow run (Lightning's arguments): metrics at the Trainer's step, the module's hyperparameters as
    params (nested dicts flattened with '/'), the run FINISHED at the end of fit (FAILED if it raised).

    Where: `tracking_uri` (e.g. "http://127.0.0.1:5000"), else MLFLOW_TRACKING_URI, else a SQLite store in
    `save_dir` (`save_dir/mlflow.db`, artifacts in `save_dir/mlartifacts`; MLflow no longer opens a plain
    `./mlruns` folder by default). `run_id` goes on logging to an existing run. `experiment` is the
    `mlflow.MlflowClient`; `name` is the experiment id and `version` the run id, as in Lightning.
    """

    def __init__(self, experiment_name: str = "lightning_logs", run_name: Optional[str] = None,
                 tracking_uri: Optional[str] = None, tags: Optional[Dict[str, Any]] = None,
                 save_dir: Optional[Union[str, os.PathLike]] = "./mlruns", prefix: str = "",
                 artifact_location: Optional[str] = None, run_id: Optional[str] = None) -> None:
        super().__init__()
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._tags = dict(tags or {})
        self._save_dir = os.fspath(save_dir) if save_dir is not None else None
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self.backend: Optional[MLflowBackend] = None

    @property
    def experiment(self) -> Any:
        """The `mlflow.MlflowClient` (on other processes than the main one, an object that does nothing)."""
        if not self._main_process:
            return _NoOpExperiment()
        return self.open().client

    def open(self) -> MLflowBackend:
        """The backend, its run started (or resumed) on first use."""
        if self.backend is None:
            self.backend = MLflowBackend.create(
                "MLFlowLogger", self._experiment_name, self._tracking_uri, self._save_dir, self._artifact_location,
                self._tags, self._run_name, self._run_id)
        return self.backend

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        reopen = self._finalized and self.backend is not None
        super().setup(trainer, module, stage)
        if reopen and self._main_process:  # a second fit goes on in the same run
            self.open().reopen()

    @property
    def tracking_uri(self) -> Optional[str]:
        """The URI the run is logged to (known once it has started, or when one was given)."""
        return self.backend.tracking_uri if self.backend is not None else self._tracking_uri

    @property
    def run_id(self) -> Optional[str]:
        _ = self.experiment
        return self.backend.run_id if self.backend is not None else self._run_id

    @property
    def experiment_id(self) -> Optional[str]:
        _ = self.experiment
        return self.backend.experiment_id if self.backend is not None else None

    @property
    def name(self) -> Optional[str]:  # type: ignore[override]
        return self.experiment_id

    @property
    def version(self) -> Optional[str]:  # type: ignore[override]
        return self.run_id

    @property
    def save_dir(self) -> Optional[str]:  # type: ignore[override]
        """The local folder of the run's store (None when it is a server or another URI)."""
        return self._save_dir if self._tracking_uri is None else None

    def log_hyperparams(self, params: Any) -> None:
        if self._main_process:
            self.open().log_config(params)

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        if self._main_process:
            self.open().log(_with_prefix(metrics, self._prefix, "-"), step)

    def finalize(self, status: str = "success") -> None:
        self._finalized = True
        if self.backend is None or not self._main_process:
            return
        state = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
        self.backend.finish(state.get(status, "FINISHED"))


class WandbLogger(_RunLogger):
    """Log to a Weights & Biases run (Lightning's arguments): metrics with their step as `trainer/global_step`,
    the module's hyperparameters as the run's config, the run finished at the end of fit (exit code 1 if it
    raised).

    `offline=True` keeps the run on disk (`wandb sync` uploads it later); its files go under `save_dir` (or
    `dir`)/wandb. `version`/`id` resume a run; other keyword arguments go to `wandb.init` (entity, tags, group,
    ...). `experiment` is the wandb run (started on first use; one that is passed in is used as it is).
    """

    def __init__(self, name: Optional[str] = None, save_dir: Union[str, os.PathLike] = ".",
                 version: Optional[str] = None, offline: bool = False, dir: Optional[Union[str, os.PathLike]] = None,
                 id: Optional[str] = None, project: Optional[str] = None, prefix: str = "",
                 experiment: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self._project = project or os.environ.get("WANDB_PROJECT") or "lightning_logs"
        self._save_dir = os.fspath(dir if dir is not None and save_dir == "." else save_dir)
        self._offline = offline
        self._prefix = prefix
        self._id = version or id
        self._init_kwargs: Dict[str, Any] = {"name": name, "project": self._project, "dir": self._save_dir, **kwargs}
        if offline:
            self._init_kwargs["mode"] = "offline"
        self.backend: Optional[WandbBackend] = None
        if experiment is not None:
            self.backend, self._id = WandbBackend("WandbLogger", run=experiment), experiment.id

    @property
    def experiment(self) -> Any:
        """The wandb run (on other processes than the main one, an object that does nothing)."""
        if not self._main_process:
            return _NoOpExperiment()
        return self.open().run

    def open(self) -> WandbBackend:
        """The backend, its run started (or resumed) on first use."""
        if self.backend is None:
            kwargs = dict(self._init_kwargs)
            if self._id is not None:  # the same run again (a second fit, or `version=`)
                kwargs.setdefault("id", self._id)
                kwargs.setdefault("resume", "allow")
            self.backend = WandbBackend("WandbLogger", **kwargs)
            self.backend.run.define_metric("trainer/global_step")
            self.backend.run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
            self._id = self.backend.run.id
        return self.backend

    @property
    def name(self) -> Optional[str]:  # type: ignore[override]
        """The project, as in Lightning."""
        return self._project

    @property
    def version(self) -> Optional[str]:  # type: ignore[override]
        """The run id (once the run has started, or when one was given)."""
        return self.backend.run.id if self.backend is not None else self._id

    @property
    def save_dir(self) -> Optional[str]:  # type: ignore[override]
        return self._save_dir

    def log_hyperparams(self, params: Any) -> None:
        if self._main_process:
            self.open().log_config(params)

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        if not self._main_process:
            return
        values: Dict[str, Any] = _with_prefix(metrics, self._prefix, "-")
        if step is not None:
            values["trainer/global_step"] = step
        self.open().log(values)

    def finalize(self, status: str = "success") -> None:
        self._finalized = True
        if self.backend is None or not self._main_process:
            return
        backend, self.backend = self.backend, None  # used again (another fit), it resumes this run
        backend.finish(exit_code=0 if status == "success" else 1)
