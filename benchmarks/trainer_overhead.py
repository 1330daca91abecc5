"""What the Trainer costs per training step, next to the same loop written in plain PyTorch.

The tiny MLP of overhead.py (32 -> 64 -> 10, batch 32, AdamW) trained three ways in one process,
timed in interleaved repeats: the raw loop; the Trainer bare (no progress bar, no checkpoints,
logging every 10^9 steps); the Trainer with a progress bar, `self.log` every step written every 50
steps to TensorBoard, and a checkpoint at every epoch end. Each repeat runs a fresh `fit` of N steps
(its set-up is part of the time, as it is for a user). Also: function calls per step (cProfile).

    python benchmarks/trainer_overhead.py            # ~1 minute
    python benchmarks/trainer_overhead.py --quick    # smoke run
Targets: bare <= 1.05, full <= 1.10 (time ratio to raw).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import SPECS, build_mlp, profile_calls, raw_loop, synthetic_data, time_interleaved  # noqa: E402

from fabric_lite import Trainer, TrainModule  # noqa: E402
from fabric_lite.callbacks import ModelCheckpoint, TensorBoardLogger  # noqa: E402


class TinyModule(TrainModule):
    def __init__(self, sizes):
        super().__init__()
        torch.manual_seed(0)
        self.net = build_mlp(sizes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_loop(spec, data, full: bool, root: str) -> Callable[[int], None]:
    def run(n: int) -> None:
        callbacks = [TensorBoardLogger(root, name="tb"), ModelCheckpoint(dirpath=f"{root}/ckpt", save_top_k=1)] if full else []
        trainer = Trainer(max_steps=n, enable_progress_bar=full, enable_checkpointing=full, callbacks=callbacks,
                          log_every_n_steps=50 if full else 10**9, num_sanity_val_steps=0, default_root_dir=root)
        loader = DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True)
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            trainer.fit(TinyModule(spec.sizes), loader)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["raw", "bare", "full"],
                        help="run just this loop for --steps steps and exit (to time whole processes from outside, "
                             "e.g. with /usr/bin/time, one process per loop)")
    args = parser.parse_args()
    spec = SPECS["tiny"]
    steps, repeats = (60, 2) if args.quick else (args.steps, args.repeats)
    data = synthetic_data(spec)  # 4096 samples: an epoch is 128 steps, so the full mode checkpoints often
    with tempfile.TemporaryDirectory() as root:
        raw_run, _ = raw_loop(spec, data, ddp=False)
        loops = {"raw": raw_run, "trainer bare": trainer_loop(spec, data, False, root),
                 "trainer full": trainer_loop(spec, data, True, root)}
        if args.only:
            loops[{"raw": "raw", "bare": "trainer bare", "full": "trainer full"}[args.only]](steps)
            return
        for run in loops.values():
            run(20)  # warm-up
        per_step = time_interleaved(loops, steps, repeats, ddp=False)
        calls = {name: sum(profile_calls(run, min(steps, 512)).values()) for name, run in loops.items()}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    print(f"Trainer overhead | torch {torch.__version__} | {torch.get_num_threads()} thread(s) | {repeats} repeats "
          f"of {steps} steps{' | QUICK' if args.quick else ''}\n")
    print(f"{'loop':<14}{'median s/step':>15}{'min':>11}{'max':>11}{'ratio':>8}{'calls/step':>12}{'calls ratio':>13}")
    for name, values in per_step.items():
        print(f"{name:<14}{med[name]:>15.6f}{min(values):>11.6f}{max(values):>11.6f}{med[name] / med['raw']:>8.3f}"
              f"{calls[name]:>12.1f}{calls[name] / calls['raw']:>13.3f}")
    print("\nratio = median s/step over the raw loop's; targets: bare <= 1.05, full <= 1.10. Each Trainer repeat is a "
          "fresh fit (set-up included); calls/step from cProfile over one fit of up to 512 steps.")


if __name__ == "__main__":
    main()
