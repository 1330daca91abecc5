"""Background checkpoint saves (`save_state(blocking=False)`, `ModelCheckpoint(async_save=True)`): the training
thread only takes a snapshot; what is published is the state at the call, whatever training does meanwhile;
one save at a time; a background failure is raised on the training thread and leaves the previous checkpoint.

Writes are held back with a gate (the background thread waits at its first file) so that each test controls
when a save is "in flight" without timing anything."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator
from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter


class Gate:
    """Holds every background checkpoint write until `open()`; blocking saves (the training thread) pass."""

    def __init__(self, monkeypatch, fail_on=None):
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fail_on = fail_on  # raise OSError(ENOSPC) when writing this file name
        original = CheckpointWriter.write
        gate = self

        def write(writer, name, obj):
            if threading.current_thread() is not threading.main_thread():
                gate.entered.set()
                assert gate.opened.wait(30), "the test never opened the gate"
            if gate.fail_on == name:
                raise OSError(28, "No space left on device")
            return original(writer, name, obj)

        monkeypatch.setattr(CheckpointWriter, "write", write)

    def open(self):
        self.opened.set()


def _setup(seed=0, **kwargs):
    torch.manual_seed(seed)
    acc = Accelerator(**kwargs)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(model, opt):
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [s["exp_avg"].clone() for s in opt.optimizer.state.values()])


def _loaded(path):
    acc, model, opt = _setup(seed=123)
    acc.load_state(path)
    return _state(model, opt)


def _equal(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_a_background_save_publishes_the_state_of_the_call_while_training_goes_on(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    acc, model, opt = _setup()
    _step(model, opt)
    at_save = _state(model, opt)
    url = acc.save_state(tmp_path / "ckpt", blocking=False)
    assert url == str(tmp_path / "ckpt")
    assert gate.entered.wait(10)
    assert acc.checkpoint_saver.in_flight and not (tmp_path / "ckpt").exists()  # returned before writing
    for _ in range(3):  # training changes weights and optimizer state in place while the save is in flight
        _step(model, opt)
    assert not _equal(_state(model, opt), at_save)
    gate.open()
    acc.wait_for_checkpoint()
    assert not acc.checkpoint_saver.in_flight
    checkpoint_io.verify(str(tmp_path / "ckpt"))
    assert _equal(_loaded(tmp_path / "ckpt"), at_save)  # the snapshot, not what training did after
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging directory left behind
    record = acc.checkpoint_saver.history[-1]
    assert record.background and record.error is None and record.finished is not None
    assert acc.checkpoint_saver.snapshot_bytes > 0  # kept for the next save, bounded by one snapshot


def test_one_save_in_flight_a_second_waits_or_is_skipped_never_overlapping(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    acc, model, opt = _setup()
    acc.save_state(tmp_path / "a", blocking=False)
    assert gate.entered.wait(10)
    assert acc.save_state(tmp_path / "b", blocking=False, if_busy="skip") is None  # still in flight: skipped
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="if_busy='later'.*'wait', 'skip'"):
        acc.save_state(tmp_path / "b", blocking=False, if_busy="later")
    threading.Timer(0.3, gate.open).start()
    _step(model, opt)
    acc.save_state(tmp_path / "c", blocking=False)  # waits for "a", then starts
    acc.wait_for_checkpoint()
    history = acc.checkpoint_saver.history
    assert [r.url for r in history] == [str(tmp_path / "a"), str(tmp_path / "c")]
    assert history[0].finished <= history[1].started + history[1].blocked  # "c" began only after "a" ended
    assert history[1].blocked >= 0.2  # it waited for the gate
    for name in ("a", "c"):
        checkpoint_io.verify(str(tmp_path / name))


def test_a_background_failure_is_raised_later_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    acc, model, opt = _setup()
    acc.save_state(tmp_path / "ckpt")  # a good one, blocking
    good = _state(model, opt)
    before = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    gate = Gate(monkeypatch, fail_on="model_0.pt")
    _step(model, opt)
    acc.save_state(tmp_path / "ckpt", blocking=False)
    gate.open()
    while acc.checkpoint_saver.in_flight:
        time.sleep(0.01)
    assert acc.checkpoint_saver.failed
    _step(model, opt)  # nothing raised on the way: the loop goes on until it asks
    with pytest.raises(CheckpointError, match=r"save_state\(.*ckpt\) failed and wrote nothing.*rank 0: OSError: "
                                              r"\[Errno 28\] No space left on device.*previous checkpoint.*intact"):
        acc.check_preemption()  # the per-step agreement raises it (every process at the same call)
    assert not acc.checkpoint_saver.failed
    acc.wait_for_checkpoint()  # raised once, not again
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text()) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the staging directory is gone
    assert _equal(_loaded(tmp_path / "ckpt"), good)
    gate.fail_on = None
    acc.save_state(tmp_path / "ckpt", blocking=False)  # and the next save works
    acc.wait_for_checkpoint()
    assert _equal(_loaded(tmp_path / "ckpt"), _state(model, opt))


def test_the_next_save_and_end_training_raise_a_background_failure(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, fail_on="training_state.pt")
    gate.open()
    acc, model, opt = _setup()
    acc.save_state(tmp_path / "one", blocking=False)
    with pytest.raises(CheckpointError, match="training_state|No space left"):
        acc.save_state(tmp_path / "two", blocking=False)
    assert not (tmp_path / "two").exists()
    acc.save_state(tmp_path / "three", blocking=False)
    with pytest.raises(CheckpointError, match="No space left"):
        acc.end_training()


def test_durable_saves_fsync_files_and_directories(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    acc, model, opt = _setup(project_config=None)
    acc.save_state(tmp_path / "plain")
    assert synced == []  # not asked for: no fsync cost
    acc.save_state(tmp_path / "ckpt", durable=True, blocking=False)
    acc.wait_for_checkpoint()
    names = {os.path.basename(p) for p in synced if isinstance(p, str)}
    assert {"model_0.pt", "training_state.pt", "rng_0.pt", "manifest.json.partial"} <= names  # (then renamed)
    assert str(tmp_path) in synced  # the rename into place, made durable through the parent directory


def test_background_saves_fall_back_to_blocking_where_the_strategy_cannot_snapshot(tmp_path):
    acc, model, opt = _setup()
    type(acc.strategy).background_checkpoints = False
    try:
        with pytest.warns(UserWarning, match="cannot copy its state to the host.*this save blocks"):
            acc.save_state(tmp_path / "ckpt", blocking=False)
    finally:
        del type(acc.strategy).background_checkpoints
    assert not acc.checkpoint_saver.history[-1].background
    checkpoint_io.verify(str(tmp_path / "ckpt"))


# -- real processes: killed at random moments; a failure on one rank of two --------------------------------

def test_background_saves_killed_at_random_moments_always_resume_exact(tmp_path):
    """100 trials: a Trainer saving in the background every 2 steps is SIGKILLed at a random moment of its run
    (a third of them with a save in flight, on the background thread or committing); a new process resumes
    with ckpt_path="last" from the newest whole checkpoint and ends with the uninterrupted run's weights."""
    from test_resume import Run, killed_by

    code, output, (report,) = Run("resume_crash_save.py", tmp_path / "out", "--root", tmp_path / "trials",
                                  "--async-save", "--random-kills", 100, "--seed", 7, timeout=240).wait()
    assert code == 0 and report is not None, output[-6000:]
    trials = report["trials"]
    assert len(trials) == 100
    killed = [t for t in trials.values() if t["killed"] is not None]
    in_flight = [t for t in killed if t["killed"]["in_flight"]]
    assert len(killed) >= 70 and len(in_flight) >= 15, (len(killed), len(in_flight))
    failures = []
    for n, t in trials.items():
        problems = []
        if t["killed"] is not None and not killed_by(t["crash_exit"], signal.SIGKILL):
            problems.append(f"crashed run ended with {t['crash_exit']}")
        if t["resume_exit"] != 0 or "error" in t:
            problems.append(f"resume failed ({t['resume_exit']}): {t.get('error')}")
        elif t["global_step"] != 6 or t["weights"] != report["reference"]:
            problems.append(f"resumed from step {t['start']} and ended at {t['global_step']} with other weights")
        if problems:
            failures.append(f"trial {n} (killed: {t['killed']}): {'; '.join(problems)}; before={t.get('before')}")
    assert not failures, "\n".join(failures)


def test_a_background_failure_on_one_rank_is_raised_on_every_rank_at_the_same_step(tmp_path):
    from test_resume import Run

    code, output, results = Run("async_save.py", tmp_path / "out", "--root", tmp_path / "root", "--fail-rank", 1,
                                "--fail-save", 2, nproc=2, launcher="torchrun", timeout=180).wait()
    assert all(r is not None for r in results), output[-6000:]
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # the same error on both ranks
    error = errors.pop()
    assert error.startswith("CheckpointError: save_state(") and "step=4) failed and wrote nothing (rank 1: OSError: " \
        "[Errno 28] No space left on device)" in error, error
    assert results[0]["step"] == results[1]["step"]  # raised at the same step
    assert results[0]["checkpoints"] == ["epoch=0-step=2", "latest"]  # the previous one stays, no staging left
