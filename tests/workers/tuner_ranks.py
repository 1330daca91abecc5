"""The tuner on 2 processes (gloo DDP): an out-of-memory error raised on rank 1 only, above batch 16, in the
middle of a training step. Both ranks must settle on 16 (power and binsearch), keep the global batch through
accumulation when asked, and train afterwards from the state they had before the search."""

import datetime
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import parse, regression_data, write_result
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import BatchSizeFinder
from fabric_lite.strategies import DDPStrategy
from fabric_lite.tuner import Tuner

args = parse({"--root": {"required": True}})


class Net(TrainModule):
    def __init__(self, batch_size=2):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.batch_size = batch_size
        self.lr = 0.05
        self.seen = []  # (batch size) of every training step

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(len(x))
        if self.trainer.global_rank == 1 and len(x) > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(regression_data(256), batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def trainer(**kwargs):
    strategy = DDPStrategy(timeout=datetime.timedelta(seconds=20))
    return Trainer(strategy=strategy, accelerator="cpu", default_root_dir=args.root, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, logger=False, **kwargs)


def flat(module):
    return [round(float(v), 6) for p in module.parameters() for v in p.detach().reshape(-1)]


result = {}
for mode in ("power", "binsearch"):
    module = Net()
    start = time.monotonic()
    found = Tuner(trainer()).scale_batch_size(module, mode=mode, steps_per_trial=2)
    result[mode] = {"found": found, "attr": module.batch_size, "seconds": time.monotonic() - start,
                    "sizes": sorted(set(module.seen))}

# keep the global batch: 64 x 1 does not fit on rank 1, 16 x 4 does
module = Net(batch_size=64)
t = trainer(max_steps=2)
found = Tuner(t).scale_batch_size(module, keep_global_batch=True, steps_per_trial=1)
result["keep"] = {"found": found, "attr": module.batch_size, "accumulate": t.accumulate_grad_batches}

# the callback inside a fit: the fit goes on with the size found, from the original weights
tuned = Net(batch_size=2)
finder = BatchSizeFinder(steps_per_trial=1)
t = trainer(max_steps=3, callbacks=[finder])
t.fit(tuned)
plain = Net(batch_size=16)
t2 = trainer(max_steps=3)
t2.fit(plain)
result["callback"] = {"found": finder.optimal_batch_size, "last_sizes": tuned.seen[-3:], "global_step": t.global_step,
                      "same_weights": flat(tuned) == flat(plain)}
write_result(args.out, t.global_rank, result)

# the learning-rate range test: every rank records the same (averaged) losses and suggests the same rate
module = Net(batch_size=16)
finder = Tuner(trainer()).lr_find(module, min_lr=1e-4, max_lr=10.0, num_training=30)
result["lr_find"] = {"suggestion": finder.suggestion(), "losses": [round(v, 9) for v in finder.results["loss"]],
                     "attr": module.lr}


# another error in the training step on rank 1 only: both ranks stop at once, neither waits for the other
class Broken(Net):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and len(batch[0]) >= 8:
            raise ValueError("boom on rank 1")
        return super().training_step(batch, batch_idx)


start = time.monotonic()
try:
    Tuner(trainer()).scale_batch_size(Broken(), steps_per_trial=1)
    result["other_error"] = None
except Exception as err:
    result["other_error"] = {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
write_result(args.out, t.global_rank, result)
