"""N-D parallelism through the Trainer door: Lightning's ModelParallelStrategy, the module parallelizing itself in
configure_model over self.device_mesh. With --dp 0, the same fit on one process with the default strategy is the
reference."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback
from fabric_lite.strategies import ModelParallelStrategy

args = parse({"--dp": {"type": int, "default": 0}, "--tp": {"type": int, "default": 1},
              "--user-fsdp": {"action": "store_true"}})


class Net(TrainModule):
    def configure_model(self):
        set_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        mesh = self.device_mesh
        self.mesh_names = list(mesh.mesh_dim_names) if mesh is not None else None
        if mesh is not None and mesh["tensor_parallel"].size() > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if args.user_fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class Record(Callback):
    def __init__(self):
        self.losses, self.seen = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen += batch[1].tolist()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"].detach()))


g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
dp = max(args.dp, 1)
strategy = ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp) if args.dp else "auto"
record = Record()
trainer = Trainer(strategy=strategy, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[record])
module = Net()
trainer.fit(module, DataLoader(data, batch_size=8 // dp))
weights = {}
for name, value in module.state_dict().items():  # (every rank: gathering a sharded tensor is a collective)
    weights[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).reshape(-1).tolist()
write_result(args.out, trainer.global_rank, {
    "losses": record.losses, "seen": record.seen, "weights": weights,
    # the last step's loss, synced over the data-parallel ranks: the loss of the whole global batch
    "logged": float(trainer.callback_metrics["train_loss"]),
    "mesh": module.mesh_names, "global_step": trainer.global_step,
})
