"""self.log on 2 processes: sync_dist (mean, sum, max, with and without sync_dist_group), per-step values in
validation on shards of different lengths, rank_zero_only, and several validation loaders.

Validation samples are the numbers 0..8 (loader A) and 10..14 (loader B) in batches of 2; batch k goes to rank
k % 2, so rank 0 runs one step more than rank 1 in each loader. Each rank writes what it saw as JSON.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback

args = parse({"--root": {"required": True}})


class Recorder(Callback):
    def __init__(self):
        self.logs = []

    def on_log(self, trainer, metrics, step):
        self.logs.append([step, dict(metrics)])


class SyncedLogs(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(1, 1)
        self.group = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        rank = float(self.trainer.global_rank)
        self.log("t", rank, on_step=True, on_epoch=True, sync_dist=True)          # mean over ranks: 0.5
        self.log("t_max", rank, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return F.mse_loss(self.net(x), y)

    def on_validation_epoch_start(self):
        if self.group is None:  # (every process makes the group at the same point)
            self.group = dist.new_group([0, 1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x = batch[0]
        self.log("x_mean", x.mean(), sync_dist=True)                               # weighted by the batch size
        self.log("x_sum", x.sum(), reduce_fx="sum", sync_dist=True)
        self.log("x_max", x.max(), reduce_fx=torch.max, sync_dist=True, sync_dist_group=self.group)
        self.log("x_local", x.mean())
        self.log("s", x.sum(), on_step=True, on_epoch=False, sync_dist=True)       # per step, mean over ranks
        if self.trainer.is_global_zero:
            self.log("only0", 1.0, rank_zero_only=True)

    def on_validation_epoch_end(self):
        self.log("end", float(self.trainer.global_rank), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def numbers(lo, hi):
    x = torch.arange(lo, hi, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, x)


recorder = Recorder()
trainer = Trainer(max_epochs=1, limit_train_batches=2, log_every_n_steps=1, num_sanity_val_steps=0,
                  default_root_dir=args.root, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False, callbacks=[recorder])
module = SyncedLogs()
trainer.fit(module, DataLoader(numbers(0, 8), batch_size=2))
rank = trainer.global_rank
result = {"world": trainer.world_size, "fit": {k: float(v) for k, v in trainer.callback_metrics.items()},
          "fit_logs": recorder.logs}
recorder.logs = []
result["single"] = trainer.validate(module, DataLoader(numbers(0, 9), batch_size=2))
result["single_logs"] = recorder.logs
recorder.logs = []
result["two"] = trainer.validate(module, [DataLoader(numbers(0, 9), batch_size=2),
                                          DataLoader(numbers(10, 15), batch_size=2)])
result["two_logs"] = recorder.logs
result["callback_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
write_result(args.out, rank, result)
