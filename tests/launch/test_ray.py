"""fabric_lite under Ray: a real local Ray instance (started here, 2 CPUs), Ray Train's TorchTrainer with 2 gloo
workers, and Ray Tune.

Each run is a new Ray driver (tests/workers/ray_runs.py) connected to the instance, as on a cluster. Checked:
reported checkpoints appear in Ray's Result and are fabric_lite checkpoints; a worker SIGKILLed mid-run with
FailureConfig(max_failures=1) restarts and resumes by itself, bit-exact against an uninterrupted run (both doors);
a run that failed for good resumes from a new driver on the same storage path and name; a Tune search with ASHA
stops the bad trials early. The unit tests at the top need no Ray instance.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, free_port, run_command
from fabric_lite import Callback, Trainer
from fabric_lite.strategies.environments import detect_process

RAY_TRAIN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
                 "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41000", "RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "123",
                 "ACCELERATE_TORCH_DEVICE": "cuda:0"}


# -- without a Ray instance ------------------------------------------------------------------------------------

def test_ray_train_workers_are_told_apart_from_torchrun():
    info = detect_process(RAY_TRAIN_ENV)
    assert (info.world_size, info.global_rank, info.local_rank, info.master_addr, info.master_port) == \
        (2, 1, 1, "10.0.0.5", 41000)
    assert info.source == "Ray Train, 2 worker(s)" and info.engine == "ray_train" and info.device == "cuda:0"
    torchrun = {k: v for k, v in RAY_TRAIN_ENV.items() if not k.startswith("RAY_")}
    assert detect_process(torchrun).engine is None and detect_process(torchrun).device is None
    # torchrun started inside a Ray task: torch's elastic agent owns these processes
    assert detect_process(dict(RAY_TRAIN_ENV, TORCHELASTIC_RUN_ID="x")).source == "torchrun"
    lone = detect_process({"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "123"})
    assert lone.engine == "ray" and not lone.is_distributed and "Ray Tune trial" in lone.source
    assert detect_process({}).engine is None


def test_trainer_never_relaunches_under_ray(monkeypatch):
    monkeypatch.setenv("RAY_JOB_ID", "01000000")
    monkeypatch.setenv("RAY_RAYLET_PID", "123")
    with pytest.raises(RuntimeError, match=r"Trainer\(devices=2\) in a single Ray process.*ScalingConfig\(num_workers=2\)"):
        Trainer(devices=2, accelerator="cpu")


def test_report_callback_outside_ray_says_so(tmp_path):
    pytest.importorskip("ray.train")
    from fabric_lite.ray import RayReportCallback, get_checkpoint
    from fabric_lite import TrainModule

    class Tiny(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert get_checkpoint() is None
    module = Tiny()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[RayReportCallback()],
                      enable_progress_bar=False, accelerator="cpu", logger=False)
    with pytest.raises(RuntimeError, match=r"not started by Ray \(lone process\).*TorchTrainer"):
        trainer.fit(module, loader)


def test_report_arguments_are_checked():
    from fabric_lite.ray import RayReportCallback, report

    with pytest.raises(ValueError, match=r"report_on='step'.*'epoch', 'validation'"):
        RayReportCallback(report_on="step")
    with pytest.raises(ValueError, match=r"upload='later'.*'sync', 'async'"):
        RayReportCallback(upload="later")
    with pytest.raises(ValueError, match=r"report\(upload='x'\)"):
        report(None, {}, upload="x")


def test_callbacks_that_report_run_last(tmp_path):
    class Reporter(Callback):
        runs_last = True

    class Other(Callback):
        pass

    reporter, other = Reporter(), Other()
    trainer = Trainer(callbacks=[reporter, other], default_root_dir=str(tmp_path), accelerator="cpu")
    assert trainer.callbacks[-1] is reporter
    assert trainer.callbacks.index(other) < trainer.callbacks.index(reporter)


def test_importing_fabric_lite_ray_does_not_import_ray():
    proc = run_command([sys.executable, "-c", "import sys, fabric_lite, fabric_lite.ray; print('ray' in sys.modules)"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# -- a real Ray instance ---------------------------------------------------------------------------------------

def _ray_env():
    """The environment of the Ray instance and its drivers: no launch variable of the shell around pytest, no
    token file written under $HOME, no usage report."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS",
            "RAY_JOB_ID", "RAY_RAYLET_PID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def ray_instance():
    """`ray start --head` with 2 CPUs on a free port and a temp dir of its own; stopped (its whole process group)
    at the end. Yields the address drivers connect to."""
    pytest.importorskip("ray.train")
    pytest.importorskip("ray.tune")
    ray_cli = Path(sys.executable).with_name("ray")
    if not ray_cli.exists():
        pytest.skip(f"the `ray` command is not next to {sys.executable}")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="flray_")  # short: Ray's socket paths live under it
    log = open(Path(temp_dir) / "head.log", "w")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", "--num-cpus=2", "--num-gpus=0", f"--port={port}",
         f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_ray_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            if head.poll() is not None:
                pytest.fail(f"`ray start --head` exited with {head.returncode}:\n"
                            f"{(Path(temp_dir) / 'head.log').read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the Ray instance did not open its port in 90 s")
                time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 15)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        subprocess.run(["pkill", "-9", "-f", temp_dir], capture_output=True)  # workers that left the group
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_run(ray_instance, tmp_path_factory):
    storage = tmp_path_factory.mktemp("ray_storage")
    out = tmp_path_factory.mktemp("ray_out")

    def run(door, name, *args, expect_error=False, timeout=240):
        cmd = [sys.executable, str(WORKERS / "ray_runs.py"), door, "--address", ray_instance, "--storage",
               str(storage), "--name", name, "--out", str(out), *map(str, args)]
        proc = run_command(cmd, timeout=timeout, env=_ray_env())
        summary_path = out / f"{name}.json"
        assert proc.returncode == 0 and summary_path.exists(), \
            f"driver failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
        summary = json.loads(summary_path.read_text())
        if expect_error:
            assert summary["error"], f"the run was expected to fail: {summary}"
        else:
            assert summary.get("error") is None, f"{summary.get('error')}\nSTDERR:\n{proc.stderr[-6000:]}"
        summary["output"] = proc.stdout + proc.stderr
        summary["weights"] = out / f"{name}.pt"
        summary["killed"] = (out / f"{name}.killed").exists()
        starts = out / f"{name}.starts"  # the step each attempt of a Trainer run started from (rank 0)
        summary["starts"] = [int(x) for x in starts.read_text().split()] if starts.exists() else []
        return summary

    return run


def _weights(path):
    return torch.load(path, weights_only=True)


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs: {wa[key]} vs {wb[key]}"


@pytest.fixture(scope="module")
def trainer_reference(ray_run):
    """An uninterrupted Trainer run under Ray: 3 epochs of 4 steps on 2 workers."""
    return ray_run("trainer", "trainer_plain")


@pytest.mark.ray
@pytest.mark.slow
def test_trainer_reports_each_checkpoint_with_its_metrics(trainer_reference):
    from fabric_lite.checkpoint.files import read_manifest, verify

    run = trainer_reference
    assert run["starts"] == [0]
    assert run["fabric_lite_steps"] == [4, 8, 12]  # one checkpoint per epoch, each ModelCheckpoint's epoch-end save
    assert [m["epoch"] for m in run["checkpoint_metrics"]] == [0, 1, 2]
    assert [m["step"] for m in run["checkpoint_metrics"]] == [4, 8, 12]
    assert all("train_loss" in m for m in run["checkpoint_metrics"])
    assert run["metrics"]["step"] == 12 and run["checkpoint"] == run["checkpoints"][-1]
    for path in run["checkpoints"]:  # Ray's copies are whole fabric_lite checkpoints
        verify(path)
        assert read_manifest(path)["meta"]["world_size"] == 2


@pytest.mark.ray
@pytest.mark.slow
def test_trainer_worker_killed_resumes_by_itself_bit_exact(ray_run, trainer_reference):
    run = ray_run("trainer", "trainer_killed", "--kill-epoch", 1, "--max-failures", 1)
    assert run["killed"], "worker 1 was to SIGKILL itself in epoch 1"
    assert run["starts"] == [0, 4]  # Ray restarted the workers; they went on from the epoch-0 checkpoint
    assert run["fabric_lite_steps"][-1] == 12
    _assert_same_weights(run["weights"], trainer_reference["weights"])


@pytest.mark.ray
@pytest.mark.slow
def test_new_driver_on_the_same_storage_resumes(ray_run, trainer_reference):
    failed = ray_run("trainer", "trainer_driver", "--kill-epoch", 1, "--max-failures", 0, expect_error=True)
    assert failed["killed"] and not failed["weights"].exists()
    resumed = ray_run("trainer", "trainer_driver")  # a new driver: same storage path, same run name
    assert resumed["starts"] == [0, 4]  # the first driver's attempt, then the new driver's from epoch 0's checkpoint
    assert resumed["fabric_lite_steps"][-1] == 12
    _assert_same_weights(resumed["weights"], trainer_reference["weights"])


@pytest.mark.ray
@pytest.mark.slow
def test_raw_door_reports_and_resumes_bit_exact(ray_run):
    plain = ray_run("raw", "raw_plain")
    assert [m["epoch"] for m in plain["checkpoint_metrics"]] == [1, 2, 3]
    killed = ray_run("raw", "raw_killed", "--kill-epoch", 1, "--max-failures", 1)
    assert killed["killed"]
    _assert_same_weights(killed["weights"], plain["weights"])


@pytest.mark.ray
@pytest.mark.slow
def test_tune_search_stops_the_bad_trials_early(ray_run):
    from fabric_lite.checkpoint.files import verify

    run = ray_run("tune", "tune_asha")
    trials = {t["lr"]: t for t in run["trials"]}
    assert sorted(trials) == [0.0001, 0.0005, 0.03, 0.05]
    assert all(t["error"] is None for t in trials.values())
    for lr in (0.03, 0.05):  # the good learning rates run all 6 epochs
        assert trials[lr]["iterations"] == 6, trials[lr]
    for lr in (0.0001, 0.0005):  # ASHA stopped the bad ones at their first rung
        assert trials[lr]["iterations"] < 6, trials[lr]
    assert run["best_lr"] in (0.03, 0.05)
    verify(run["best_checkpoint"])  # a trial's reported checkpoint is a whole fabric_lite checkpoint
