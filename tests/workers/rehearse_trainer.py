"""A Lightning-style script for `fabric-lite explain --rehearse`: ModelParallelStrategy with its 'auto' sizes (tensor
parallel within a node, data parallel across nodes), the module applying tensor parallelism in configure_model."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse
from fabric_lite import Trainer, TrainModule
from fabric_lite.strategies import ModelParallelStrategy

args = parse({"--nodes": {"type": int, "default": 1}, "--devices": {"type": int, "default": 1}})


class Net(TrainModule):
    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
        parallelize_module(self.model, self.device_mesh["tensor_parallel"],
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.model(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


data = TensorDataset(torch.randn(4096, 256), torch.randn(4096, 256))
trainer = Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                  max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  default_root_dir=args.out)
trainer.fit(Net(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
open(f"{args.out}/trained.marker", "w").close()
