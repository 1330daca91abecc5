"""A disk that fills at every point of a save: run on a small tmpfs mounted at `--dir`.

A run with automatic checkpoint naming saves one whole checkpoint. Then, for k = 0, 1, 2, ... free pages,
a filler file takes all but k pages of the disk and the run saves again (each save is a few pages: three
files, the manifest, `latest`), so the disk fills during every step of a save in turn: a file, the
manifest, the `latest` pointer. After each attempt the filler goes and the directory is inspected.
Reports, per attempt: the error (None if the save fit), the listing, and what `latest` and the newest
whole checkpoint are."""

import json
import os

import torch
from torch import nn

from common import parse, write_result
from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import ProjectConfiguration
from fabric_lite.checkpoint import files as checkpoint_io

args = parse({"--dir": {"required": True}, "--background": {"action": "store_true"},
              "--pages": {"type": int, "default": 14}})
PAGE = os.sysconf("SC_PAGE_SIZE")
project = os.path.join(args.dir, "run")
filler = os.path.join(args.dir, "filler")

torch.manual_seed(0)
acc = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
model = nn.Linear(64, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = acc.prepare(model, opt)


def train_step():
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def fill_leaving(pages):
    stat = os.statvfs(args.dir)
    room = stat.f_bavail * stat.f_frsize - pages * PAGE
    with open(filler, "wb") as f:
        while room > 0:  # a write may stop short of a full request once the disk is nearly full
            try:
                room -= f.write(b"\0" * min(room, 1 << 20))
            except OSError:
                break


root = os.path.join(project, "checkpoints")
train_step()
acc.save_state()
attempts = []
for pages in range(args.pages):
    train_step()
    fill_leaving(pages)
    error = None
    try:
        acc.save_state(blocking=not args.background)
        acc.wait_for_checkpoint()
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    os.remove(filler)
    try:
        with open(os.path.join(root, "latest")) as f:
            latest = json.load(f)["name"]
    except (OSError, ValueError, KeyError) as err:
        latest = f"unreadable: {err}"
    try:
        checkpoint_io.verify(os.path.join(root, latest))
        latest_whole = True
    except checkpoint_io.CheckpointError:
        latest_whole = False
    newest = checkpoint_io.newest_whole_checkpoint(root)
    attempts.append({"pages": pages, "error": error, "listing": sorted(os.listdir(root)), "latest": latest,
                     "latest_whole": latest_whole, "newest": os.path.basename(newest) if newest else None})
    if error is None:
        break
# the run resumes from whatever the newest whole checkpoint is
resumed = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
m2 = nn.Linear(64, 16)
o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
m2, o2 = resumed.prepare(m2, o2)
loaded = os.path.basename(resumed.load_state())
write_result(args.out, 0, {"attempts": attempts, "loaded": loaded})
