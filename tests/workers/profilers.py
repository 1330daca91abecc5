"""The profilers on 2 processes (one launch): each rank writes its own report and Chrome trace.

A PyTorchProfiler fit and an AdvancedProfiler fit; each rank writes the files it found once every rank's are
written (after a barrier), and what its own trace recorded.
"""

import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Trainer, TrainModule
from fabric_lite.profilers import AdvancedProfiler, PyTorchProfiler

args = parse({"--root": {"required": True}})


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)  # 8 steps a process


def fit(profiler):
    trainer = Trainer(max_steps=6, profiler=profiler, default_root_dir=args.root, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, logger=False)
    trainer.fit(Net(), loader())
    trainer.strategy.barrier()
    return trainer


prof_dir = os.path.join(args.root, "prof")
trainer = fit(PyTorchProfiler(dirpath=prof_dir, filename="perf"))
rank = trainer.global_rank
fit(AdvancedProfiler(dirpath=prof_dir, filename="adv"))
mine = [name for name in os.listdir(prof_dir) if name.startswith(f"fit-perf-{rank}-") and name.endswith(".json")]
events = json.loads(open(os.path.join(prof_dir, mine[0])).read())["traceEvents"] if len(mine) == 1 else []
write_result(args.out, rank, {
    "rank": rank, "world": trainer.world_size, "files": sorted(os.listdir(prof_dir)),
    "strategy": type(trainer.strategy).__name__,
    "steps_in_trace": sum(e.get("name") == f"[pl][profile][Strategy]{type(trainer.strategy).__name__}.training_step"
                          for e in events),
    "report": open(os.path.join(prof_dir, f"fit-perf-{rank}.txt")).read().splitlines()[:2],
})
