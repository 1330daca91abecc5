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


def _finished(acc):
    while acc.checkpoint_saver.in_flight:
        time.sleep(0.01)


def test_the_next_save_goes_ahead_then_raises_the_failure_before_it_and_end_training_raises(tmp_path, monkeypatch):
    gate = Gate(monkeypatch, fail_on="training_state.pt")
    gate.open()
    acc, model, opt = _setup()
    acc.save_state(tmp_path / "one", blocking=False)
    _finished(acc)
    gate.fail_on = None
    with pytest.raises(CheckpointError, match=r"one\) failed and wrote nothing.*No space left.*\(Raised now, after "
                                              r"save_state\(.*two\) went ahead\.\)"):
        acc.save_state(tmp_path / "two", blocking=False)
    acc.wait_for_checkpoint()
    checkpoint_io.verify(str(tmp_path / "two"))  # nothing lost: the save after a failure is written
    assert not (tmp_path / "one").exists()
    gate.fail_on = "rng_0.pt"
    acc.save_state(tmp_path / "three", blocking=False)
    with pytest.raises(CheckpointError, match="three.*No space left"):
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
    acc.strategy.checkpoint_format.background = False
    with pytest.warns(UserWarning, match="cannot copy its state to the host.*this save blocks"):
        acc.save_state(tmp_path / "ckpt", blocking=False)
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
    killed = [t for t in trials.values() if t.get("killed") is not None]
    in_flight = [t for t in killed if t["killed"]["in_flight"]]
    assert len(killed) >= 70 and len(in_flight) >= 15, (len(killed), len(in_flight))
    failures = []
    for n, t in trials.items():
        problems = []
        if t.get("killed") is not None and not killed_by(t["crash_exit"], signal.SIGKILL):
            problems.append(f"crashed run ended with {t['crash_exit']}")
        if t.get("resume_exit") != 0 or "error" in t:
            problems.append(f"resume failed ({t.get('resume_exit')}): {t.get('error')}")
        elif t["global_step"] != 6 or t["weights"] != report["reference"]:
            problems.append(f"resumed from step {t['start']} and ended at {t['global_step']} with other weights")
        if problems:
            failures.append(f"trial {n} (killed: {t.get('killed')}): {'; '.join(problems)}; before={t.get('before')}")
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


def test_a_save_in_flight_when_the_script_ends_is_still_written(tmp_path):
    """The script returns right after save_state(blocking=False) (no wait, no end_training): the interpreter
    waits for the save at exit, and it is written whole, large tensors' checksums included."""
    import subprocess
    import sys

    from conftest import ROOT

    script = (
        "import torch\nfrom fabric_lite import Accelerator\nacc = Accelerator()\n"
        "model = acc.prepare(torch.nn.Linear(1024, 1024))\n"
        f"acc.save_state({str(tmp_path / 'ckpt')!r}, blocking=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr[-3000:]
    checkpoint_io.verify(str(tmp_path / "ckpt"))


class Versioned(nn.Module):
    """A module whose state format changed: version 1 kept `w` transposed, `_load_from_state_dict` converts."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if (local_metadata or {}).get("version", 1) < 2 and prefix + "w" in state_dict:
            state_dict[prefix + "w"] = state_dict[prefix + "w"].t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_module_versions_travel_with_the_weights(tmp_path, background, compiled):
    acc = Accelerator()
    model = nn.Sequential(Versioned())
    model = acc.prepare(torch.compile(model, backend="eager") if compiled else model)
    acc.save_state(tmp_path / "ckpt", blocking=not background)
    acc.wait_for_checkpoint()
    acc2 = Accelerator()
    other = acc2.prepare(nn.Sequential(Versioned()))
    with torch.no_grad():
        other[0].w.zero_()
    acc2.load_state(tmp_path / "ckpt")
    assert torch.equal(other[0].w, torch.arange(6.0).reshape(2, 3))  # not "migrated" as if it were version 1


def test_a_background_snapshot_copies_tied_weights_once_and_takes_sparse_tensors(tmp_path):
    class Sparse:
        def __init__(self):
            self.table = torch.eye(4).to_sparse()

        def state_dict(self):
            return {"table": self.table}

        def load_state_dict(self, state):
            self.table = state["table"]

    torch.manual_seed(0)
    acc = Accelerator()
    model = nn.Sequential(nn.Embedding(512, 256), nn.Linear(256, 512, bias=False))
    model[1].weight = model[0].weight  # tied input and output embeddings
    sparse = Sparse()
    acc.register_for_checkpointing(sparse)
    model = acc.prepare(model)
    acc.save_state(tmp_path / "blocking")
    acc.save_state(tmp_path / "background", blocking=False)
    acc.wait_for_checkpoint()
    size = {name: (tmp_path / name / "model_0.pt").stat().st_size for name in ("blocking", "background")}
    assert abs(size["background"] - size["blocking"]) < 4096  # one copy of the tied matrix in both (512 KiB)
    assert acc.checkpoint_saver.snapshot_bytes < 2 * 512 * 256 * 4
    sparse.table = torch.zeros(4, 4).to_sparse()
    acc.load_state(tmp_path / "background")
    assert torch.equal(sparse.table.to_dense(), torch.eye(4))


def test_skip_after_one_rank_waited_for_the_save_in_flight_does_not_hang(tmp_path):
    from test_resume import Run

    results = Run("async_save.py", tmp_path / "out", "--root", tmp_path / "root", "--skip", nproc=2,
                  launcher="torchrun", timeout=120).ok()
    assert results[0]["second"] == results[1]["second"]  # the same choice on both ranks
