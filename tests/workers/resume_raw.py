"""The raw door, killed and resumed: a hand-written loop (shuffled data, dropout, a StepLR, gradient
accumulation) that calls `accelerator.save_state()` (automatic naming, total_limit=2) every `--every`
optimizer steps.

- `--kill-step K`: SIGKILL this process (on `--kill-rank`) in the middle of the accumulation window after
  optimizer step K, once per project directory (a marker file), then nothing is written.
- `--resume`: rebuild everything from another seed, `load_state()` (the newest whole checkpoint), continue
  the loop from the restored loader position, then run the same loop uninterrupted from scratch in a fresh
  Accelerator (another project directory) and report both weights.
- `--augment`: random noise added in the dataset's `__getitem__` (with `--workers`, drawn in the workers).
- `--async-save`: `save_state(blocking=False)`: written in the background; the kill waits until one
  checkpoint is published (`latest` exists), while the newest may still be in flight.
- `--preempt`: loop until `check_preemption()` says stop; `--kill-rank` sends itself SIGTERM at micro-step 5.
  Each rank reports the micro-step at which it saw True, saves state and exits with EXIT_PREEMPTED.
"""

import contextlib
import os
import signal
import sys
import time

import fsspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import StepCounter, parse, regression_data, write_result
from fabric_lite import EXIT_PREEMPTED, Accelerator, ProjectConfiguration, set_seed

args = parse({
    "--root": {"required": True},
    "--epochs": {"type": int, "default": 3},
    "--every": {"type": int, "default": 4},
    "--workers": {"type": int, "default": 0},
    "--kill-step": {"type": int, "default": None},
    "--kill-rank": {"type": int, "default": 0},
    "--resume": {"action": "store_true"},
    "--preempt": {"action": "store_true"},
    "--strategy": {"default": "auto"},
    "--async-save": {"action": "store_true"},
    "--augment": {"action": "store_true"},
})


class Augmented(torch.utils.data.Dataset):
    """Noise added in __getitem__ from torch's RNG, drawn a number of times that depends on the sample: each
    process's loader workers end up in states of their own (what `rng_<rank>.pt` must keep per process)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        for _ in range(1 + i % 3):
            x = x + 0.01 * torch.randn(4)
        return x, y


def build(seed, project):
    set_seed(seed)
    acc = Accelerator(gradient_accumulation_steps=2, strategy=args.strategy, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
    data = Augmented(regression_data(48)) if args.augment else regression_data(48)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=args.workers)
    counter = StepCounter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, counter


def micro_step(acc, model, opt, sched, batch):
    x, y = batch
    with acc.accumulate(model):
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def train(acc, model, opt, loader, sched, counter, kill_step=None):
    marker = os.path.join(args.out, f"killed-{acc.process_index}")  # local even when root is a URL
    for _ in range(loader.epoch, args.epochs):   # after load_state the loader is at its saved position
        for batch in loader:
            micro_step(acc, model, opt, sched, batch)
            if acc.sync_gradients:
                counter.steps += 1
                if counter.steps % args.every == 0:
                    acc.save_state(blocking=not args.async_save)
            elif (kill_step is not None and counter.steps == kill_step and acc.process_index == args.kill_rank
                  and not os.path.exists(marker)):
                open(marker, "w").close()
                if args.async_save:  # a published checkpoint to resume from; the newest save may be in flight
                    fs, path = fsspec.core.url_to_fs(f"{args.root}/checkpoints/latest")
                    while not fs.exists(path):
                        time.sleep(0.01)
                print(f"worker: rank {acc.process_index} SIGKILLs itself at step {counter.steps}", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def weights(acc, model):
    params = list(acc.unwrap_model(model).parameters())
    gathered = contextlib.nullcontext()
    if getattr(acc.strategy, "stage", None) == 3:  # ZeRO-3 holds a slice of each parameter per rank
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:  # FSDP: each parameter is a sharded tensor, gathered whole on every rank
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
        return torch.cat([p.detach().reshape(-1).float() for p in whole]).tolist()


def checkpoints(root):
    fs, path = fsspec.core.url_to_fs(f"{root}/checkpoints")
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.isdir(path) else []


if args.preempt:
    acc, model, opt, loader, sched, counter = build(1, args.root)
    seen_at, micro = None, 0
    while seen_at is None and micro < 100_000:
        for batch in loader:
            micro_step(acc, model, opt, sched, batch)
            micro += 1
            if micro == 5 and acc.process_index == args.kill_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if acc.check_preemption():
                seen_at = micro
                break
    path = acc.save_state()
    write_result(args.out, acc.process_index, {"seen_at": seen_at, "saved": path, "checkpoints": checkpoints(args.root),
                                               "exit": EXIT_PREEMPTED})
    sys.exit(EXIT_PREEMPTED)

if not args.resume:
    objs = build(1, args.root)
    train(*objs, kill_step=args.kill_step)
    write_result(args.out, objs[0].process_index, {"weights": weights(objs[0], objs[1]), "finished": True})
    sys.exit(0)

acc, *objs = build(99, args.root)   # other initial weights and RNG: everything must come from the checkpoint
loaded = acc.load_state()
restored = {"steps": objs[-1].steps, "epoch": objs[2].epoch, "batches_seen": objs[2].state_dict()["batches_seen"]}
train(acc, *objs)
resumed = weights(acc, objs[0])
acc.wait_for_checkpoint()
saved = checkpoints(args.root)
acc.free_memory()

acc, *objs = build(1, f"{args.root}/uninterrupted")
train(acc, *objs)
write_result(args.out, acc.process_index, {
    "loaded": loaded, "restored": restored, "resumed": resumed, "uninterrupted": weights(acc, objs[0]),
    "checkpoints": saved, "steps": objs[-1].steps,
})
