"""FSDP2 (fully sharded data parallel) with the Accelerator, on 2 CPU processes.

    fabric-lite launch --nproc-per-node 2 --cpu examples/fsdp2_example.py
    fabric-lite launch --nproc-per-node 2 --cpu examples/fsdp2_example.py --precision bf16

Each process keeps half of every parameter, gradient and optimizer state (torch's `fully_shard`); each `Block`
is its own shard group, gathered just before it runs and freed after. FSDP2 ships with torch (2.6 and later)
and trains on CPUs over gloo, so this runs anywhere; on GPUs drop `--cpu`. Writes under runs/fsdp2: a sharded
checkpoint (each process writes its own shards) and the whole model's weights as safetensors.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2: what strategy="fsdp" runs on)
except ImportError:
    sys.exit("fsdp2_example.py needs FSDP2 (torch.distributed.fsdp.fully_shard): torch >= 2.6 with torch.distributed")

from fabric_lite import Accelerator, FSDPStrategy, set_seed


class Block(nn.Module):
    """A pre-norm residual MLP block: the unit FSDP shards and gathers as one."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, features: int = 32, dim: int = 64, depth: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_data(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = (torch.tanh(x @ torch.randn(32, 16, generator=g)) @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--precision", default="no", choices=["no", "bf16"])
    args = parser.parse_args()

    set_seed(0)
    # auto_wrap_policy names the blocks that get their own fully_shard (a class, or its name as a string).
    accelerator = Accelerator(strategy=FSDPStrategy(auto_wrap_policy={Block}), mixed_precision=args.precision)

    # Under FSDP, init_module() builds on the meta device: no memory is used until prepare() gives each
    # process its own shards and initializes them (to the values the model would have had built whole).
    with accelerator.init_module():
        model = Net()
    model = accelerator.prepare(model)
    # Built after prepare, the optimizer sees the shards: its state is sharded too. (One built before, on the
    # whole model, also works: prepare(model, optimizer) points it at the shards by name.)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(make_data(), batch_size=32, shuffle=True)
    optimizer, loader = accelerator.prepare(optimizer, loader)

    # Each parameter is now a DTensor: `to_local()` is this process's shard of it.
    held = sum(p.to_local().numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    print(f"rank {accelerator.process_index}/{accelerator.num_processes}: holds {held} of the model's "
          f"{whole} parameter values", flush=True)

    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=accelerator.device)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            total += loss.detach().float()
            accelerator.backward(loss)         # gradients are reduce-scattered: each process gets its shard's
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the norm over all shards
            optimizer.step()
            optimizer.zero_grad()
        mean_loss = accelerator.reduce(total / len(loader), "mean").item()   # over the batches of all processes
        accelerator.print(f"epoch {epoch}: mean loss {mean_loss:.4f}")

    # A sharded checkpoint: every process writes its own shards (torch.distributed.checkpoint); it loads back
    # into FSDP on any number of processes, into DDP or a single device. save_model gathers the whole weights.
    accelerator.save_state("runs/fsdp2/checkpoint")
    accelerator.save_model(model, "runs/fsdp2/model")
    accelerator.print("saved runs/fsdp2/checkpoint (sharded) and runs/fsdp2/model (whole weights, safetensors)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
