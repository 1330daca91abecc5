"""What the Trainer costs per training step, next to the same loop written in plain PyTorch.

The tiny MLP of overhead.py (32 -> 64 -> 10, batch 32, AdamW) trained four ways in one process,
timed in interleaved repeats: the raw loop; the Trainer bare (no progress bar, no checkpoints,
logging every 10^9 steps); the Trainer with a progress bar, `self.log` every step written every 50
steps to TensorBoard, and a checkpoint at every epoch end, written on the training thread
(ModelCheckpoint(async_save=False): "full" measures what it did before background saves became the
default); and "full-async", the same with ModelCheckpoint(async_save=True), the checkpoint written on a
background thread. Each repeat runs a fresh `fit` of N steps (its set-up is part of the time, as it is for
a user). Also: function calls per step (cProfile; before Python 3.12 it sees the training thread only, so
not full-async's background writer; from 3.12 on it sees every thread).

With --ddp (2 processes, gloo): the raw loop is DistributedDataParallel with a DistributedSampler set
up by hand, as in overhead.py --ddp; the Trainers find the launch environment and the process group
the script started, and train under DDP themselves. Batch 32 per process, so an epoch is 64 steps.

    python benchmarks/trainer_overhead.py            # ~1 minute
    python benchmarks/trainer_overhead.py --quick    # smoke run
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/trainer_overhead.py --ddp   # ~1.5 minutes
    python benchmarks/trainer_overhead.py --profile-diff   # also: which functions the extra calls are
Targets: bare <= 1.05, full <= 1.10 (time ratio to raw).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (  # noqa: E402
    SPECS, barrier, build_mlp, print_diff, profile_calls, raw_loop, synthetic_data, time_interleaved,
)

from fabric_lite import Trainer, TrainModule  # noqa: E402
from fabric_lite.callbacks import ModelCheckpoint, TensorBoardLogger  # noqa: E402

TARGETS = {"trainer bare": 1.05, "trainer full": 1.10}
DDP_STEPS = 1000  # a DDP step of this model is ~4x a 1-process one: keeps the --ddp run near 1.5 minutes


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


def trainer_loop(spec, data, full: bool, root: str, expect_ddp: bool = False,
                 device: Optional[torch.device] = None, async_save: bool = False) -> Callable[[int], None]:
    ckpt_dir = f"{root}/ckpt_async" if async_save else f"{root}/ckpt"

    def run(n: int) -> None:
        callbacks = [TensorBoardLogger(root, name="tb"),
                     ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, async_save=async_save)] if full else []
        # on the raw loop's device, the CPU by default (the Trainer alone would pick a GPU)
        trainer = Trainer(max_steps=n, accelerator=device.type if device is not None else "cpu", enable_progress_bar=full, enable_checkpointing=full,
                          callbacks=callbacks, log_every_n_steps=50 if full else 10**9, num_sanity_val_steps=0,
                          default_root_dir=root, enable_model_summary=full)
        loader = DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True)
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            trainer.fit(TinyModule(spec.sizes), loader)
        if expect_ddp and not isinstance(trainer.model, DistributedDataParallel):
            raise RuntimeError(f"expected the Trainer to train under DDP, got {type(trainer.model).__name__}")

    return run


def shared_root(ddp: bool) -> contextlib.AbstractContextManager:
    """One temporary directory for every process (rank 0 makes it), as checkpoints on a shared disk need."""
    if not ddp:
        return tempfile.TemporaryDirectory()

    @contextlib.contextmanager
    def made_by_rank0():
        holder = [None]
        with contextlib.ExitStack() as stack:
            if dist.get_rank() == 0:
                holder[0] = stack.enter_context(tempfile.TemporaryDirectory())
            dist.broadcast_object_list(holder, src=0)
            try:
                yield holder[0]
            finally:
                dist.barrier()  # every rank is done with it before rank 0 removes it

    return made_by_rank0()


def main() -> None:
    finished = False
    try:
        measure()
        finished = True
    finally:
        if dist.is_initialized():  # --ddp: tear the group down before exit (after a failure, without waiting)
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def measure() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="steps per repeat (a fit of that many steps; default 2000, "
                                                  f"{DDP_STEPS} with --ddp)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ddp", action="store_true",
                        help="2-process run; start with torchrun --nproc-per-node 2 (gloo on CPU)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file (rank 0)")
    parser.add_argument("--profile-diff", action="store_true",
                        help="print the functions behind the Trainers' extra calls per step (rank 0)")
    parser.add_argument("--top", type=int, default=25, help="rows in the --profile-diff listing")
    parser.add_argument("--only", choices=["raw", "bare", "full", "full-async"],
                        help="run just this loop for --steps steps and exit (to time whole processes from outside, "
                             "e.g. with /usr/bin/time, one process per loop)")
    args = parser.parse_args()
    if args.ddp:
        if "WORLD_SIZE" not in os.environ:
            parser.error("--ddp needs a launcher: torchrun --nproc-per-node 2 benchmarks/trainer_overhead.py --ddp")
        dist.init_process_group("gloo")  # the raw loop's group; the Trainers join it
    rank0 = not args.ddp or dist.get_rank() == 0
    world = dist.get_world_size() if args.ddp else 1
    spec = SPECS["tiny"]
    default_steps = DDP_STEPS if args.ddp else 2000
    steps, repeats = (60, 2) if args.quick else (args.steps or default_steps, args.repeats)
    window = min(steps, 512)  # calls/step: one fit of this many steps (whole epochs: 4 of 128, or 8 of 64 under DDP)
    data = synthetic_data(spec)  # 4096 samples: an epoch is 128 steps (64 under DDP), so "full" checkpoints often
    with shared_root(args.ddp) as root:
        raw_run, raw_epoch = raw_loop(spec, data, ddp=args.ddp)
        loops = {"raw": raw_run, "trainer bare": trainer_loop(spec, data, False, root, args.ddp),
                 "trainer full": trainer_loop(spec, data, True, root, args.ddp),
                 "trainer full-async": trainer_loop(spec, data, True, root, args.ddp, async_save=True)}
        if args.only:
            loops[{"raw": "raw", "bare": "trainer bare", "full": "trainer full",
                   "full-async": "trainer full-async"}[args.only]](steps)
            return
        for run in loops.values():
            run(20)  # warm-up
        per_step = time_interleaved(loops, steps, repeats, ddp=args.ddp)
        profiles: Dict[str, Dict] = {}  # per step, over one fit of `window` steps (set-up included)
        steady: Dict[str, Dict] = {}  # per step, set-up left out: fit of epoch + window steps minus fit of epoch
        setup_calls: Dict[str, float] = {}
        for name, run in loops.items():
            barrier(args.ddp)
            profiles[name] = profile_calls(run, window)
            if name == "raw":  # built once, not per repeat: nothing to leave out
                steady[name] = profiles[name]
                continue
            barrier(args.ddp)
            short = profile_calls(run, raw_epoch)
            barrier(args.ddp)
            long = profile_calls(run, raw_epoch + window)
            steady[name] = {k: (long.get(k, 0.0) * (raw_epoch + window) - short.get(k, 0.0) * raw_epoch) / window
                            for k in set(long) | set(short)}
            setup_calls[name] = (sum(short.values()) - sum(steady[name].values())) * raw_epoch
        barrier(args.ddp)
        calls = {name: sum(p.values()) for name, p in profiles.items()}
        steady_calls = {name: sum(p.values()) for name, p in steady.items()}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    results: Dict[str, dict] = {}
    for name, values in per_step.items():
        paired: List[float] = [v / r for v, r in zip(values, per_step["raw"])]
        results[name] = {
            "seconds_per_step": values, "median": med[name], "ratio_median": med[name] / med["raw"],
            "ratio_min": min(values) / min(per_step["raw"]), "ratio_paired_median": statistics.median(paired),
            "ratio_paired_min": min(paired), "ratio_paired_max": max(paired),
            "calls_per_step": calls[name], "calls_ratio": calls[name] / calls["raw"],
            "steady_calls_per_step": steady_calls[name], "steady_calls_ratio": steady_calls[name] / steady_calls["raw"],
            "setup_calls": setup_calls.get(name, 0.0), "target": TARGETS.get(name),
        }
    if rank0:
        print(f"Trainer overhead | torch {torch.__version__} | {world} process(es) x {torch.get_num_threads()} "
              f"thread(s) | {repeats} repeats of {steps} steps (epoch: {raw_epoch} steps){' | DDP (gloo)' if args.ddp else ''}"
              f"{' | QUICK' if args.quick else ''}\n")
        w = max(14, max(map(len, results)) + 1)  # the loop names' column
        print(f"{'loop':<{w}}{'median s/step':>15}{'min':>11}{'max':>11}{'ratio':>8}{'of mins':>9}"
              f"{'paired: median [min..max]':>28}{'calls/step':>12}{'calls ratio':>13}{'steady':>9}{'ratio':>7}"
              f"{'set-up calls':>14}  target")
        for name, r in results.items():
            values = r["seconds_per_step"]
            paired = f"{r['ratio_paired_median']:.3f} [{r['ratio_paired_min']:.3f}..{r['ratio_paired_max']:.3f}]"
            target = r["target"]
            verdict = "" if target is None else f"<={target:g} {'met' if r['ratio_median'] <= target else 'missed'}"
            setup = f"{r['setup_calls']:14.0f}" if name != "raw" else f"{'':14}"
            print(f"{name:<{w}}{r['median']:>15.6f}{min(values):>11.6f}{max(values):>11.6f}{r['ratio_median']:>8.3f}"
                  f"{r['ratio_min']:>9.3f}{paired:>28}{r['calls_per_step']:>12.1f}{r['calls_ratio']:>13.3f}"
                  f"{r['steady_calls_per_step']:>9.1f}{r['steady_calls_ratio']:>7.3f}{setup}  {verdict}")
        raw_desc = "DDP + DistributedSampler by hand" if args.ddp else "plain loop"
        print(f"\nraw = {raw_desc}. ratio = median s/step over the raw loop's; of mins = fastest repeat over raw's "
              f"fastest; paired = per-repeat ratios of back-to-back runs.\nEach Trainer repeat is a fresh fit "
              f"(set-up included); calls/step from cProfile over one fit of {window} steps"
              f"{' (rank 0)' if args.ddp else ''};\nsteady = calls/step without the fit's set-up (a fit of "
              f"{raw_epoch + window} steps minus one of {raw_epoch}), set-up calls = what is left of the shorter fit.\n"
              f"full-async = full with ModelCheckpoint(async_save=True); the fit ends by waiting for the last save, "
              f"inside the time. Its calls are\n"
              + ("the training thread's and the background writer's (from Python 3.12 on cProfile sees every thread)."
                 if sys.version_info >= (3, 12) else
                 "the training thread's only (cProfile does not see the background writer before Python 3.12)."))
        if args.profile_diff:
            for name in ("trainer bare", "trainer full", "trainer full-async"):
                print_diff(f"{world} process(es)", steady["raw"], steady[name], args.top,
                           name=f"{name} (steady: set-up left out)", short=name.split()[1])
        if args.json:
            meta = {"torch": torch.__version__, "processes": world, "threads": torch.get_num_threads(),
                    "steps_per_repeat": steps, "repeats": repeats, "epoch_steps": raw_epoch,
                    "profile_window_steps": window, "ddp": args.ddp}
            args.json.write_text(json.dumps({"meta": meta, "loops": results}, indent=2))


if __name__ == "__main__":
    main()
