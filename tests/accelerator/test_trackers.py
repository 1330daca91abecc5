"""The raw door's trackers, for real: `Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv"])` against an
MLflow tracking server on 127.0.0.1 (SQLite store, tests/tracker_servers.py) and wandb in offline mode, each run
read back with the tool's own reader (MlflowClient, wandb's records, TensorBoard's EventAccumulator, csv)."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap

import pytest
import torch

from fabric_lite import Accelerator
from fabric_lite.accelerator.tracking import CSVTracker, available_trackers, make_trackers
from tracker_servers import read_wandb_run, wandb_run_dir


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


LOSSES = [1.0, 0.5, 0.25]


def test_four_trackers_record_the_same_run(mlflow_server, offline_wandb, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project_dir = tmp_path / "project"
    acc = Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv"], project_dir=project_dir)
    acc.init_trackers("proj", config={"lr": 0.1, "nested": {"a": 1}},
                      init_kwargs={"mlflow": {"tracking_uri": mlflow_server, "run_name": "raw-door"},
                                   "wandb": {"name": "raw-door"}})
    assert [t.name for t in acc.trackers] == ["tensorboard", "mlflow", "wandb", "csv"]
    for step, loss in enumerate(LOSSES):
        acc.log({"loss": torch.tensor(loss), "acc": 0.5 * step}, step=step)
    (tmp_path / "notes.txt").write_text("a note")
    acc.get_tracker("mlflow").log_artifact(tmp_path / "notes.txt", "notes")
    active_run = acc.get_tracker("mlflow", unwrap=True)
    assert mlflow.active_run().info.run_id == active_run.info.run_id  # fluent calls in the script go to it
    wandb_id = acc.get_tracker("wandb", unwrap=True).id
    acc.end_training()
    assert mlflow.active_run() is None and not mlflow.is_tracking_uri_set()  # the global URI is as it was

    # MLflow, through the server
    client = mlflow.MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("proj")
    run = client.get_run(active_run.info.run_id)
    assert run.info.experiment_id == experiment.experiment_id and run.info.run_name == "raw-door"
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "nested/a": "1"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "acc")] == [0, 1, 2]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "notes")] == ["notes/notes.txt"]
    downloaded = client.download_artifacts(run.info.run_id, "notes/notes.txt", str(tmp_path))
    assert open(downloaded).read() == "a note"
    assert not (project_dir / "mlflow.db").exists()  # the server was named: no local store

    # wandb, offline under project_dir/wandb
    recorded = read_wandb_run(wandb_run_dir(project_dir, wandb_id))
    assert recorded["project"] == "proj" and recorded["name"] == "raw-door"
    assert recorded["config"] == {"lr": 0.1, "nested": {"a": 1}}
    assert [(row["_step"], row["loss"]) for row in recorded["history"]] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert recorded["summary"]["acc"] == 1.0 and recorded["exit_code"] == 0

    # TensorBoard and CSV, in project_dir/proj
    scalars = _scalars(project_dir / "proj")
    assert scalars["loss"] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    with open(project_dir / "proj" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["loss"]), float(r["acc"])) for r in rows] == [(0, 1.0, 0.0), (1, 0.5, 0.5),
                                                                                   (2, 0.25, 1.0)]
    assert (project_dir / "proj" / "hparams.yaml").read_text() == "lr: 0.1\nnested:\n  a: 1\n"


def test_mlflow_without_a_uri_keeps_its_store_in_the_project_dir(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    acc = Accelerator(log_with="mlflow", project_dir=tmp_path)
    acc.init_trackers("local", config={"batch": 8})
    acc.log({"loss": 2.0}, step=5)
    run_id = acc.get_tracker("mlflow").run_id
    acc.end_training()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.params == {"batch": "8"} and run.data.metrics == {"loss": 2.0}
    assert client.get_experiment(run.info.experiment_id).name == "local"
    assert client.get_experiment(run.info.experiment_id).artifact_location.endswith("mlartifacts")
    assert not mlflow.is_tracking_uri_set()


def test_csv_tracker_widens_its_header_and_goes_on_after_a_restart(tmp_path):
    tracker = CSVTracker("run", tmp_path)
    tracker.log({"loss": 1.0}, step=0)
    tracker.log({"loss": 0.5, "val": {"acc": torch.tensor(0.75)}}, step=1)
    tracker.finish()
    again = CSVTracker("run", tmp_path)  # a resumed run adds to the file
    again.log({"loss": 0.25}, step=2)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"step": "0", "loss": "1.0", "val/acc": ""}, {"step": "1", "loss": "0.5", "val/acc": "0.75"},
                    {"step": "2", "loss": "0.25", "val/acc": ""}]
    with pytest.raises(ValueError, match="bad"):
        again.log({"bad": [1, 2]}, step=3)


def test_all_names_every_installed_tracker_and_each_starts_once(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from fabric_lite.accelerator.tracking import KNOWN_TRACKERS, is_installed

    assert available_trackers()[:4] == ["tensorboard", "mlflow", "wandb", "csv"]
    optional = {"comet_ml": "comet_ml", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
                "trackio": "trackio"}
    assert available_trackers()[4:] == [name for name, module in optional.items() if is_installed(module)]
    assert list(KNOWN_TRACKERS)[4:] == list(optional)
    trackers = make_trackers(["csv", "CSV", "tensorboard"], "run", str(tmp_path), {})
    assert [t.name for t in trackers] == ["csv", "tensorboard"]
    for tracker in trackers:
        tracker.finish()
    with pytest.raises(ValueError, match="project_dir"):
        make_trackers("csv", "run", None, {})


def test_missing_packages_are_named_with_what_to_install(tmp_path):
    """Without mlflow, wandb and the other trackers' packages (their import blocked), importing fabric_lite does not import them, `log_with`
    names what to install in one line, and "all" starts the trackers that are there."""
    script = textwrap.dedent(f"""
        import sys
        import fabric_lite, fabric_lite.accelerator.tracking, fabric_lite.callbacks
        print("imported:", sorted(m for m in ("mlflow", "wandb", "comet_ml", "aim", "clearml", "dvclive", "swanlab",
                                              "trackio") if m in sys.modules))
        for name in ("mlflow", "wandb", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"):
            sys.modules[name] = None
        from fabric_lite import Accelerator
        from fabric_lite.callbacks import MLFlowLogger, WandbLogger
        for name in ("mlflow", "wandb", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"):
            try:
                Accelerator(log_with=name, project_dir={str(tmp_path)!r}).init_trackers("p")
            except ModuleNotFoundError as err:
                print("error:", err, "| chained:", err.__cause__ is not None)
        for logger in (MLFlowLogger(save_dir={str(tmp_path)!r}), WandbLogger(save_dir={str(tmp_path)!r})):
            try:
                logger.experiment
            except ModuleNotFoundError as err:
                print("error:", err)
        acc = Accelerator(log_with="all", project_dir={str(tmp_path)!r})
        acc.init_trackers("p")
        print("all:", [t.name for t in acc.trackers])
        acc.end_training()
        Accelerator(log_with="mlflow", project_dir={str(tmp_path)!r}).init_trackers("p")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert lines == [
        "imported: []",
        "error: log_with='mlflow' needs mlflow: pip install 'fabric-lite[mlflow]' | chained: False",
        "error: log_with='wandb' needs wandb: pip install 'fabric-lite[wandb]' | chained: False",
        "error: log_with='comet_ml' needs comet_ml: pip install 'fabric-lite[comet]' | chained: False",
        "error: log_with='aim' needs aim: pip install 'fabric-lite[aim]' | chained: False",
        "error: log_with='clearml' needs clearml: pip install 'fabric-lite[clearml]' | chained: False",
        "error: log_with='dvclive' needs dvclive: pip install 'fabric-lite[dvclive]' | chained: False",
        "error: log_with='swanlab' needs swanlab: pip install 'fabric-lite[swanlab]' | chained: False",
        "error: log_with='trackio' needs trackio: pip install 'fabric-lite[trackio]' | chained: False",
        "error: MLFlowLogger needs mlflow: pip install 'fabric-lite[mlflow]'",
        "error: WandbLogger needs wandb: pip install 'fabric-lite[wandb]'",
        "all: ['tensorboard', 'csv']",
    ], result.stdout + result.stderr
    # uncaught, the traceback ends with the one sentence
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == \
        "ModuleNotFoundError: log_with='mlflow' needs mlflow: pip install 'fabric-lite[mlflow]'"


def test_one_backend_per_service_under_both_doors(tmp_path):
    """The raw door's trackers and the Trainer's loggers hand their work to the same backend classes, and the
    backends' package imports nothing of the doors (it sits below accelerator/ and callbacks/)."""
    import ast
    import pathlib

    import fabric_lite.trackers as trackers
    from fabric_lite.callbacks import CSVLogger, TensorBoardLogger
    from fabric_lite.trackers import CSVBackend, TensorBoardBackend

    tracker, logger = CSVTracker("run", tmp_path), CSVLogger(tmp_path)
    assert type(tracker.backend) is type(logger.backend) is CSVBackend
    assert TensorBoardLogger(tmp_path).open().__class__ is TensorBoardBackend
    for path in pathlib.Path(trackers.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fabric_lite"):
                assert node.module.startswith("fabric_lite.trackers"), (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("fabric_lite") and not a.name.startswith("fabric_lite.trackers")
                               for a in node.names), path.name
