"""A raw-door training script for `fabric-lite explain`: it writes a marker file after its training
loop, so a test can tell that the dry run stopped at prepare() and never trained."""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, make_model
from fabric_lite import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--mixed-precision", default=None)
parser.add_argument("--rng-types", action="store_true")
parser.add_argument("--devices", type=int, default=None)
args = parser.parse_args()

kwargs = {"devices": args.devices} if args.devices is not None else {}
accelerator = Accelerator(mixed_precision=args.mixed_precision,
                          rng_types=["torch", "generator"] if args.rng_types else None, **kwargs)
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(IndexDataset(args.samples), batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, idx in loader:
    with accelerator.accumulate(model):
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), idx % 3))
        optimizer.step()
Path(args.out, "trained.marker").write_text("the training loop ran\n")
