"""Gradient accumulation and mixed precision with the Accelerator.

    python examples/accumulation_precision.py
    fabric-lite launch --nproc-per-node 2 examples/accumulation_precision.py   # the same comparison under DDP

Three short runs over the same data, from the same initial weights:

1. fp32, batches of 8, gradients accumulated over 4 batches (`with accelerator.accumulate(model):`);
2. fp32, batches of 32 and no accumulation: the same samples per optimizer step, so the same weights up to
   float rounding (the four micro-batch losses are each divided by 4, which sums to the mean over 32);
3. run 1 again in bf16 mixed precision: the forward runs under autocast, the weights stay fp32.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, set_seed


def make_data(n: int = 1024) -> TensorDataset:
    """A noisy linear teacher with 4 classes: made here, nothing to download."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    teacher = torch.randn(20, 4, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def train(batch_size: int, accumulation_steps: int, mixed_precision: str = "no", epochs: int = 3):
    """Train from seed 0; return the Accelerator, the final weights as one flat tensor, and the final loss."""
    set_seed(0)  # the same initial weights and the same shuffled order in every run
    accelerator = Accelerator(gradient_accumulation_steps=accumulation_steps, mixed_precision=mixed_precision)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = make_data()
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for _ in range(epochs):
        for x, y in loader:
            # Inside `accumulate`, backward divides the loss by the number of accumulation steps, and
            # optimizer.step()/zero_grad() only act on the window's last batch (under DDP the gradient
            # all-reduce also waits for it). The loop body is the one you would write without accumulation.
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

    # The loss over the whole training set (the prepared model's forward runs under autocast in bf16).
    x, y = (t.to(accelerator.device) for t in data.tensors)
    with torch.no_grad():
        final_loss = F.cross_entropy(model(x).float(), y).item()
    weights = torch.cat([p.detach().float().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return accelerator, weights, final_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    accelerator, accumulated, loss_accumulated = train(8, 4, epochs=args.epochs)
    _, big_batch, loss_big_batch = train(32, 1, epochs=args.epochs)
    _, bf16, loss_bf16 = train(8, 4, mixed_precision="bf16", epochs=args.epochs)

    difference = (accumulated - big_batch).abs().max().item()
    accelerator.print(f"fp32, batch 8 x 4 accumulated: loss {loss_accumulated:.5f}")
    accelerator.print(f"fp32, batch 32:                loss {loss_big_batch:.5f}")
    accelerator.print(f"max |weight difference| accumulated vs 4x batch: {difference:.2e}")
    accelerator.print(f"accumulated weights equal the 4x batch's within 1e-5: {difference <= 1e-5}")
    # bf16 keeps about 3 significant digits in the forward pass: close to fp32, not equal to it.
    accelerator.print(f"bf16 mixed precision, batch 8 x 4 accumulated: loss {loss_bf16:.5f} "
                      f"(max |weight difference| vs fp32: {(bf16 - accumulated).abs().max().item():.2e})")


if __name__ == "__main__":
    main()
