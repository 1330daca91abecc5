"""Kill a run at any point, resume it from its last checkpoint, and end with the weights of a run that was
never interrupted, bit for bit (CPU): the trainer door (fit(ckpt_path="last"), elastic restarts,
preemption by SIGTERM/SIGUSR1) and the raw door (save_state / load_state), on 1 and 2 processes, with a
crash at every filesystem operation of a checkpoint save, and the errors bad checkpoints must give.

Killed runs are real processes (tests/workers/resume_*.py) that SIGKILL themselves; every launch has a
timeout and the launcher's whole process group is killed when it runs out, so a hang fails fast. The
uninterrupted references are computed once per configuration (module-scoped cache), started in the
background when first needed so that they overlap with the killed run. Only the tests measured above 20 s
(2 CPU cores, whole file) are marked slow; the whole file takes about 2.5 minutes there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, WORKERS, free_port

# What a launcher (or an elastic agent) sets: the workers must see only what their own launcher sets.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCHELASTIC_RUN_ID", "FABRIC_LITE_MIXED_PRECISION", "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS",
               "FABRIC_LITE_USE_CPU")


# -- running workers ---------------------------------------------------------------------------------------

class Run:
    """One worker command (a lone process, torchrun or fabric-lite launch), started now, read with `wait()`."""

    def __init__(self, script, out_dir, *args, nproc=1, launcher=None, launcher_args=(), timeout=150, env=None):
        self.out_dir, self.nproc, self.timeout = Path(out_dir), nproc, timeout
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if launcher is None:
            cmd = [sys.executable, str(WORKERS / script)]
        else:
            head = ["-m", "torch.distributed.run"] if launcher == "torchrun" else ["-m", "fabric_lite.cli", "launch"]
            cmd = [sys.executable, *head, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), *launcher_args, str(WORKERS / script)]
        cmd += ["--out", str(self.out_dir), *map(str, args)]
        self.cmd = cmd
        env_extra, env = env, {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",  # gloo on CPUs
                    # `fabric-lite launch` reads a user config file: never the developer's own
                    "FABRIC_LITE_CONFIG_DIR": str(self.out_dir / "no-fabric-lite-config")})
        env.update(env_extra or {})
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._done = None

    def wait(self):
        """(exit status, output, [each rank's JSON or None]); a run that outlives its timeout fails the test."""
        if self._done is None:
            try:
                output, _ = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)   # the launcher and every worker it started
                output, _ = self.proc.communicate()
                pytest.fail(f"{' '.join(self.cmd)} did not finish in {self.timeout}s (a hang?)\n{output[-6000:]}")
            results = []
            for rank in range(self.nproc):
                path = self.out_dir / f"rank{rank}.json"
                results.append(json.loads(path.read_text()) if path.exists() else None)
            self._done = (self.proc.returncode, output, results)
        return self._done

    def ok(self):
        """Each rank's JSON, failing the test (with the output) unless the run exited 0 and every rank reported."""
        code, output, results = self.wait()
        if code != 0 or any(r is None for r in results):
            pytest.fail(f"run failed ({code}): {' '.join(self.cmd)}\n{output[-8000:]}")
        return results

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per configuration, started on first request and shared by the tests."""
    started = {}
    root = tmp_path_factory.mktemp("references")

    def start(script, nproc, *args, launcher=None):
        key = (script, nproc, args, launcher)
        if key not in started:
            name = f"ref{len(started)}"
            run_args = ("--root", root / name, *args)
            started[key] = Run(script, root / f"{name}_out", *run_args, nproc=nproc, launcher=launcher)
        return started[key]

    yield start
    for run in started.values():
        run.kill()


def as_tensor(values):
    return torch.tensor(values, dtype=torch.float64)   # float32 values, exactly


def assert_bit_equal(got, expected, what=""):
    got, expected = as_tensor(got), as_tensor(expected)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert torch.equal(got, expected), f"{what}: max |diff| = {(got - expected).abs().max().item():.3g}"


def latest_name(checkpoints: Path):
    return json.loads((checkpoints / "latest").read_text())["name"]


def dirs(path: Path):
    return sorted(p.name for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def killed_by(code, sig):
    """A lone process killed by `sig` shows -sig; a shell would show 128 + sig."""
    return code in (-sig, 128 + sig)


def torchrun_exit_codes(output):
    """Each rank's exit code from torchrun's failure report, and the root cause's (first observed failure)."""
    found = re.findall(r"rank\s+:\s+(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s+:\s+(-?\d+)", output)
    codes = {int(rank): int(code) for rank, code in found}
    root = re.search(r"Root Cause.*?exitcode\s+:\s+(-?\d+)", output, re.S)
    return codes, int(root.group(1)) if root else None


def assert_preempted_exit(output, results, nproc=2):
    """Every rank reached `SystemExit(EXIT_PREEMPTED)`, and torchrun's report says so.

    The first rank to exit makes torchrun SIGTERM the others; one that is still shutting down (its signal
    handlers already restored to the default) may then be reported as killed by SIGTERM (-15)."""
    from fabric_lite import EXIT_PREEMPTED

    assert all(r is not None for r in results), output[-6000:]
    assert [r["exit"] for r in results] == [EXIT_PREEMPTED] * nproc, results
    codes, root = torchrun_exit_codes(output)
    assert sorted(codes) == list(range(nproc)) and root == EXIT_PREEMPTED, (codes, root, output[-4000:])
    assert set(codes.values()) <= {EXIT_PREEMPTED, -signal.SIGTERM}, (codes, output[-4000:])


# -- 1. the trainer door, one process, SIGKILL ----------------------------------------------------------
# 48 samples in batches of 4 with accumulate_grad_batches=2: 12 batches, 6 optimizer steps an epoch, 18 in all.
# ModelCheckpoint(every_n_train_steps=4, save_top_k=1) saves at steps 4, 8, 12, 16. The worker kills itself
# after the first micro-batch that follows step 9 (batch 6 of epoch 1): not a checkpoint step, mid-epoch and
# in the middle of an accumulation window. The newest checkpoint (step 8) is itself mid-epoch (batch 3 of 1).

ONE_PROCESS_VARIANTS = {
    "workers0": ("--workers", "0"),
    "workers2": ("--workers", "2"),
    "fp16-mixed": ("--precision", "16-mixed"),
}


@pytest.mark.parametrize("variant", list(ONE_PROCESS_VARIANTS))
def test_trainer_sigkill_mid_window_then_ckpt_path_last_is_bit_exact(tmp_path, references, variant):
    flags = ONE_PROCESS_VARIANTS[variant]
    reference = references("resume_trainer.py", 1, *flags)
    root = tmp_path / "run"
    code, output, results = Run("resume_trainer.py", tmp_path / "killed", "--root", root, "--kill-step", 9,
                                *flags).wait()
    assert killed_by(code, signal.SIGKILL), (code, output[-4000:])
    assert results == [None], "the killed run must not have got to its end"
    assert "at step 9, batch 6 of epoch 1" in output
    checkpoints = root / "checkpoints"
    assert dirs(checkpoints) == ["epoch=1-step=8"] and latest_name(checkpoints) == "epoch=1-step=8"

    (resumed,) = Run("resume_trainer.py", tmp_path / "resumed", "--root", root, "--kill-step", 9,
                     "--ckpt-path", "last", *flags).ok()
    (straight,) = reference.ok()
    assert resumed["start"] == [8, 1]          # from the step-8 checkpoint, in epoch 1
    assert resumed["global_step"] == straight["global_step"] == 18
    assert_bit_equal(resumed["weights"], straight["weights"], variant)
    assert resumed["lr"] == straight["lr"]
    if variant == "fp16-mixed":
        # the loss scale went down (skipped steps happened), and the scaler continued exactly
        assert straight["scale"] < 65536.0 and resumed["scale"] == straight["scale"]


# -- 2. the trainer door, two processes, SIGKILL on one rank ---------------------------------------------
# 2 processes x 6 batches an epoch, accumulate 2: 3 steps an epoch, 9 in all; checkpoints at steps 4 and 8.
# Rank 1 kills itself after the first micro-batch that follows step 5 (batch 4 of epoch 1); torchrun tears
# the job down.

@pytest.mark.slow
def test_trainer_two_processes_sigkill_on_one_rank_then_ckpt_path_last_is_bit_exact(tmp_path, references):
    reference = references("resume_trainer.py", 2, launcher="torchrun")
    root = tmp_path / "run"
    code, output, results = Run("resume_trainer.py", tmp_path / "killed", "--root", root, "--kill-step", 5,
                                "--kill-rank", 1, nproc=2, launcher="torchrun").wait()
    assert code != 0 and "SIGKILL" in output, output[-4000:]
    assert results == [None, None]
    assert latest_name(root / "checkpoints") == "epoch=1-step=4"

    resumed = Run("resume_trainer.py", tmp_path / "resumed", "--root", root, "--ckpt-path", "last", nproc=2,
                  launcher="torchrun").ok()
    straight = reference.ok()
    for rank in (0, 1):
        assert resumed[rank]["start"] == [4, 1], resumed[rank]
        assert resumed[rank]["global_step"] == straight[rank]["global_step"] == 9
        assert_bit_equal(resumed[rank]["weights"], straight[rank]["weights"], f"rank {rank}")
    assert resumed[0]["weights"] == resumed[1]["weights"]


# -- 3. the raw door: save_state every 4 steps (automatic naming, total_limit=2), SIGKILL, load_state() ----

@pytest.mark.parametrize("nproc,background", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["1-blocking", "2-blocking", "1-background", "2-background"])
def test_raw_door_sigkill_then_load_state_continues_bit_exact(tmp_path, nproc, background):
    root = tmp_path / "project"
    launcher = "torchrun" if nproc == 2 else None
    kill_step = 9 if nproc == 1 else 5            # 6 (1 process) or 3 (2 processes) optimizer steps an epoch
    if background and nproc == 2:
        kill_step = 8                             # after the second save (steps 4 and 8), perhaps still in flight
    flags = ["--async-save"] if background else []
    code, output, results = Run("resume_raw.py", tmp_path / "killed", "--root", root, "--kill-step", kill_step,
                                "--kill-rank", nproc - 1, *flags, nproc=nproc, launcher=launcher).wait()
    assert (killed_by(code, signal.SIGKILL) if nproc == 1 else code != 0), (code, output[-4000:])
    assert "SIGKILLs itself" in output and all(r is None for r in results)
    checkpoints = root / "checkpoints"
    newest = "checkpoint_1" if nproc == 1 else "checkpoint_0"
    if background:  # the newest save may have been in flight when the process died: then the one before
        published = [d for d in dirs(checkpoints) if (checkpoints / d / "manifest.json").is_file()]
        newest = max(published, key=lambda d: int(d.rsplit("_", 1)[1]))
        # a kill between publishing a checkpoint and updating `latest` leaves `latest` one behind; load_state
        # still takes the newer, whole checkpoint
        assert latest_name(checkpoints) in (newest, f"checkpoint_{int(newest.rsplit('_', 1)[1]) - 1}")
    else:
        assert latest_name(checkpoints) == newest

    # load_state() (the newest whole checkpoint), then the same loop: the loader continues by itself
    resumed = Run("resume_raw.py", tmp_path / "resumed", "--root", root, "--resume", *flags, nproc=nproc,
                  launcher=launcher).ok()
    for rank, r in enumerate(resumed):
        assert r["loaded"] == str(checkpoints / newest)
        if background:
            pass  # where it resumed depends on when the kill came; that it ends exact does not
        elif nproc == 1:
            assert r["restored"] == {"steps": 8, "epoch": 1, "batches_seen": 4}
            assert r["checkpoints"] == ["checkpoint_2", "checkpoint_3", "latest"]   # total_limit=2
        else:
            assert r["restored"] == {"steps": 4, "epoch": 1, "batches_seen": 2}
            assert r["checkpoints"] == ["checkpoint_0", "checkpoint_1", "latest"]
        assert_bit_equal(r["resumed"], r["uninterrupted"], f"rank {rank}")
    if nproc == 2:
        assert resumed[0]["resumed"] == resumed[1]["resumed"]


def test_raw_door_two_processes_with_augmenting_loader_workers_resume_bit_exact(tmp_path):
    """Each process's loader workers draw their own random stream (a sample-dependent number of draws): each
    process resumes its own workers' states, not the main process's."""
    root = tmp_path / "project"
    flags = ["--workers", 2, "--augment"]
    code, output, results = Run("resume_raw.py", tmp_path / "killed", "--root", root, "--kill-step", 5,
                                "--kill-rank", 1, *flags, nproc=2, launcher="torchrun").wait()
    assert code != 0 and "SIGKILLs itself" in output, output[-4000:]
    resumed = Run("resume_raw.py", tmp_path / "resumed", "--root", root, "--resume", *flags, nproc=2,
                  launcher="torchrun").ok()
    for rank, r in enumerate(resumed):
        assert r["restored"] == {"steps": 4, "epoch": 1, "batches_seen": 2}
        assert_bit_equal(r["resumed"], r["uninterrupted"], f"rank {rank}")


# -- 4. a crash at every filesystem operation of a checkpoint save --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_crash_at_every_operation_of_a_checkpoint_save_then_ckpt_path_last_is_exact(tmp_path, background):
    # Events 2 and 3 of a run that saves at steps 2, 4, 6 (top-1 plus `last`): each trial kills the run at one
    # operation of those saves, in a fresh directory, and a new process resumes it with ckpt_path="last".
    # In the background variant the operations are those of the background thread, while training goes on.
    code, output, (report,) = Run("resume_crash_save.py", tmp_path / "out", "--root", tmp_path / "trials",
                                  "--events", "2,3", *(["--async-save"] if background else []), timeout=150).wait()
    assert code == 0 and report is not None, output[-6000:]
    assert report["count_exit"] == 0, output[-6000:]
    ops = report["counted"]["ops"]
    assert len(ops) >= 40, ops
    assert report["counted"]["weights"] == report["reference"]   # the wrapping alone changes nothing
    kinds = {o.split(": ", 1)[1].split(" ")[0] for o in ops}
    assert {"makedirs", "torch.save", "open(wb)", "write", "close", "mv", "rm", "_move_dir", "update_latest",
            "CheckpointWriter.write", "CheckpointWriter.commit"} <= kinds, kinds
    assert any(o.split(": ", 1)[1].startswith("torch.save half of") for o in ops)  # a torn file
    assert any(o.startswith("2: rm half of") for o in ops) and any("-> last.old-" in o for o in ops)
    assert sorted(report["trials"], key=int) == [str(n) for n in range(1, len(ops) + 1)]
    failures = []
    for n, op in enumerate(ops, 1):
        t = report["trials"][str(n)]
        event = int(op.split(":")[0])
        problems = []
        if not killed_by(t["crash_exit"], signal.SIGKILL):
            problems.append(f"crashed run ended with {t['crash_exit']}, not SIGKILL")
        if t["resume_exit"] != 0 or "error" in t:
            problems.append(f"resume failed ({t['resume_exit']}): {t.get('error')}")
        else:
            # from the checkpoint before the watched event, or the one it wrote: never from scratch
            if t["start"] not in (2 * (event - 1), 2 * event):
                problems.append(f"resumed from step {t['start']}")
            if t["global_step"] != 6:
                problems.append(f"ended at step {t['global_step']}")
            if t["weights"] != report["reference"]:
                diff = (as_tensor(t["weights"]) - as_tensor(report["reference"])).abs().max().item()
                problems.append(f"weights differ (max {diff:.3g})")
        if problems:
            failures.append(f"op {n} ({op}): {'; '.join(problems)}; warnings={t.get('warnings')}; "
                            f"dir before resume={t.get('before')}")
    assert not failures, "\n".join(failures)


# -- 5. elastic restart: the Trainer resumes by itself ---------------------------------------------------

def test_elastic_restart_after_a_sigkill_resumes_from_the_newest_checkpoint(tmp_path, references):
    reference = references("resume_trainer.py", 2, launcher="torchrun")
    root = tmp_path / "run"
    # the worker calls fit() without ckpt_path; rank 1 kills itself only while TORCHELASTIC_RESTART_COUNT == 0
    run = Run("resume_trainer.py", tmp_path / "out", "--root", root, "--kill-step", 5, "--kill-rank", 1,
              "--once-by", "restart", nproc=2, launcher="fabric-lite", launcher_args=("--max-restarts", "2"),
              timeout=180)
    results = run.ok()
    output = run.wait()[1]
    assert "sends SIGKILL to itself" in output, output[-6000:]
    assert "resuming from the newest checkpoint" in output, output[-6000:]
    straight = reference.ok()
    for rank in (0, 1):
        r = results[rank]
        assert (r["restart"], r["start"], r["global_step"]) == ("1", [4, 1], 9), (rank, r, output[-6000:])
        assert_bit_equal(r["weights"], straight[rank]["weights"], f"rank {rank}")


# -- 6. preemption: SIGTERM / SIGUSR1 -> a `preempted` checkpoint on every rank, exit 75, exact resume ----

@pytest.mark.parametrize("agreement", ["default", "every-step"])
def test_sigterm_on_one_rank_preempts_both_and_ckpt_path_last_is_bit_exact(tmp_path, references, agreement):
    # default: the processes compare flags about once a second, so with this tiny model they agree at the end
    # of the epoch; every-step (check_seconds=0): at the very step, in the middle of an accumulation window.
    extra = ("--check-seconds", 0) if agreement == "every-step" else ()
    reference = references("resume_trainer.py", 2, launcher="torchrun")
    root = tmp_path / "run"
    code, output, results = Run("resume_trainer.py", tmp_path / "preempted", "--root", root, "--kill-step", 5,
                                "--kill-rank", 1, "--kill-signal", "TERM", *extra, nproc=2,
                                launcher="torchrun").wait()
    assert code != 0, output[-4000:]
    assert_preempted_exit(output, results)
    stopped = results[0]["global_step"]
    assert results[1]["global_step"] == stopped
    assert "a signal on another process received; saved" in output   # rank 0 never got the signal itself
    checkpoints = root / "checkpoints"
    manifest = json.loads((checkpoints / "preempted" / "manifest.json").read_text())
    assert {"rng_0.pt", "rng_1.pt"} <= set(manifest["files"]), manifest
    assert manifest["meta"]["global_step"] == stopped
    assert latest_name(checkpoints) == "preempted"
    if agreement == "every-step":
        # the signal came in at batch 4, the first micro-batch of a window after step 5: the processes stop
        # there (or, just as good, at the end of that window)
        assert stopped in (5, 6), stopped

    resumed = Run("resume_trainer.py", tmp_path / "resumed", "--root", root, "--ckpt-path", "last", nproc=2,
                  launcher="torchrun").ok()
    straight = reference.ok()
    for rank in (0, 1):
        assert resumed[rank]["start"][0] == stopped
        assert_bit_equal(resumed[rank]["weights"], straight[rank]["weights"], f"rank {rank}")


@pytest.mark.parametrize("where", ["window-end", "mid-window"])
def test_sigusr1_on_one_process_saves_preempted_and_resume_is_bit_exact(tmp_path, references, where):
    # one process stops at the batch the signal came in: right after step 9 (batch 5 of epoch 1), or after the
    # first micro-batch of the window that follows it (batch 6)
    from fabric_lite import EXIT_PREEMPTED

    reference = references("resume_trainer.py", 1, "--workers", "0")
    root = tmp_path / "run"
    code, output, (result,) = Run("resume_trainer.py", tmp_path / "preempted", "--root", root, "--kill-step", 9,
                                  "--kill-signal", "USR1", "--kill-where", where).wait()
    assert code == EXIT_PREEMPTED, (code, output[-4000:])
    stopped = result["global_step"]
    assert result["exit"] == EXIT_PREEMPTED
    assert stopped == 9 if where == "window-end" else stopped in (9, 10)   # mid-window: there, or at its end
    assert "SIGUSR1 received; saved" in output and f"status {EXIT_PREEMPTED}" in output
    checkpoints = root / "checkpoints"
    assert latest_name(checkpoints) == "preempted"
    manifest = json.loads((checkpoints / "preempted" / "manifest.json").read_text())
    assert "rng_0.pt" in manifest["files"] and manifest["meta"]["global_step"] == stopped

    (resumed,) = Run("resume_trainer.py", tmp_path / "resumed", "--root", root, "--ckpt-path", "last").ok()
    (straight,) = reference.ok()
    assert resumed["start"] == [stopped, 1]
    assert_bit_equal(resumed["weights"], straight["weights"])


def test_check_preemption_is_true_on_both_ranks_at_the_same_call(tmp_path):
    code, output, results = Run("resume_raw.py", tmp_path / "out", "--root", tmp_path / "project", "--preempt",
                                "--kill-rank", 1, nproc=2, launcher="torchrun").wait()
    assert code != 0 and all(r is not None for r in results), output[-6000:]
    assert_preempted_exit(output, results)
    r0, r1 = results
    assert r0["seen_at"] is not None and r0["seen_at"] == r1["seen_at"] and r0["seen_at"] >= 5, results
    assert r0["saved"] == r1["saved"]
    manifest = json.loads((Path(r0["saved"]) / "manifest.json").read_text())
    assert {"rng_0.pt", "rng_1.pt"} <= set(manifest["files"])


def test_fabric_lite_launch_exits_75_when_every_worker_was_preempted(tmp_path):
    """A scheduler requeues on 75: the launcher says so when every worker stopped for preemption and saved
    (torchrun itself, and this launcher before, exit 1 as for a crash)."""
    from fabric_lite import EXIT_PREEMPTED

    code, output, results = Run("resume_raw.py", tmp_path / "out", "--root", tmp_path / "project", "--preempt",
                                "--kill-rank", 1, nproc=2, launcher="fabric-lite").wait()
    assert code == EXIT_PREEMPTED, (code, output[-6000:])
    assert all(r is not None and r["exit"] == EXIT_PREEMPTED for r in results), results
    assert "every worker stopped for preemption after saving" in output and "requeue" in output


# -- 7. bad input: a clear error, and nothing overwritten ----------------------------------------------

def _accelerator(dropout=False, lr=0.1, seed=0, **kwargs):
    """Linear-ReLU-(Dropout)-Linear, SGD and a StepLR, prepared; without Dropout the last layer is "2", not "3"."""
    from torch import nn

    from fabric_lite import Accelerator

    torch.manual_seed(seed)
    acc = Accelerator(**kwargs)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), *([nn.Dropout(0.1)] if dropout else []), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _snapshot(model, opt, sched):
    return {"weights": [p.detach().clone() for p in model.parameters()], "lr": opt.param_groups[0]["lr"],
            "sched": sched.state_dict()["last_epoch"], "rng": torch.get_rng_state()}


def _unchanged(before, model, opt, sched):
    now = _snapshot(model, opt, sched)
    return {"weights": all(torch.equal(a, b) for a, b in zip(before["weights"], now["weights"])),
            "lr": before["lr"] == now["lr"], "sched": before["sched"] == now["sched"],
            "rng": torch.equal(before["rng"], now["rng"])}


def _hashes(directory: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of a Linear-ReLU-Dropout-Linear model, after one step (lr 0.05 after the scheduler)."""
    acc, model, opt, sched = _accelerator(dropout=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    path = tmp_path / "ckpt"
    acc.save_state(path)
    return path


def test_loading_into_a_different_model_names_the_missing_and_unexpected_keys(tmp_path, saved):
    before_files = _hashes(saved)
    acc, model, opt, sched = _accelerator(lr=0.3, seed=1)   # no Dropout: the last layer is "2", not "3"
    with pytest.raises(RuntimeError) as info:     # CheckpointError is a RuntimeError
        acc.load_state(saved)
    message = str(info.value)
    missing, unexpected = message.lower().index("missing"), message.lower().index("unexpected")
    assert missing < unexpected, message
    assert "2.weight" in message[missing:unexpected] and "2.bias" in message[missing:unexpected], message
    assert "3.weight" in message[unexpected:] and "3.bias" in message[unexpected:], message
    assert _hashes(saved) == before_files


def test_a_failed_load_into_a_different_model_leaves_the_model_as_it_was(tmp_path, saved):
    acc, model, opt, sched = _accelerator(lr=0.3, seed=1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(RuntimeError):
        acc.load_state(saved)
    assert _unchanged(before, model, opt, sched) == {"weights": True, "lr": True, "sched": True, "rng": True}


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path):
    """Damage a few bytes in the middle of a record, leaving the zip's structure intact."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "flipped"])
@pytest.mark.parametrize("name", ["model_0.pt", "training_state.pt", "rng_0.pt"])
def test_a_truncated_file_is_a_checkpoint_error_naming_it(tmp_path, saved, name, damage):
    from fabric_lite.checkpoint.files import CheckpointError, verify

    damage(saved / name)
    with pytest.raises(CheckpointError, match=re.escape(f"{saved}/{name}") + ".*corrupt"):
        verify(str(saved))
    before_files = _hashes(saved)
    acc, model, opt, sched = _accelerator(dropout=True, lr=0.3, seed=1)
    with pytest.raises(CheckpointError, match=re.escape(f"{saved}/{name}") + ".*corrupt"):
        acc.load_state(saved)
    assert _hashes(saved) == before_files


@pytest.mark.parametrize("name", ["model_0.pt", "training_state.pt", "rng_0.pt"])
def test_a_truncated_file_leaves_the_objects_as_they_were(tmp_path, saved, name):
    from fabric_lite.checkpoint.files import CheckpointError

    _truncate(saved / name)
    acc, model, opt, sched = _accelerator(dropout=True, lr=0.3, seed=1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(CheckpointError):
        acc.load_state(saved)
    assert _unchanged(before, model, opt, sched) == {"weights": True, "lr": True, "sched": True, "rng": True}


def test_another_format_version_is_refused_naming_both_versions(tmp_path, saved):
    from fabric_lite.checkpoint.files import FORMAT_VERSION, CheckpointError

    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["format_version"] = 99
    (saved / "manifest.json").write_text(json.dumps(manifest))
    before_files = _hashes(saved)
    acc, model, opt, sched = _accelerator(dropout=True, lr=0.3, seed=1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(CheckpointError, match=rf"format version 99.*reads version {FORMAT_VERSION}"):
        acc.load_state(saved)
    assert _unchanged(before, model, opt, sched) == {"weights": True, "lr": True, "sched": True, "rng": True}
    assert _hashes(saved) == before_files


def test_load_state_where_there_is_no_checkpoint_says_so(tmp_path):
    from fabric_lite import ProjectConfiguration
    from fabric_lite.checkpoint.files import CheckpointError

    acc, model, opt, sched = _accelerator()
    before = _snapshot(model, opt, sched)
    with pytest.raises(CheckpointError, match=re.escape(f"No checkpoint at {tmp_path / 'nowhere'}")):
        acc.load_state(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        acc.load_state(tmp_path / "empty")
    assert (tmp_path / "empty" / "notes.txt").read_text() == "not a checkpoint"
    assert _unchanged(before, model, opt, sched) == {"weights": True, "lr": True, "sched": True, "rng": True}
    # automatic naming, nothing saved yet: load_state() has nothing to pick
    project = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True)
    acc, model, opt, sched = _accelerator(project_config=project)
    with pytest.raises(CheckpointError, match="No whole checkpoint under"):
        acc.load_state()


def test_ckpt_path_last_skips_a_corrupt_newest_checkpoint_with_a_warning_and_still_ends_exact(tmp_path):
    from test_trainer import Dropout, loader, make_trainer, regression_data, weights

    from fabric_lite import set_seed
    from fabric_lite.callbacks import Callback, ModelCheckpoint

    class Crash(Exception):
        pass

    class CrashAt(Callback):
        def __init__(self, step):
            self.step, self.start = step, None

        def on_train_start(self, trainer, module):
            self.start = trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.step is not None and trainer.global_step == self.step and batch_idx % 2 == 0:
                raise Crash()

    def run(root, crash_at=None, ckpt_path=None):
        # 30 samples in batches of 4, accumulate 2: 4 steps an epoch, 8 in all; checkpoints every 2 steps
        set_seed(0)
        module, crash = Dropout(), CrashAt(crash_at)
        trainer = make_trainer(root, [ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), crash], max_epochs=2,
                               accumulate_grad_batches=2, enable_checkpointing=True)
        trainer.fit(module, loader(regression_data(n=30), batch_size=4, shuffle=True, seed=3), ckpt_path=ckpt_path)
        return trainer, module, crash

    _, straight, _ = run(tmp_path / "straight")
    with pytest.raises(Crash):
        run(tmp_path / "run", crash_at=5)       # dies mid-window after step 5; newest checkpoint: step 4
    checkpoints = tmp_path / "run" / "checkpoints"
    assert dirs(checkpoints) == ["epoch=0-step=2", "epoch=0-step=4"] and latest_name(checkpoints) == "epoch=0-step=4"
    _truncate(checkpoints / "epoch=0-step=4" / "model_0.pt")
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*epoch=0-step=4: .*model_0\.pt.*corrupt"):
        trainer, resumed, crash = run(tmp_path / "run", ckpt_path="last")
    assert crash.start == 2                     # the previous checkpoint
    assert trainer.global_step == 8
    assert torch.equal(weights(resumed), weights(straight))
