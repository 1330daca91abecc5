"""fabric_lite under Ray: report metrics and committed checkpoints to Ray Train / Ray Tune, resume from Ray's.

Both doors already run inside Ray Train's ``TorchTrainer(train_fn)``: the launch environment says "Ray Train,
N workers" and the process group and device Ray set up are used as they are. What this module adds is what
makes Ray's own machinery see a fabric_lite run:

- `RayReportCallback` (Trainer): at the end of every training epoch (or validation) every worker reports the
  logged metrics, and with them the newest fabric_lite checkpoint published since the last report, so Ray's
  `Result`, checkpoint retention, failure handling and Tune's schedulers (ASHA, early stopping) work.
- `report` (raw door): the same for a hand-written loop after ``accelerator.save_state(dir)``.
- `get_checkpoint`: the location of the checkpoint Ray hands a restarted (or resumed) run, for
  ``accelerator.load_state``; ``Trainer.fit(ckpt_path="last")`` takes it by itself.

``ray`` is an extra (``pip install 'fabric-lite[ray]'``), imported only when one of these is called.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from fabric_lite.callbacks.base import Callback
from fabric_lite.strategies.environments import ProcessInfo, read_launch_environment

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["RayReportCallback", "report", "get_checkpoint", "resume_checkpoint", "UPLOAD_MODES"]

UPLOAD_MODES = ("sync", "async")
_REPORT_ON = ("epoch", "validation")


def _import_ray() -> Any:
    try:
        import ray
        import ray.train  # noqa: F401  (the submodule the reports go through)
    except ImportError as err:
        raise ImportError(f"fabric_lite.ray needs Ray Train ({err}): pip install 'fabric-lite[ray]'.") from None
    return ray


def _api(process: ProcessInfo) -> Any:
    """`ray.train` inside Ray Train's workers, `ray.tune` in a Tune trial (one process); an error elsewhere.
    `process`: this process's place, as the door read it (or the launch environment, with no door)."""
    if process.engine == "ray_train":
        return _import_ray().train
    if process.engine == "ray":
        ray = _import_ray()
        import ray.tune

        return ray.tune
    raise RuntimeError(
        f"fabric_lite.ray reports to Ray, but this process was not started by Ray ({process.source}). Run the "
        f"training function in Ray Train's TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=N)) or "
        f"in a Ray Tune trial, or leave the Ray report out.")


def _as_ray_checkpoint(api: Any, url: str) -> Any:
    """A Checkpoint of `api` (`ray.train`'s or `ray.tune`'s) for a published fabric_lite checkpoint: a local
    directory or an fsspec URL that pyarrow also reaches (s3://, gs://, hdfs://)."""
    if "://" not in url or url.startswith("file://"):
        return api.Checkpoint.from_directory(os.path.abspath(url.removeprefix("file://")))
    import pyarrow.fs

    filesystem, path = pyarrow.fs.FileSystem.from_uri(url)
    return api.Checkpoint(path=path, filesystem=filesystem)


def _send(api: Any, metrics: Mapping[str, Any], url: Optional[str], upload: str, is_main: bool) -> None:
    values = {key: (value.item() if hasattr(value, "item") else value) for key, value in metrics.items()}
    checkpoint = _as_ray_checkpoint(api, url) if (url is not None and is_main) else None
    if api.__name__ == "ray.train":
        # Every worker reports (a barrier in Ray Train); only the main process attaches the checkpoint, which
        # holds every process's files (sharded checkpoints are written into one directory).
        if upload == "async":  # Ray copies it in the background; the Trainer's files stay where they are
            api.report(values, checkpoint=checkpoint, checkpoint_upload_mode=api.CheckpointUploadMode.ASYNC,
                       delete_local_checkpoint_after_upload=False)
        else:
            api.report(values, checkpoint=checkpoint)
    else:
        api.report(values, checkpoint=checkpoint)


def _check_upload(where: str, upload: str) -> None:
    if upload not in UPLOAD_MODES:
        raise ValueError(f"{where}(upload={upload!r}): allowed values are {', '.join(map(repr, UPLOAD_MODES))} "
                         f"('sync': the report returns once Ray has copied the checkpoint to its storage).")


def report(accelerator: "Accelerator", metrics: Mapping[str, Any], checkpoint: Optional[str] = None,
           upload: str = "sync") -> None:
    """Report `metrics` (and `checkpoint`, a directory `accelerator.save_state` wrote) to Ray. Every process calls
    it, the same number of times; a checkpoint still being written in the background is waited for first.

    Examples:
        >>> path = accelerator.save_state(f"ckpt/epoch_{epoch}", blocking=False)    # doctest: +SKIP
        >>> fabric_lite.ray.report(accelerator, {"loss": loss}, checkpoint=path)    # doctest: +SKIP
    """
    _check_upload("report", upload)
    api = _api(accelerator.run_config.process)
    if checkpoint is not None:
        accelerator.wait_for_checkpoint()  # published (or its failure raised) before Ray copies it
        checkpoint = os.fspath(checkpoint)
    _send(api, metrics, checkpoint, upload, accelerator.is_main_process)


def get_checkpoint() -> Optional[str]:
    """Where the checkpoint Ray hands this run lies (a local directory or a URL), or None: none yet, or not under
    Ray. Ray gives a restarted worker group, and a new driver pointed at the same storage path and run name, the
    newest checkpoint reported. Remote storage pyarrow reaches but fsspec may not is copied to a local temporary
    directory first."""
    return _checkpoint(read_launch_environment().process)  # (with no door: a Ray driver, a script's own code)


def _checkpoint(process: ProcessInfo) -> Optional[str]:
    if not process.started_by_ray:
        return None
    api = _api(process)
    checkpoint = api.get_checkpoint()
    if checkpoint is None:
        return None
    import pyarrow.fs

    filesystem = checkpoint.filesystem
    if filesystem is None or isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return checkpoint.path
    scheme = {"S3FileSystem": "s3", "GcsFileSystem": "gs"}.get(type(filesystem).__name__)
    if scheme is not None:
        return f"{scheme}://{checkpoint.path}"
    local = tempfile.mkdtemp(prefix="fabric_lite_ray_checkpoint_")
    return checkpoint.to_directory(local)


def resume_checkpoint(trainer: "Trainer", ckpt_path: Optional[str]) -> Optional[str]:
    """What `Trainer.fit` under Ray resumes from (its observer of `fit_start`, wired in `fabric_lite.integrations`):
    the checkpoint Ray hands this run (a restarted worker group, a new driver on the same storage and run name) for
    "last"; for None too when it is a fabric_lite checkpoint (one RayReportCallback reported), so a run Ray restarts
    resumes by itself, as under torch elastic."""
    found = _checkpoint(trainer.accelerator.run_config.process)
    if found is None:
        return ckpt_path
    if ckpt_path is None:
        from fabric_lite.checkpoint import files as checkpoint_io

        try:
            checkpoint_io.read_manifest(found)
        except checkpoint_io.CheckpointError:
            return None  # the script's own kind of checkpoint: its business
    if trainer.is_global_zero:
        print(f"fabric_lite: resuming from the checkpoint Ray handed this run: {found}", file=sys.stderr, flush=True)
    return found


class RayReportCallback(Callback):
    """Report a Trainer's run to Ray Train (in `TorchTrainer`'s workers) or Ray Tune (in a trial).

    At the end of every training epoch (``report_on="epoch"``) or every validation run (``"validation"``) each
    process reports the logged metrics (``trainer.callback_metrics``, plus ``epoch`` and ``step``), and with them the
    newest checkpoint the Trainer published since the last report (ModelCheckpoint's; a save still being written
    in the background is waited for). After the last epoch, a checkpoint saved since the last report is reported
    too. It runs after the other callbacks at each hook, so a checkpoint saved at the same epoch end goes with
    that epoch's metrics. Resume: ``trainer.fit(module, ckpt_path="last")`` takes Ray's checkpoint.

    Examples:
        >>> trainer = Trainer(max_epochs=5, callbacks=[RayReportCallback()])    # doctest: +SKIP
    """

    runs_last = True

    def __init__(self, report_on: str = "epoch", upload: str = "sync") -> None:
        if report_on not in _REPORT_ON:
            raise ValueError(f"RayReportCallback(report_on={report_on!r}): allowed values are "
                             f"{', '.join(map(repr, _REPORT_ON))}.")
        _check_upload("RayReportCallback", upload)
        self.report_on = report_on
        self.upload = upload
        self._reported_saves = 0
        self._api: Any = None
        #: How many reports this process made (every process makes the same number).
        self.reports = 0

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if stage == "fit":
            self._api = _api(trainer.accelerator.run_config.process)  # not under Ray: a clear error before training starts
            self._reported_saves = len(trainer.accelerator.checkpoint_saver.history)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.report_on == "epoch":
            self._report(trainer)

    def on_validation_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.report_on == "validation" and not trainer.sanity_checking:
            self._report(trainer)

    def on_train_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._unreported(trainer):
            self._report(trainer)

    def _unreported(self, trainer: "Trainer") -> bool:
        return len(trainer.accelerator.checkpoint_saver.history) > self._reported_saves

    def _report(self, trainer: "Trainer") -> None:
        url = None
        if self._unreported(trainer):
            trainer.accelerator.wait_for_checkpoint()  # every process: the newest save is published
            history = trainer.accelerator.checkpoint_saver.history
            fresh = [record for record in history[self._reported_saves:] if record.error is None]
            self._reported_saves = len(history)
            url = fresh[-1].url if fresh else None
        metrics: Dict[str, Any] = {key: value for key, value in trainer.callback_metrics.items()}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        _send(self._api, metrics, url, self.upload, trainer.is_global_zero)
        self.reports += 1
