"""Checkpoints on a full disk: run on a small tmpfs mounted at `--dir` (ENOSPC from the kernel, nothing faked).

A checkpoint of about 1 MB is saved into `ckpt` (it fits), training goes on, and the same name is saved again,
which needs a second copy beside the first and runs out of space. Reports the error, whether the first
checkpoint still verifies and loads to its weights, where `latest` points, the directory listing, the free
space before and after the failed save, and whether a small save then succeeds."""

import json
import os

import torch
from torch import nn

from common import parse, write_result
from fabric_lite import Accelerator
from fabric_lite.checkpoint import files as checkpoint_io

args = parse({"--dir": {"required": True}, "--background": {"action": "store_true"}})


def build(width):
    torch.manual_seed(0)
    acc = Accelerator()
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (acc, *acc.prepare(model, opt))


def free():
    stat = os.statvfs(args.dir)
    return stat.f_bavail * stat.f_frsize


acc, model, opt = build(4000)  # ~260k parameters: ~1 MB of weights
ckpt = os.path.join(args.dir, "ckpt")
acc.save_state(ckpt)
checkpoint_io.update_latest(ckpt)
saved = [p.detach().clone() for p in model.parameters()]
model(torch.randn(8, 64)).sum().backward()
opt.step()
before = free()
result = {"error": None}
try:
    acc.save_state(ckpt, blocking=not args.background)
    acc.wait_for_checkpoint()
except Exception as err:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(err).__name__}: {err}"
result["free_before"], result["free_after"] = before, free()
result["listing"] = sorted(os.listdir(args.dir))
checkpoint_io.verify(ckpt)
acc2, model2, _ = build(4000)
acc2.load_state(ckpt)
result["first_loads"] = all(torch.equal(a, b) for a, b in zip(saved, model2.parameters()))
with open(os.path.join(args.dir, "latest")) as f:
    result["latest"] = json.load(f)["name"]
small, _, _ = build(8)
small.save_state(os.path.join(args.dir, "small"), blocking=not args.background)
small.wait_for_checkpoint()
checkpoint_io.verify(os.path.join(args.dir, "small"))
result["small_saved"] = True
write_result(args.out, 0, result)
