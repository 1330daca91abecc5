"""DeepSpeed ZeRO stage 2 with the Accelerator, on 2 CPU processes (or GPUs).

    pip install 'fabric-lite[deepspeed]'
    fabric-lite launch --nproc-per-node 2 --cpu examples/deepspeed_example.py
    fabric-lite launch --nproc-per-node 2 examples/deepspeed_example.py --precision bf16   # on 2 GPUs

ZeRO stage 2 splits the optimizer state and the gradients over the processes; each keeps the whole weights.
The loop is the plain Accelerator loop: fabric_lite builds DeepSpeed's engine from what it knows (the loader's
micro-batch size, accumulation, clipping, precision) and keeps your torch optimizer. On CPU, DeepSpeed
compiles a small C++ extension the first time (about 30 s; cached in ~/.cache/torch_extensions).
Writes a checkpoint under runs/deepspeed (every process's ZeRO partition, checksummed like any other).
"""

import argparse
import importlib.util
import sys

if importlib.util.find_spec("deepspeed") is None:
    sys.exit("deepspeed_example.py needs DeepSpeed: pip install 'fabric-lite[deepspeed]' (or pip install deepspeed)")

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, set_seed


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
    # Also "deepspeed_stage_1", "deepspeed_stage_3", "deepspeed_stage_2_offload", ..., or
    # DeepSpeedStrategy(stage=2, config={...}) to pass DeepSpeed settings of your own.
    accelerator = Accelerator(strategy="deepspeed_stage_2", gradient_accumulation_steps=2,
                              mixed_precision=args.precision)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(make_data(), batch_size=16, shuffle=True)
    # DeepSpeed wraps model and optimizer together into one engine: prepare them in the same call.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for epoch in range(args.epochs):
        total = torch.zeros((), device=accelerator.device)
        for x, y in loader:                    # in bf16 the engine's inputs are cast for you
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x).float(), y)
                total += loss.detach()
                accelerator.backward(loss)     # the engine's backward; gradients are reduce-scattered
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        mean_loss = accelerator.reduce(total / len(loader), "mean").item()
        accelerator.print(f"epoch {epoch}: mean loss {mean_loss:.4f}")

    path = accelerator.save_state("runs/deepspeed/checkpoint")
    accelerator.print(f"ZeRO stage {accelerator.strategy.stage} on {accelerator.num_processes} process(es), "
                      f"device {accelerator.device}; checkpoint: {path}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
