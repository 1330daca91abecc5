"""Rank `--leaver` leaves mid-training while the others train on: with sys.exit(`--code`), or killed outright
with `--sigkill` (no exit hook runs, no note is left). `--leaver -1`: every rank ends its script together
without end_training(). Each rank prints when it leaves or finishes."""

import os
import signal
import sys
import time

import torch
from torch import nn

from common import parse
from fabric_lite import Accelerator

args = parse({"--leaver": {"type": int, "default": 1}, "--code": {"type": int, "default": 0},
              "--steps": {"type": int, "default": 400}, "--sigkill": {"action": "store_true"}})
acc = Accelerator()
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for step in range(args.steps):
    if step == 3 and acc.process_index == args.leaver:
        if args.sigkill:
            print(f"rank {acc.process_index} killing itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank {acc.process_index} leaving at step {step}", flush=True)
        sys.exit(args.code)
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    time.sleep(0.05 if args.leaver >= 0 else 0)
print(f"rank {acc.process_index} finished at {time.time():.3f}", flush=True)
# no end_training(): the interpreter's exit takes the process group down
