"""The trainer door, killed and resumed: one run of a small fit with everything that must continue exactly
(shuffled data, dropout, a per-step LR schedule, gradient accumulation, optionally fp16 loss scaling and
loader workers) and step checkpoints.

`--kill-step K --kill-signal KILL` sends the signal to this process (on `--kill-rank` only) in the middle of
the accumulation window that follows optimizer step K (`--kill-where window-end`: right after step K), once
per run directory: the first run leaves a marker file (or, with `--once-by restart`, only the first elastic
attempt kills). `--ckpt-path last` resumes. `--check-seconds S` sets how often the processes compare
preemption flags (PreemptionWatch's default, patched in this process only; 0: at every step).

Each rank writes rank{r}.json: final weights (as a list of floats), counters, and the step the fit started at.
A run that ends with SystemExit (preemption) writes its exit status before exiting with it.
"""

import contextlib
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import parse, regression_data, write_result
from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback, ModelCheckpoint

args = parse({
    "--root": {"required": True},
    "--epochs": {"type": int, "default": 3},
    "--samples": {"type": int, "default": 48},
    "--every": {"type": int, "default": 4},
    "--accumulate": {"type": int, "default": 2},
    "--workers": {"type": int, "default": 0},
    "--precision": {"default": "32-true"},
    "--ckpt-path": {"default": None},
    "--kill-step": {"type": int, "default": None},
    "--kill-rank": {"type": int, "default": 0},
    "--kill-signal": {"default": "KILL"},
    "--kill-where": {"default": "mid-window", "choices": ["mid-window", "window-end"]},
    "--once-by": {"default": "marker", "choices": ["marker", "restart"]},
    "--check-seconds": {"type": float, "default": None},
    "--strategy": {"default": "auto"},
})


class Dropout(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Killer(Callback):
    """Signals this process mid-window, right after the first micro-batch that follows optimizer step K."""

    def __init__(self, rank):
        self.rank = rank
        self.start_step = None

    def on_train_start(self, trainer, module):
        self.start_step = (trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if args.kill_step is None or self.rank != args.kill_rank:
            return
        position = 0 if args.kill_where == "mid-window" else args.accumulate - 1
        if trainer.global_step != args.kill_step or batch_idx % args.accumulate != position:
            return
        if args.once_by == "restart":
            if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
                return
        else:
            marker = os.path.join(args.root, f"killed-{self.rank}")
            if os.path.exists(marker):
                return
            os.makedirs(args.root, exist_ok=True)  # (checkpoints written in the background may not have made it)
            open(marker, "w").close()
        # Checkpoints are written in the background: let the one started be published first, so that the run
        # resumes from the checkpoint these tests expect (kills during background saves: test_async.py).
        trainer.accelerator.wait_for_checkpoint()
        print(f"worker: rank {self.rank} sends SIG{args.kill_signal} to itself at step {trainer.global_step}, "
              f"batch {batch_idx} of epoch {trainer.current_epoch}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{args.kill_signal}"))


set_seed(0)
module = Dropout()
rank = int(os.environ.get("RANK", "0"))
killer = Killer(rank)
checkpoint = ModelCheckpoint(every_n_train_steps=args.every, save_top_k=1)
trainer = Trainer(max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, precision=args.precision,
                  strategy=args.strategy,
                  default_root_dir=args.root, callbacks=[checkpoint, killer], enable_progress_bar=False,
                  num_sanity_val_steps=0, log_every_n_steps=1)
loader = DataLoader(regression_data(args.samples), batch_size=4, shuffle=True, num_workers=args.workers,
                    generator=torch.Generator().manual_seed(3))
result = {"restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}
try:
    if args.check_seconds is not None:
        import fabric_lite.launch.preemption as preemption

        preemption.PreemptionWatch.__init__.__defaults__ = (args.check_seconds,)
    trainer.fit(module, loader, ckpt_path=args.ckpt_path)
except SystemExit as exit_:
    result.update(exit=exit_.code, global_step=trainer.global_step, start=killer.start_step)
    write_result(args.out, trainer.strategy.global_rank, result)
    raise
gathered = contextlib.nullcontext()
if args.strategy.startswith("deepspeed_stage_3"):  # ZeRO-3 holds a slice of each parameter per rank
    import deepspeed

    gathered = deepspeed.zero.GatheredParameters(list(module.parameters()))
with gathered:
    weights = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()]).tolist()
result.update(exit=0, global_step=trainer.global_step, epoch=trainer.current_epoch, start=killer.start_step,
              weights=weights,
              scale=(trainer.strategy.precision.scaler.get_scale() if trainer.strategy.precision.scaler else None),
              lr=trainer.optimizers[0].param_groups[0]["lr"])
write_result(args.out, trainer.strategy.global_rank, result)
