"""Rank `--victim` is killed outright (SIGKILL: no exit hook runs, no note is left) mid-training while the other
ranks train on; each survivor must say which rank is gone. Each rank prints when it is killed or finishes."""

import os
import signal
import time

import torch
from torch import nn

from common import parse
from fabric_lite import Accelerator

args = parse({"--victim": {"type": int, "default": 1}, "--steps": {"type": int, "default": 100000}})
acc = Accelerator()
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for step in range(args.steps):
    if step == 3 and acc.process_index == args.victim:
        print(f"rank {acc.process_index} killing itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
print(f"rank {acc.process_index} finished at {time.time():.3f}", flush=True)
