"""A crash at every filesystem operation of a checkpoint save, then `fit(ckpt_path="last")`.

The library is not changed: this script wraps, in its own process, what the checkpoint writer does to the
disk (serialization, opening, writing, closing files, moves, deletions, `latest`, the writer's methods) and
counts those operations during the watched checkpoint events of a run (`--events`; by default the SECOND one:
ModelCheckpoint saving its top-k checkpoint, pruning the one it displaces, and re-saving `last` over the
existing one; the third one also replaces the `last` that `latest` names). Trial N runs the
training in a fresh directory and SIGKILLs itself at operation N (before it; a first write of a binary file
writes half its bytes first; a recursive delete removes half the files first); then a new process resumes
with ckpt_path="last" and finishes. With `--async-save` the checkpoints are written in the background
(`ModelCheckpoint(async_save=True)`): the operations counted are those of the background save's job, where
the crash then comes while the training thread goes on.

Processes are forked from this one (torch is imported once), so many trials fit in a few seconds. The
uninterrupted reference runs here first, before any patching. Writes rank0.json: the reference weights, the
operation names, and per trial: how the crashed process ended, the step the resume started from, the
warnings it gave, its final weights (or its error), and what its directory held.
"""

import json
import os
import random
import signal
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import parse, regression_data, write_result
from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback, ModelCheckpoint

args = parse({"--root": {"required": True}, "--events": {"default": "2"}, "--trials": {"default": "all"},
              "--parallel": {"type": int, "default": 2}, "--async-save": {"action": "store_true"},
              "--random-kills": {"type": int, "default": 0}, "--seed": {"type": int, "default": 0}})
WATCHED = {int(e) for e in args.events.split(",")}


class Dropout(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Start(Callback):
    def __init__(self):
        self.step = None

    def on_train_start(self, trainer, module):
        self.step = trainer.global_step


def fit(root, ckpt_path=None):
    """24 samples in batches of 4, accumulate 2: 3 optimizer steps an epoch, 6 in all; saves at 2, 4, 6."""
    set_seed(0)
    module, start = Dropout(), Start()
    checkpoint = ModelCheckpoint(every_n_train_steps=2, save_top_k=1, save_last=True, async_save=args.async_save)
    trainer = Trainer(max_epochs=2, accumulate_grad_batches=2, default_root_dir=root, callbacks=[checkpoint, start],
                      enable_progress_bar=False, num_sanity_val_steps=0)
    STATE["trainer"] = trainer
    loader = DataLoader(regression_data(24), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, start.step, torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


# -- the instrumentation --------------------------------------------------------------------------------

STATE = {"event": 0, "active": False, "kill_at": None, "ops": [], "trainer": None}


def die():
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def op(name):
    """Count one operation of the watched save; True if this is the one to crash at."""
    if not STATE["active"]:
        return False
    STATE["ops"].append(f"{STATE['event']}: {name}")
    return STATE["kill_at"] is not None and len(STATE["ops"]) == STATE["kill_at"]


def instrument():
    from fsspec.implementations import local

    from fabric_lite.checkpoint import files as checkpoint_io
    from fabric_lite.callbacks import checkpoint as checkpoint_callback

    def base(path):
        return os.path.basename(str(path).rstrip("/"))

    def before(name_of, fn):
        def wrapped(*a, **kw):
            if op(name_of(*a, **kw)):
                die()
            return fn(*a, **kw)
        return wrapped

    fs_cls, opener = local.LocalFileSystem, local.LocalFileOpener
    fs_cls.mv = before(lambda self, p1, p2, *a, **k: f"mv {base(p1)} -> {base(p2)}", fs_cls.mv)
    fs_cls.makedirs = before(lambda self, p, *a, **k: f"makedirs {base(p)}", fs_cls.makedirs)
    fs_cls.mkdir = before(lambda self, p, *a, **k: f"mkdir {base(p)}", fs_cls.mkdir)

    original_rm = fs_cls.rm

    def rm(self, path, recursive=False, maxdepth=None):
        paths = path if isinstance(path, list) else [path]
        if op(f"rm {[base(p) for p in paths]}"):
            die()
        files = sorted(os.path.join(d, f) for p in paths if os.path.isdir(p) for d, _, fs in os.walk(p) for f in fs)
        if len(files) >= 2 and op(f"rm half of {[base(p) for p in paths]}"):
            for f in files[: len(files) // 2]:
                os.remove(f)
            die()
        return original_rm(self, path, recursive=recursive, maxdepth=maxdepth)

    fs_cls.rm = rm

    original_open = fs_cls._open

    def _open(self, path, mode="rb", *a, **kw):
        if "r" not in mode and op(f"open({mode}) {base(path)}"):
            die()
        f = original_open(self, path, mode, *a, **kw)
        f._fl_name = base(path)
        return f

    fs_cls._open = _open
    original_write, original_close = opener.write, opener.close

    def write(self, data, *a, **kw):
        if not getattr(self, "_fl_written", False):
            self._fl_written = True
            if op(f"write {getattr(self, '_fl_name', '?')}"):
                raw = bytes(data)
                original_write(self, raw[: len(raw) // 2])
                self.f.flush()
                die()
        return original_write(self, data, *a, **kw)

    def close(self):
        if "r" not in self.mode and not self.closed and op(f"close {getattr(self, '_fl_name', '?')}"):
            die()
        return original_close(self)

    original_exit = opener.__exit__

    def exit_(self, *exc):   # `with fs.open(...) as f:` closes the inner file here, not through close()
        if "r" not in self.mode and not self.closed and op(f"close {getattr(self, '_fl_name', '?')}"):
            die()
        return original_exit(self, *exc)

    opener.write, opener.close, opener.__exit__ = write, close, exit_

    original_torch_save = torch.save

    def torch_save(obj, f, *a, **kw):   # the writer hands local files to torch's own writer, by path
        if isinstance(f, (str, os.PathLike)):
            if op(f"torch.save {base(f)}"):
                die()
            if op(f"torch.save half of {base(f)}"):   # a file torn part-way
                original_torch_save(obj, f, *a, **kw)
                with open(f, "r+b") as handle:
                    handle.truncate(os.path.getsize(f) // 2)
                die()
        return original_torch_save(obj, f, *a, **kw)

    torch.save = torch_save

    if hasattr(checkpoint_io, "_to_bytes"):   # the writer may stream instead of serializing first
        checkpoint_io._to_bytes = before(lambda obj: "_to_bytes", checkpoint_io._to_bytes)
    checkpoint_io.move_dir = before(lambda fs, s, d: f"_move_dir {base(s)} -> {base(d)}", checkpoint_io.move_dir)
    checkpoint_io.update_latest = before(lambda url, *a, **k: f"update_latest {base(url)}", checkpoint_io.update_latest)
    writer = checkpoint_io.CheckpointWriter
    writer.write = before(lambda self, name, obj: f"CheckpointWriter.write {name}", writer.write)
    writer.commit = before(lambda self, *a, **k: f"CheckpointWriter.commit {base(self.path)}", writer.commit)

    if args.async_save:  # the save's operations run on the background thread, in its job
        from fabric_lite.checkpoint import saver

        owner, name = saver, "run_job"
    else:
        owner, name = checkpoint_callback.ModelCheckpoint, "_save"
    original_save = getattr(owner, name)

    def watched_save(*a, **kw):
        STATE["event"] += 1
        STATE["active"] = STATE["event"] in WATCHED
        try:
            return original_save(*a, **kw)
        finally:
            STATE["active"] = False

    setattr(owner, name, watched_save)


# -- trials -----------------------------------------------------------------------------------------------

def in_child(fn):
    """Run fn() in a forked process; returns its pid. The child never returns into this script."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def listing(root):
    out = {}
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        out[rel] = sorted(files)
    return out


def count_run(root, report):
    instrument()
    _, _, w = fit(root)
    with open(report, "w") as f:
        json.dump({"ops": STATE["ops"], "weights": w}, f)


def crash_run(root, n):
    instrument()
    STATE["kill_at"] = n
    fit(root)   # must not get here: the process kills itself at operation n


def crash_run_at(root, delay, in_a_save=False):
    """Train, and SIGKILL this process `delay` seconds in, whatever it is doing (noting whether a background
    save was in flight); a run that ends first exits normally. `in_a_save`: `delay` seconds after a background save
    was first seen in flight instead (the moments a plain delay hits depend on the machine's load)."""
    import threading

    def kill():
        if in_a_save:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                trainer = STATE["trainer"]
                if trainer is not None and trainer.accelerator.checkpoint_saver.in_flight:
                    break
                time.sleep(0.0005)
            time.sleep(delay)
        trainer = STATE["trainer"]
        saver = trainer.accelerator.checkpoint_saver if trainer is not None else None
        with open(os.path.join(root, "killed.json.tmp"), "w") as f:
            json.dump({"in_flight": bool(saver and saver.in_flight), "step": trainer and trainer.global_step}, f)
        os.replace(os.path.join(root, "killed.json.tmp"), os.path.join(root, "killed.json"))
        die()

    timer = threading.Timer(0.0 if in_a_save else delay, kill)
    timer.start()
    fit(root)
    timer.cancel()
    timer.join()  # a kill that had already begun finishes (the process dies here) before this one may exit


def resume_run(root, report):
    before = listing(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer, start, w = fit(root, ckpt_path="last")
            result = {"start": start, "global_step": trainer.global_step, "weights": w}
        except Exception as err:
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    result["before"] = before
    with open(report, "w") as f:
        json.dump(result, f)


def wait(pid):
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# 1. the reference, in this process before anything is patched (also loads every lazily imported module)
_, _, reference = fit(os.path.join(args.root, "reference"))
began = time.perf_counter()  # a second run times a warm one, as the forked trials are
fit(os.path.join(args.root, "reference-timed"))
duration = time.perf_counter() - began

# 2. the operations of the watched save, from an instrumented run that never crashes
report = os.path.join(args.root, "count.json")
code = wait(in_child(lambda: count_run(os.path.join(args.root, "count"), report)))
counted = json.load(open(report)) if code == 0 else {"ops": [], "weights": None}

trials = range(1, len(counted["ops"]) + 1) if args.trials == "all" else [int(t) for t in args.trials.split(",")]
results = {}


delays = {}
if args.random_kills:  # kills at random moments of the whole run instead of at each counted operation
    rng = random.Random(args.seed)
    trials = range(1, args.random_kills + 1)
    # every third trial is killed a few milliseconds after a background save starts; the others at a moment drawn
    # over the whole run
    delays = {n: rng.uniform(0.0, 0.01) if n % 3 == 0 else rng.uniform(0.0, 1.2 * duration) for n in trials}


def run_trial(n):
    root = os.path.join(args.root, f"trial{n:03d}")
    os.makedirs(root)
    crash = wait(in_child(lambda: crash_run_at(root, delays[n], in_a_save=n % 3 == 0) if delays else crash_run(root, n)))
    report = os.path.join(args.root, f"trial{n:03d}.json")
    resumed = wait(in_child(lambda: resume_run(root, report)))
    result = json.load(open(report)) if os.path.exists(report) else {"error": f"resume process ended with {resumed}"}
    killed = os.path.join(root, "killed.json")
    result.update(crash_exit=crash, resume_exit=resumed, after=listing(root),
                  killed=json.load(open(killed)) if os.path.exists(killed) else None)
    return result


# a few trials side by side (each trial is a chain of two processes): fork a runner per slot
pending = list(trials)
slots = {}
while pending or slots:
    while pending and len(slots) < max(1, args.parallel):
        n = pending.pop(0)

        def runner(n=n):
            try:
                result = run_trial(n)
            except Exception:
                result = {"error": f"the trial runner failed: {traceback.format_exc()}"}
            with open(os.path.join(args.root, f"result{n:03d}.json"), "w") as f:
                json.dump(result, f)

        slots[in_child(runner)] = n
    pid, _ = os.wait()
    n = slots.pop(pid, None)
    if n is not None:
        path = os.path.join(args.root, f"result{n:03d}.json")
        results[n] = json.load(open(path)) if os.path.exists(path) else {"error": "trial runner died"}

write_result(args.out, 0, {"reference": reference, "duration": duration, "count_exit": code, "counted": counted,
                           "trials": {str(n): results[n] for n in sorted(results)}})
