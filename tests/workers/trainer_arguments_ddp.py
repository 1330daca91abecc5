"""Trainer arguments on 2 processes: use_distributed_sampler, evaluation's grad mode over gloo, min_epochs holding a
stop that one rank asked for. Several scenarios share one launch; results are written after each."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import parse, write_result
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback

args = parse({"--root": {"required": True}})
results = {}


def done(name, value, rank):
    results[name] = value
    write_result(args.out, rank, results)


class Recorder(TrainModule):
    """Records the sample indices of every training batch, and the grad mode of validation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(1, 1)
        self.seen, self.modes = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.extend(int(v) for v in x.flatten().tolist())
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.modes.append([torch.is_inference_mode_enabled(), torch.is_grad_enabled()])
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(n=8):
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, 2 * x)


def trainer(name, **kwargs):
    return Trainer(default_root_dir=f"{args.root}/{name}", enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


# 1. the Trainer shards the loader (default); use_distributed_sampler=False leaves it to the user
sharded = Recorder()
t = trainer("sharded", max_epochs=1)
t.fit(sharded, DataLoader(data(), batch_size=2), DataLoader(data(4), batch_size=2))
rank = t.global_rank
done("sharded", {"seen": sharded.seen, "world": t.world_size, "modes": sharded.modes}, rank)

whole = Recorder()
trainer("whole", max_epochs=1, use_distributed_sampler=False).fit(whole, DataLoader(data(), batch_size=2))
done("whole", {"seen": whole.seen}, rank)

own = Recorder()
sampler = DistributedSampler(data(), num_replicas=2, rank=rank, shuffle=False)
trainer("own", max_epochs=1, use_distributed_sampler=False).fit(own, DataLoader(data(), batch_size=2, sampler=sampler))
done("own", {"seen": own.seen}, rank)


# 2. rank 0 alone asks to stop after its first epoch: every rank stops together, or trains on to min_epochs
class RankZeroStops(Callback):
    def on_train_epoch_end(self, trainer, module):
        if trainer.global_rank == 0:
            trainer.should_stop = True


for name, kwargs in (("stop", {}), ("held", {"min_epochs": 3})):
    t = trainer(name, max_epochs=6, callbacks=[RankZeroStops()], **kwargs)
    t.fit(Recorder(), DataLoader(data(), batch_size=2))
    done(name, {"epochs": t.current_epoch, "steps": t.global_step}, rank)
