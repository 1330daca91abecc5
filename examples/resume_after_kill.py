"""Exact resume after a kill: a Trainer run that is SIGKILLed mid-run and started again ends with the same
weights, bit for bit (on CPU), as a run that was never interrupted.

    python examples/resume_after_kill.py

This process is only the driver. It runs this file as a child process (`--worker`), which trains with the
Trainer and saves a checkpoint every 10 steps (ModelCheckpoint, written in the background). The driver
SIGKILLs the child in the middle of the run: nothing gets a chance to clean up, as when a machine dies or the
scheduler takes it away. It then starts the same command again: `fit(ckpt_path="last")` finds the newest whole
checkpoint and goes on from it (weights, optimizer, LR schedule, the data order and position within the epoch,
every random generator). Meanwhile the same command runs uninterrupted in another directory; at the end the
driver compares the two runs' final weights.
Everything goes under runs/resume_after_kill.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Callback, Trainer, TrainModule, set_seed
from fabric_lite.callbacks import ModelCheckpoint

RUNS = "runs/resume_after_kill"
KILL_AFTER_STEP = 55       # a checkpoint every 10 steps, 40 steps per epoch: the killed run resumes from step 50


class Classifier(TrainModule):
    """Dropout, a shuffled loader and a per-step LR schedule: all random or stateful, all must resume exactly."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ReportSteps(Callback):
    """Prints each optimizer step so that the driver knows when to kill. The short pause stands in for a
    real model's step time: without it this small run could end before the driver's kill arrives."""

    def on_train_start(self, trainer, module):
        print(f"worker: training from step {trainer.global_step} (epoch {trainer.current_epoch})", flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step}", flush=True)
        time.sleep(0.02)


def worker(root: str) -> None:
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=g)
    y = (x[:, :3] + 0.3 * torch.randn(640, 3, generator=g)).argmax(dim=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)   # 40 steps per epoch

    module = Classifier()
    trainer = Trainer(max_epochs=3, default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(every_n_train_steps=10), ReportSteps()])
    trainer.fit(module, loader, ckpt_path="last")   # resumes when `root` holds a checkpoint, else starts fresh
    if trainer.is_global_zero:
        torch.save(module.state_dict(), os.path.join(root, "final_weights.pt"))
        print(f"worker: finished at step {trainer.global_step}", flush=True)


def start_worker(root: str, **popen_args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--root", root], text=True,
                            **popen_args)


def run_worker(root: str, kill_after_step=None) -> int:
    """Run `--worker` in a child process, echoing its output; SIGKILL it once it reports `kill_after_step`."""
    child = start_worker(root, stdout=subprocess.PIPE)
    for line in child.stdout:
        if not line.startswith("step "):
            print(line, end="")
        if kill_after_step is not None and line.startswith("step ") and int(line.split()[1]) >= kill_after_step:
            child.send_signal(signal.SIGKILL)   # no handler runs, nothing is flushed: as if the machine died
            print(f"driver: the worker reported step {line.split()[1]}: SIGKILL")
            break
    child.stdout.close()
    return child.wait(timeout=120)


def same_weights(a: str, b: str) -> bool:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="train (the child process)")
    parser.add_argument("--root", default=f"{RUNS}/killed", help="the worker's run directory")
    args = parser.parse_args()
    if args.worker:
        worker(args.root)
        return

    shutil.rmtree(RUNS, ignore_errors=True)   # start from nothing, also when run a second time
    killed, uninterrupted = f"{RUNS}/killed", f"{RUNS}/uninterrupted"

    # The reference run, never interrupted, trains meanwhile in the background (its output is not shown).
    reference = start_worker(uninterrupted, stdout=subprocess.DEVNULL)
    try:
        status = run_worker(killed, kill_after_step=KILL_AFTER_STEP)
        if status != -signal.SIGKILL:
            sys.exit(f"the worker was meant to die by SIGKILL mid-run, but it exited with status {status}")
        print(f"driver: checkpoints left by the killed run: {sorted(os.listdir(f'{killed}/checkpoints'))}")
        if run_worker(killed) != 0:              # the same command again: it resumes
            sys.exit("the resumed run failed")
        if reference.wait(timeout=120) != 0:
            sys.exit("the uninterrupted run failed")
    finally:
        if reference.poll() is None:             # leaving early: do not leave the reference run behind
            reference.kill()

    equal = same_weights(f"{killed}/final_weights.pt", f"{uninterrupted}/final_weights.pt")
    print(f"resumed run equals the uninterrupted run: {equal}")
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
