"""The trackers past the first four, for real and offline: `Accelerator(log_with="all")` with every offline switch
on logs a configuration and three steps in a child process (tests/workers/offline_trackers.py) that refuses and
records any connection beyond this machine; each test then reads back what its tracker wrote, with the tool's
own reader where it has one: Comet's offline archive, ClearML's offline session, DVCLive's files, SwanLab's
backup log, Aim's repository, Trackio's SQLite database. Then "all" on a machine where no service is set up
(tests/workers/unconfigured_trackers.py), and what decides it (fabric_lite/trackers/setup.py).

comet_ml, clearml and dvclive are in the `dev` extra; aim, swanlab and trackio are not (docs/guides/trackers.md
says why), so their tests skip where the package is missing.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sqlite3
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from conftest import WORKERS
from fabric_lite.accelerator.tracking import (
    ClearMLTracker, DVCLiveTracker, GeneralTracker, KNOWN_TRACKERS, available_trackers, is_installed, on_main_process,
)

NEW = ["comet_ml", "clearml", "dvclive", "swanlab", "aim", "trackio"]
INSTALLED = [name for name in NEW if is_installed(KNOWN_TRACKERS[name].package)]
STEPS = [(0, 1.0), (1, 0.5), (2, 0.25)]
EVAL = [(0, 0.0), (1, 0.25), (2, 0.5)]


def _skip_unless(name):
    if name not in INSTALLED:
        extra = "comet" if name == "comet_ml" else name
        pytest.skip(f"{name} is not installed (pip install -c constraints.txt 'fabric-lite[{extra}]')")


SERVICE_PREFIXES = ("COMET_", "CLEARML_", "TRAINS_", "WANDB_", "SWANLAB_", "TRACKIO_", "DVC_", "AIM_", "MLFLOW_",
                    "NETRC", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """Run the worker once with `log_with="all"` and every tracker's offline switch on; its output folder and
    result."""
    if not INSTALLED:
        pytest.skip("none of comet_ml, clearml, dvclive, swanlab, aim, trackio is installed")
    out = tmp_path_factory.mktemp("offline_trackers")
    home = out / "home"
    home.mkdir()
    # ClearML reports from a child process by default, and closing waits ~10 s for it; a thread is enough here
    (out / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(SERVICE_PREFIXES)}
    env.update({
        "HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path),
        "COMET_START_ONLINE": "false", "COMET_ERROR_TRACKING_ENABLE": "false", "COMET_DISABLE_AUTO_LOGGING": "1",
        "COMET_DISABLE_ANNOUNCEMENT": "true",
        "CLEARML_CONFIG_FILE": str(out / "clearml.conf"), "CLEARML_OFFLINE_MODE": "1", "CLEARML_CACHE_DIR": str(out / "clearml_cache"), "CLEARML_LOG_LEVEL": "ERROR",
        "SWANLAB_MODE": "offline",
        "TRACKIO_DIR": str(out / "trackio"),
        "DVC_NO_ANALYTICS": "1", "DVCLIVE_LOGLEVEL": "ERROR",
        "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB__DISABLE_STATS": "true",
    })
    result = subprocess.run([sys.executable, str(WORKERS / "offline_trackers.py"), str(out), "all"],
                            env=env, capture_output=True, text=True, timeout=240, cwd=str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    with open(out / "result.json") as f:
        outcome = json.load(f)
    # with its offline switch on, each service's tracker starts under "all", with no warning
    assert outcome["started"] == available_trackers() and set(INSTALLED) <= set(outcome["started"])
    assert outcome["all_warnings"] == []
    assert outcome["network"] == [], "the trackers tried the network offline"
    return out, outcome


def test_comet_ml_offline_archive_holds_the_run(offline_run):
    _skip_unless("comet_ml")
    out, _ = offline_run
    archives = glob.glob(str(out / "project" / "comet_ml" / "*.zip"))  # the project dir, no offline dir set
    assert len(archives) == 1
    with zipfile.ZipFile(archives[0]) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line]
    assert experiment["project_name"] == "offline-proj"
    metrics, params, others = {}, {}, {}
    for message in messages:
        payload = message["payload"]
        if message["type"] == "metric_msg":
            metrics.setdefault(payload["metric"]["metricName"], []).append(
                (payload["metric"]["step"], payload["metric"]["metricValue"]))
        elif message["type"] == "parameter_msg" and payload["param"]["source"] == "manual" \
                and payload["param"]["paramName"] != "curr_step":
            params[payload["param"]["paramName"]] = payload["param"]["paramValue"]
        elif message["type"] == "log_other":
            others[payload["key"]] = payload["value"]
    assert metrics["loss"] == STEPS and metrics["eval_acc"] == EVAL
    assert params == {"lr": 0.1, "nested|a": 1, "name": "tiny"}
    assert others["Name"] == "offline-run" and others["offline_experiment"] is True


def test_clearml_offline_session_holds_the_run(offline_run):
    _skip_unless("clearml")
    out, outcome = offline_run
    folder = outcome["where"]["clearml"]
    assert folder.startswith(str(out / "clearml_cache" / "offline"))
    assert os.path.isfile(folder + ".zip")  # what `Task.import_offline_session` uploads later
    with open(os.path.join(folder, "task.json")) as f:
        task = json.load(f)
    assert task["project_name"] == "offline-proj" and task["name"] == "offline-run"
    from clearml.utilities.pyhocon import ConfigFactory  # the format ClearML stores a configuration in

    with warnings.catch_warnings():  # its bundled parser uses pyparsing's old names
        warnings.simplefilter("ignore", DeprecationWarning)
        config = ConfigFactory.parse_string(task["configuration"]["General"]["value"])
    assert config.as_plain_ordered_dict() == {"lr": 0.1, "nested": {"a": 1}, "name": "tiny"}
    reported = {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            for event in json.loads(line):
                if event["type"] == "training_stats_scalar":
                    reported.setdefault((event["metric"], event["variant"]), []).append((event["iter"], event["value"]))
    # "eval_acc" is the plot "acc", series "eval"; "loss" the plot "loss", series "train"
    assert reported == {("loss", "train"): STEPS, ("acc", "eval"): EVAL}


def test_dvclive_files_hold_the_run(offline_run):
    _skip_unless("dvclive")
    out, _ = offline_run
    live = out / "project" / "dvclive"
    import yaml

    assert yaml.safe_load((live / "params.yaml").read_text()) == {"lr": 0.1, "nested": {"a": 1}, "name": "tiny"}
    for name, expected in (("loss", STEPS), ("eval_acc", EVAL)):
        with open(live / "plots" / "metrics" / f"{name}.tsv", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        assert [(int(r["step"]), float(r[name])) for r in rows] == expected
    assert json.loads((live / "metrics.json").read_text()) == {"loss": 0.25, "eval_acc": 0.5, "step": 2}


def test_wandb_offline_run_holds_the_run(offline_run):
    """WANDB_MODE=offline is wandb's switch: under "all" it starts and writes its run under the project dir."""
    pytest.importorskip("wandb")
    from tracker_servers import read_wandb_run, wandb_run_dir

    out, outcome = offline_run
    recorded = read_wandb_run(wandb_run_dir(out / "project", outcome["where"]["wandb"]))
    assert recorded["project"] == "offline-proj" and recorded["name"] == "offline-run"
    assert [(row["_step"], row["loss"]) for row in recorded["history"]] == STEPS
    assert [(row["_step"], row["eval_acc"]) for row in recorded["history"]] == EVAL


NEED_AN_ACCOUNT = {  # tracker: what the warning and the error name to set it up, online and offline
    "wandb": ("WANDB_API_KEY", "wandb login", "WANDB_MODE=offline"),
    "comet_ml": ("COMET_API_KEY", "comet login", "COMET_START_ONLINE=false"),
    "clearml": ("clearml-init", "CLEARML_API_ACCESS_KEY", "CLEARML_OFFLINE_MODE=1"),
    "swanlab": ("SWANLAB_API_KEY", "swanlab login", "SWANLAB_MODE=offline"),
}


def test_all_skips_services_nobody_set_up_and_a_named_one_fails_loudly(tmp_path):
    """No account anywhere (an empty HOME, no tracker variables): "all" starts the trackers that need none and
    names the others in one warning, with how to set each up or switch it offline; naming one alone fails
    with that advice; Comet's offline switch in ~/.comet.config is read as comet_ml reads it."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(SERVICE_PREFIXES) and k != "XDG_CONFIG_HOME"}
    env.update({"HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path), "COMET_ERROR_TRACKING_ENABLE": "false",
                "COMET_DISABLE_AUTO_LOGGING": "1", "COMET_DISABLE_ANNOUNCEMENT": "true", "WANDB_SILENT": "true",
                "WANDB_ERROR_REPORTING": "false", "DVC_NO_ANALYTICS": "1", "DVCLIVE_LOGLEVEL": "ERROR",
                "CLEARML_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"})
    named = [name for name in ("comet_ml", "clearml", "wandb") if is_installed(name)]
    result = subprocess.run([sys.executable, str(WORKERS / "unconfigured_trackers.py"), str(tmp_path),
                             ",".join(named)], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    with open(tmp_path / "result.json") as f:
        outcome = json.load(f)
    assert outcome["network"] == []

    skipped = [name for name in available_trackers() if name in NEED_AN_ACCOUNT]
    assert outcome["all"]["started"] == [name for name in available_trackers() if name not in NEED_AN_ACCOUNT]
    assert {"tensorboard", "csv"} <= set(outcome["all"]["started"])
    if skipped:
        (warning,) = outcome["all"]["warnings"]  # one warning for the run, one line
        assert "\n" not in warning and warning.startswith("log_with='all' skips ")
        for name in skipped:
            assert f"{name} (" in warning
            for advice in NEED_AN_ACCOUNT[name]:
                assert advice in warning, (name, advice, warning)
    else:
        assert outcome["all"]["warnings"] == []

    for name in named:  # named alone: its own error, with what to set
        error = outcome["named"][name]
        assert error is not None and error.startswith(f"ValueError: log_with='{name}' could not start (")
        for advice in NEED_AN_ACCOUNT[name]:
            assert advice in error, (name, advice, error)

    if "comet_ml" in named:  # `[comet_start] online = false` in ~/.comet.config: "all" would start Comet, and
        # comet_ml reads the file the same way: it writes offline
        assert outcome["comet_file"]["missing"] is None and len(outcome["comet_file"]["archives"]) == 1


def test_swanlab_offline_log_holds_the_run(offline_run):
    _skip_unless("swanlab")
    out, outcome = offline_run
    run_dir = outcome["where"]["swanlab"]
    assert run_dir.startswith(str(out / "project" / "swanlog"))
    from swanlab.log.backup.datastore import DataStore  # the reader `swanlab sync` uses

    store = DataStore()
    store.open_for_scan(os.path.join(run_dir, "backup.swanlab"))
    records = [json.loads(record) for record in store]
    scalars = {}
    for record in records:
        if record["model_type"] == "Scalar":
            data = record["data"]
            scalars.setdefault(data["key"], []).append((data["step"], data["metric"]["data"]))
    assert scalars == {"loss": STEPS, "eval_acc": EVAL}
    assert [r["data"]["name"] for r in records if r["model_type"] == "Project"] == ["offline-proj"]
    assert [r["data"]["name"] for r in records if r["model_type"] == "Experiment"] == ["offline-run"]
    import yaml

    config = yaml.safe_load(open(os.path.join(run_dir, "files", "config.yaml")))
    assert {key: config[key]["value"] for key in ("lr", "nested", "name")} == {"lr": 0.1, "nested": {"a": 1},
                                                                                "name": "tiny"}


def test_aim_repository_holds_the_run(offline_run):
    _skip_unless("aim")
    out, outcome = offline_run
    from aim import Repo

    run = Repo(str(out / "project")).get_run(outcome["where"]["aim"])
    assert run.name == "offline-proj" and run["hparams"] == {"lr": 0.1, "nested": {"a": 1}, "name": "tiny"}
    tracked = {}
    for metric in run.metrics():
        steps, values = metric.values.sparse_numpy()
        tracked[metric.name] = [(int(s), float(v)) for s, v in zip(steps, values)]
    assert tracked == {"loss": STEPS, "eval_acc": EVAL}


def test_trackio_database_holds_the_run(offline_run):
    _skip_unless("trackio")
    out, _ = offline_run
    databases = glob.glob(str(out / "trackio" / "offline-proj*.db"))
    assert len(databases) == 1
    with sqlite3.connect(databases[0]) as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = 'offline-run' ORDER BY step").fetchall()
        configs = db.execute("SELECT config FROM configs WHERE run_name = 'offline-run'").fetchall()
    assert [(step, json.loads(metrics)["loss"]) for step, metrics in rows] == STEPS
    assert [(step, json.loads(metrics)["eval_acc"]) for step, metrics in rows] == EVAL
    config = json.loads(configs[-1][0])
    assert {key: config[key] for key in ("lr", "nested", "name")} == {"lr": 0.1, "nested": {"a": 1}, "name": "tiny"}


# -- in this process: what the trackers do with odd values, and main_process_only ---------------------------

def test_dvclive_skips_what_is_not_a_number_and_steps_on(tmp_path):
    _skip_unless("dvclive")
    tracker = DVCLiveTracker(logging_dir=tmp_path, report=None)
    assert tracker.tracker.dir == str(tmp_path / "dvclive")
    with pytest.warns(UserWarning, match="DVCLive logs numbers: note='hi'"):
        tracker.log({"loss": torch.tensor(2.0), "note": "hi", "val": {"acc": 0.5}})
    tracker.log({"loss": 1.0, "note": "again"})  # warned once per name
    tracker.finish()
    with open(tmp_path / "dvclive" / "plots" / "metrics" / "loss.tsv", newline="") as f:
        assert [(r["step"], r["loss"]) for r in csv.DictReader(f, delimiter="\t")] == [("0", "2.0"), ("1", "1.0")]
    assert (tmp_path / "dvclive" / "plots" / "metrics" / "val" / "acc.tsv").exists()


def test_clearml_names_and_tables_follow_accelerate():
    assert ClearMLTracker.title_and_series("eval_loss") == ("loss", "eval")
    assert ClearMLTracker.title_and_series("test_f1") == ("f1", "test")
    assert ClearMLTracker.title_and_series("loss") == ("loss", "train")
    assert ClearMLTracker.title_and_series("evaluation") == ("evaluation", "train")


class _Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, main_process_only):
        self.main_process_only = main_process_only
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    @on_main_process
    def log(self, values, step=None, **kwargs):
        self.calls.append((values, step))
        return "logged"


def test_on_main_process_reads_the_rank_when_called(monkeypatch):
    import gc

    from fabric_lite.state import current_strategy

    gc.collect()
    if current_strategy() is not None:
        pytest.skip("an Accelerator of an earlier test is still alive here: its rank would be the one read")
    everywhere, main_only = _Recorder(False), _Recorder(True)
    assert everywhere.log({"a": 1}, 0) == "logged" and main_only.log({"a": 1}, 0) == "logged"
    monkeypatch.setenv("RANK", "1")  # as on the second process of a launch (no Accelerator in this test)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert everywhere.log({"a": 2}, 1) == "logged"
    assert main_only.log({"a": 2}, 1) is None
    assert everywhere.calls == [({"a": 1}, 0), ({"a": 2}, 1)] and main_only.calls == [({"a": 1}, 0)]
    assert _Recorder.log.__name__ == "log"  # functools.wraps


def test_tracker_classes_take_accelerate_arguments():
    """The names, flags and first arguments scripts use from Accelerate's classes."""
    import inspect

    expected = {"comet_ml": ("CometMLTracker", False, True, ["run_name"]),
                "aim": ("AimTracker", True, True, ["run_name", "logging_dir"]),
                "clearml": ("ClearMLTracker", False, True, ["run_name"]),
                "dvclive": ("DVCLiveTracker", False, True, ["run_name", "live"]),
                "swanlab": ("SwanLabTracker", False, False, ["run_name"]),
                "trackio": ("TrackioTracker", False, False, ["run_name"])}
    for name, (cls_name, needs_dir, main_only, positional) in expected.items():
        cls = KNOWN_TRACKERS[name]
        params = [p.name for p in inspect.signature(cls).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert (cls.__name__, cls.requires_logging_directory, cls.main_process_only, params) == \
            (cls_name, needs_dir, main_only, positional), name
    import fabric_lite.tracking
    import fabric_lite.utils

    assert fabric_lite.tracking.CometMLTracker is KNOWN_TRACKERS["comet_ml"]
    assert fabric_lite.utils.on_main_process is on_main_process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from fabric_lite.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    assert LOGGER_TYPE_TO_CLASS is KNOWN_TRACKERS and set(get_available_trackers()) >= set(INSTALLED)
