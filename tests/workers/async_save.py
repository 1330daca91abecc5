"""`--skip`: the raw door's `if_busy="skip"` after only one rank waited (must not hang). Otherwise: a Trainer on 2 processes saving in the background (`ModelCheckpoint(async_save=True)` every 2 steps), where
rank `--fail-rank` cannot write the file of save number `--fail-save` (ENOSPC). Each rank reports the error it
raised and the step it raised at (every rank must raise the same error at the same step), and the checkpoints
left on disk."""

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import parse, regression_data, write_result
from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback, ModelCheckpoint
from fabric_lite.checkpoint.files import CheckpointWriter

args = parse({"--root": {"required": True}, "--fail-rank": {"type": int, "default": 1},
              "--fail-save": {"type": int, "default": 2}, "--skip": {"action": "store_true"}})
rank = int(os.environ.get("RANK", "0"))
saves = {"count": 0}
original = CheckpointWriter.write


def write(writer, name, obj):
    if name.startswith("rng_") and threading.current_thread() is not threading.main_thread():
        saves["count"] += 1
        if rank == args.fail_rank and saves["count"] == args.fail_save:
            raise OSError(28, "No space left on device")
    return original(writer, name, obj)


CheckpointWriter.write = write


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Steps(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.step = trainer.global_step


if args.skip:  # the raw door: one rank waits for the save in flight, then both ask for a save that may be skipped
    from fabric_lite import Accelerator

    CheckpointWriter.write = original
    acc = Accelerator()
    model = acc.prepare(nn.Linear(256, 256))
    acc.save_state(os.path.join(args.root, "a"), blocking=False)
    if rank == 0:
        acc.wait_for_checkpoint()
    second = acc.save_state(os.path.join(args.root, "b"), blocking=False, if_busy="skip")
    acc.end_training()
    write_result(args.out, rank, {"second": second})
    raise SystemExit(0)

set_seed(0)
steps = Steps()
trainer = Trainer(max_epochs=40, default_root_dir=args.root, enable_progress_bar=False,
                  callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, async_save=True), steps])
result = {"error": None}
try:
    trainer.fit(Net(), DataLoader(regression_data(64), batch_size=4))
except Exception as err:  # noqa: BLE001 - reported to the test
    result = {"error": f"{type(err).__name__}: {err}", "step": trainer.global_step}
result["checkpoints"] = sorted(os.listdir(os.path.join(args.root, "checkpoints")))
write_result(args.out, rank, result)
