"""Background sharded saves (tests/checkpoint/test_background_sharded.py): FSDP2 (DCP shards) and DeepSpeed
(the engine's own files), on 1 or 2 processes. One `--phase` per launch:

- `train`: `--steps` optimizer steps on data drawn from the step's number; after each step where no save is in
  flight on any process, a background save `step_<n>` starts (the continuous policy, by hand), and once one is
  published the older ones beyond the newest two are deleted. Rank 0 touches `--ready` when training starts, so
  that a killer can pick a moment of the training itself. Killed runs never write their JSON.
- `kills` (no launcher: it starts the runs): `--trials` runs of `train` on `--nproc` processes, the first left to
  finish (its number of saves and their write time set the moments of the others), each other SIGKILLed, every
  process at once, at a random moment of a random save (from the moment its staging folder appears to about one
  write time later); then one `verify` run over them all. Writes rank0.json with the
  counts: ``python tests/workers/bg_sharded.py --out /tmp/k --root /tmp/k/runs --phase kills --trials 100 --strategy fsdp``.
- `verify`: the uninterrupted run's weights (trained here from the same start), then for each `--roots` folder
  every checkpoint in it: loaded, trained on to `--steps`, compared bit for bit. A `step_<n>` folder without its
  manifest counts as unloadable (publishing is a move of a whole folder: none may exist).
"""

import glob
import os
import shutil
import time
from pathlib import Path

import torch

from common import parse, write_result
from fsdp_model import make
from fabric_lite import Accelerator, FSDPStrategy
from fabric_lite.checkpoint import state as state_io
from fabric_lite.checkpoint.files import MANIFEST

args = parse({
    "--phase": {"required": True},
    "--strategy": {"default": "fsdp"},
    "--steps": {"type": int, "default": 12},
    "--root": {"default": None},
    "--roots": {"default": None},
    "--ready": {"default": None},
    "--width": {"type": int, "default": 64},
    "--step-sleep": {"type": float, "default": 0.0},
    "--trials": {"type": int, "default": 10},
    "--nproc": {"type": int, "default": 2},
    "--seed": {"type": int, "default": 0},
})


def accelerator():
    strategy = FSDPStrategy(auto_wrap_policy={"Block"}) if args.strategy == "fsdp" else args.strategy
    acc = Accelerator(strategy=strategy)
    model = make(seed=0, width=args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def batch(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, generator=g).to(device)


def train_step(acc, model, opt, step):
    x = batch(step, acc.device)
    loss = (model(x) - x[:, :3]).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def weights(acc, model):
    state = acc.get_state_dict(model)
    return {k: v.detach().float().reshape(-1).tolist() for k, v in sorted(state.items())}


def published(root):
    found = []
    for path in glob.glob(os.path.join(root, "step_*")):
        name = os.path.basename(path)
        if ".staging-" in name:
            continue
        found.append((int(name.split("_")[1]), path))
    return sorted(found)


def train():
    acc, model, opt = accelerator()
    root = args.root
    if acc.is_main_process and args.ready:
        Path(args.ready).write_text("ready")
    saver = acc.checkpoint_saver
    blocked = []
    for step in range(args.steps):
        train_step(acc, model, opt, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if not saver.busy_anywhere():
            older = [p for _, p in published(root)][:-1]  # once this one is published: keep it and the newest

            def prune(older=older):
                """deleting the older checkpoints"""
                for p in older:
                    shutil.rmtree(p, ignore_errors=True)

            started = time.perf_counter()
            state_io.save_state(acc, os.path.join(root, f"step_{step + 1}"), blocking=False, update_latest=True,
                                after_commit=[prune])
            blocked.append(time.perf_counter() - started)
    acc.wait_for_checkpoint()
    result = {"weights": weights(acc, model), "saves": len(blocked),
              "background": [r.background for r in saver.history],
              "write_s": [r.finished - r.started - r.blocked for r in saver.history]}
    acc.end_training()
    write_result(args.out, acc.process_index, result)


def verify():
    acc, model, opt = accelerator()
    for step in range(args.steps):
        train_step(acc, model, opt, step)
    reference = weights(acc, model)
    report = {"checked": 0, "unloadable": [], "different": [], "trials": 0}
    for root in sorted(glob.glob(args.roots)):
        report["trials"] += 1
        for start, path in published(root):
            if not os.path.exists(os.path.join(path, MANIFEST)):
                report["unloadable"].append(f"{path}: no manifest")
                continue
            try:
                acc.load_state(path)
            except Exception as err:
                report["unloadable"].append(f"{path}: {type(err).__name__}: {err}")
                continue
            for step in range(start, args.steps):
                train_step(acc, model, opt, step)
            report["checked"] += 1
            if acc.is_main_process and weights(acc, model) != reference:
                report["different"].append(path)
            elif not acc.is_main_process:
                weights(acc, model)  # (a collective)
    acc.end_training()
    write_result(args.out, acc.process_index, report)


class Forked:
    """One rank, forked from this process (torch and fabric_lite already imported: a trial starts in a fraction
    of the time a new interpreter takes); `poll` and `wait` as a Popen's."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank process {self.pid} still runs after {timeout} s")
            time.sleep(0.002)
        return self.returncode


def launch(phase, out, *extra):
    """`--nproc` ranks running `phase` (the environment torchrun would give), forked, in a process group of
    their own so that one signal reaches them all. `extra`: option, value pairs."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(out, exist_ok=True)
    options = dict(zip(extra[::2], extra[1::2]))
    procs = []
    for rank in range(args.nproc):
        leader = procs[0].pid if procs else 0
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                os.setpgid(0, leader)
                log = os.open(os.path.join(out, f"log{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                                  LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                args.out, args.phase = out, phase
                for option, value in options.items():
                    setattr(args, option.lstrip("-").replace("-", "_"), value)
                PHASES[phase]()
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(pid, leader or pid)  # (the rank does it too: whichever runs first)
        except OSError:
            pass
        procs.append(Forked(pid))
    return procs


def wait_all(procs, timeout):
    import signal

    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except Exception:
        os.killpg(procs[0].pid, signal.SIGKILL)
        raise


def kills():
    import json
    import random
    import signal

    rng = random.Random(args.seed)
    base = Path(args.root)
    trials = []
    span = None
    for n in range(args.trials):
        root, ready = base / f"t{n:03d}", base / f"ready{n:03d}"
        procs = launch("train", str(base / f"out{n:03d}"), "--root", str(root), "--ready", str(ready))
        deadline = time.monotonic() + 300
        while not ready.exists() and all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.005)
        trial = {"n": n}
        if span is None:  # the first run is left to finish: how many saves it makes, how long each takes
            codes = wait_all(procs, 300)
            first = json.loads((base / "out000" / "rank0.json").read_text())
            span = {"saves": first["saves"], "write_s": sorted(first["write_s"])[len(first["write_s"]) // 2]}
            trial.update(killed=None, codes=codes)
        else:
            # the moment: once the k-th save has begun writing (its staging folder appears), a random time
            # within about one write (its start, its middle, its publish, or just after)
            # (early saves: the run goes on well past the moment, whatever the machine's load does to the times)
            k, delay = rng.randint(1, max(1, min(6, span["saves"] // 2))), rng.uniform(0, 1.25 * span["write_s"])
            seen = set()
            while len(seen) < k and all(p.poll() is None for p in procs):
                if root.exists():
                    seen.update(e for e in os.listdir(root) if ".staging-" in e)
                time.sleep(0.0005)
            time.sleep(delay)
            os.killpg(procs[0].pid, signal.SIGKILL)
            codes = wait_all(procs, 60)
            staging = [p.name for p in root.glob("*.staging-*")] if root.exists() else []
            trial.update(killed=[k, round(delay, 3)], in_flight=bool(staging), codes=codes)
        trials.append(trial)
    out = base / "verify"
    codes = wait_all(launch("verify", str(out), "--roots", str(base / "t*")), 600)
    reports = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
               for r in range(args.nproc)]
    logs = "" if all(reports) else "".join((out / f"log{r}").read_text()[-3000:] for r in range(args.nproc))
    result = {"span": span, "trials": trials, "verify_codes": codes, "verify": reports[0], "logs": logs,
              "killed": sum(t["killed"] is not None for t in trials),
              "in_flight": sum(bool(t.get("in_flight")) for t in trials)}
    write_result(args.out, 0, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("trials", "logs")}, indent=1))


PHASES = {"train": train, "verify": verify, "kills": kills}
if __name__ == "__main__":
    if args.phase == "kills":
        os.environ.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        torch.set_num_threads(1)
        if args.strategy.startswith("deepspeed"):
            import deepspeed  # noqa: F401  (imported once, before the ranks are forked)
    PHASES[args.phase]()
