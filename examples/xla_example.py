"""Training on an XLA device (TPU, or XLA's CPU device to try it anywhere) with the Accelerator.

    make venv-xla                                                  # torch_xla needs its own torch: its own venv
    PJRT_DEVICE=CPU .venv-xla/bin/python examples/xla_example.py   # one XLA device, on the CPU
    PJRT_DEVICE=TPU fabric-lite launch --tpu examples/xla_example.py   # on a TPU: one replica per device

The loop is the usual Accelerator loop; what differs on XLA is when work runs. Operations are recorded into a
graph that is compiled and run when a step is marked (fabric_lite marks one after each optimizer step, and its
prepared loader does too), so reading a value on the host (`loss.item()`) in the loop would force an extra run
each step: here the loss is summed on the device and read once per epoch. The first steps are slow (compiling);
the same graph is then reused. Writes a checkpoint (plain CPU tensors) under runs/xla.
"""

import argparse
import sys

from fabric_lite.utils import is_torch_xla_available

if not is_torch_xla_available():
    sys.exit("xla_example.py needs torch_xla, which runs only on the torch of its own version (2.9.0): "
             "make venv-xla, then PJRT_DEVICE=CPU .venv-xla/bin/python examples/xla_example.py")

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, set_seed


def make_data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--precision", default="no", choices=["no", "bf16"])   # XLA computes in bf16, not fp16
    args = parser.parse_args()

    set_seed(0)
    # strategy="xla": one replica per XLA device. Without a launcher that is this process on one device;
    # under `fabric-lite launch --tpu` every replica runs this same line.
    accelerator = Accelerator(strategy="xla", mixed_precision=args.precision)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(make_data(), batch_size=32, shuffle=True, drop_last=True)   # one shape: one graph
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"device {accelerator.device} ({accelerator.distributed_type}), "
                      f"{accelerator.num_processes} replica(s)")

    for epoch in range(args.epochs):
        total = torch.zeros((), device=accelerator.device)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()          # across replicas, gradients are averaged first; then the step is marked
            optimizer.zero_grad()
            total += loss.detach().float()
        mean_loss = accelerator.reduce(total / len(loader), "mean").item()   # one read per epoch
        accelerator.print(f"epoch {epoch}: mean loss {mean_loss:.4f}")

    path = accelerator.save_state("runs/xla/checkpoint")   # CPU tensors: it loads on a CPU or GPU run too
    accelerator.print(f"checkpoint: {path}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
