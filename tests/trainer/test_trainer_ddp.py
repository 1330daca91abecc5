"""The trainer door on 2 processes (torchrun, gloo on CPU): DDP equals one process with the global batch,
validation metrics count every sample once, synced logging, early stopping in step, and mistakes that
must be errors on every rank instead of hangs.

Each launch costs seconds, so one launch runs several scenarios (tests/workers/trainer_*.py) and the
tests below read its per-rank JSON. The launcher kills the whole process group on timeout: a hang
fails the test and leaves no orphaned workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, WORKERS, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "FABRIC_LITE_MIXED_PRECISION", "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "FABRIC_LITE_USE_CPU")


def launch(script, nproc, out_dir, *args, timeout=120):
    """Run `script` under torchrun; return (per-rank results or None where a rank wrote nothing, output).

    A non-zero exit is not raised here: the tests say which rank failed and how.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})  # gloo on CPUs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(WORKERS / script), "--out", str(out_dir),
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the launcher and its workers: a hang must not outlive the test
        output, _ = proc.communicate()
        output = f"TIMED OUT after {timeout}s (a hang)\n{output}"
    results = []
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return proc.returncode, results, output


def scenario(results, name, output):
    """Each rank's result for one scenario; fails with the launch output if a rank did not report it."""
    missing = [r for r, res in enumerate(results) if res is None or name not in res]
    if missing:
        pytest.fail(f"rank(s) {missing} reported nothing for {name!r} (crashed or hung):\n{output[-6000:]}")
    return [res[name] for res in results]


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_fit")
    code, results, output = launch("trainer_fit.py", 2, tmp / "out", "--root", tmp / "root", timeout=180)
    return results, output


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    """The same Trainer on this (lone) process with the global batch: 8, and 8 without accumulation."""
    saved = {k: os.environ.pop(k) for k in _ENV if k in os.environ}
    sys.path.insert(0, str(WORKERS))
    try:
        import trainer_common

        tmp = tmp_path_factory.mktemp("reference")
        trainer, weights = trainer_common.fit_parity(str(tmp), batch_size=8)
        assert trainer.world_size == 1
        return {"weights": weights, "global_step": trainer.global_step}
    finally:
        sys.path.remove(str(WORKERS))
        os.environ.update(saved)


def test_two_processes_batch_b_equal_one_process_batch_2b(fit_run, one_process_reference):
    results, output = fit_run
    r0, r1 = scenario(results, "parity", output)
    assert r0["strategy"] == "DDPStrategy" and r0["world"] == 2
    assert r0["global_step"] == r1["global_step"] == one_process_reference["global_step"] == 16
    w1, w2 = torch.tensor(one_process_reference["weights"]), torch.tensor(r0["weights"])
    assert torch.allclose(w1, w2, atol=1e-6, rtol=0), (w1 - w2).abs().max()
    assert r0["weights"] == r1["weights"]      # DDP keeps the replicas identical


def test_two_processes_with_accumulation_equal_one_process_big_batch(fit_run, one_process_reference):
    # 2 processes x batch 2 x accumulate 2 == 1 process x batch 8
    results, output = fit_run
    r0, r1 = scenario(results, "accum", output)
    assert r0["global_step"] == 16
    w1, w2 = torch.tensor(one_process_reference["weights"]), torch.tensor(r0["weights"])
    assert torch.allclose(w1, w2, atol=1e-6, rtol=0), (w1 - w2).abs().max()
    assert r0["weights"] == r1["weights"]


def test_torchmetrics_accuracy_counts_every_validation_sample_once(fit_run):
    results, output = fit_run
    r0, r1 = scenario(results, "metrics", output)
    # 101 samples in batches of 8: each sample validated by exactly one process, none padded in
    assert sorted(r0["seen"] + r1["seen"]) == list(range(101))
    assert len(r0["seen"]) == 53 and len(r1["seen"]) == 48    # batches 0, 2, ..., 12 (5 samples) | 1, 3, ..., 11
    for r in (r0, r1):
        assert r["fit"]["val/acc"] == pytest.approx(r["by_hand_acc"], abs=1e-6)
        assert r["validate"]["val/acc"] == pytest.approx(r["by_hand_acc"], abs=1e-6)
    assert r0["by_hand_acc"] == r1["by_hand_acc"]


def test_sync_dist_gives_the_global_mean_and_max(fit_run):
    results, output = fit_run
    r0, r1 = scenario(results, "metrics", output)
    for r in (r0, r1):
        for source in ("fit", "validate"):
            # the batch-size-weighted mean over both processes is the mean over all 101 samples
            assert r[source]["val/x0"] == pytest.approx(r["global_x0"], abs=1e-6)
            assert r[source]["val/x0_max"] == pytest.approx(r["global_x0_max"], abs=1e-6)
            # without sync_dist each process keeps its own mean
            assert r[source]["val/x0_local"] == pytest.approx(r["local_x0"], abs=1e-6)
    assert r0["local_x0"] != pytest.approx(r1["local_x0"])


def test_early_stopping_stops_every_rank_at_the_same_epoch(fit_run):
    results, output = fit_run
    r0, r1 = scenario(results, "early", output)
    # rank 0's unsynced metric stalls (stop after epoch 3); rank 1's keeps improving: they must agree
    assert r0 == r1, (r0, r1)
    assert r0["stopped_epoch"] == 3 and r0["global_step"] == 8


@pytest.fixture(scope="module")
def error_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_errors")
    # step_sync_one_rank last: if it kills a process, the scenarios before it have already reported
    code, results, output = launch(
        "trainer_errors.py", 2, tmp / "out", "--root", tmp / "root", "--collective-timeout", 10,
        "--scenario", "val_sync_one_rank", "--scenario", "train_epoch_sync_one_rank",
        "--scenario", "step_sync_one_rank", timeout=90)
    return results, output


@pytest.mark.parametrize("name,stage,key", [
    ("val_sync_one_rank", "validate", "val/only0"),
    ("train_epoch_sync_one_rank", "train", "train/only0"),
])
def test_sync_dist_on_one_rank_only_is_a_clear_error_on_every_rank(error_run, name, stage, key):
    results, output = error_run
    for r in scenario(results, name, output):
        assert r["error"] == "RuntimeError", r
        assert "sync_dist=True" in r["message"] and key in r["message"] and repr(stage) in r["message"], r


def test_per_step_sync_dist_on_one_rank_only_is_a_clear_error_on_every_rank(error_run):
    # self.log(..., sync_dist=True) in training_step is per step by default: a process that logs a synced
    # name the others do not must get the same clear error, not a gloo crash or a hang.
    results, output = error_run
    for r in scenario(results, "step_sync_one_rank", output):
        assert r["error"] == "RuntimeError", r
        assert "sync_dist=True" in r["message"] and "train/only0_step" in r["message"], r


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer_checkpoint")
    # the scenario that may hang goes last; a 10 s collective timeout turns a hang into a reported error
    code, results, output = launch(
        "trainer_errors.py", 2, tmp / "out", "--root", tmp / "root", "--collective-timeout", 10,
        "--scenario", "checkpoint_unsynced_filename", "--scenario", "checkpoint_unsynced_monitor", timeout=90)
    return results, output


def test_checkpoint_monitor_that_differs_between_ranks_does_not_hang(checkpoint_run):
    # ModelCheckpoint(monitor=...) on a value each process computes for itself (no sync_dist): rank 0 wants
    # to save at epochs 1 and 2, rank 1 does not. The save is collective, so the ranks must agree on
    # one decision (Lightning reduces it across processes) instead of waiting for each other for ever.
    results, output = checkpoint_run
    r0, r1 = scenario(results, "checkpoint_unsynced_monitor", output)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["global_step"] == r1["global_step"] == 6
    assert r0["best_model_path"] == r1["best_model_path"]
    assert r0["saved"] == r1["saved"] and len(r0["saved"]) == 1, r0["saved"]


def test_checkpoint_filename_with_a_per_rank_metric_writes_one_whole_checkpoint(checkpoint_run):
    # filename="{epoch}-{val/metric:.1f}" with an unsynced value: every rank must write into the *same*
    # checkpoint (rank 0's name), or rank 1's files land in a staging directory that is never published.
    results, output = checkpoint_run
    r0, r1 = scenario(results, "checkpoint_unsynced_filename", output)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["saved"] == ["epoch=0-val_metric=3.0", "epoch=1-val_metric=2.0", "epoch=2-val_metric=1.0"], r0["saved"]
    for name in r0["saved"]:
        assert {"rng_0.pt", "rng_1.pt", "manifest.json"} <= set(r0["files"][name]), (name, r0["files"][name])
    assert r0["best_model_path"] == r1["best_model_path"]
