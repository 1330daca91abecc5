"""Streams that keep their own position, killed mid-epoch and resumed (tests/data/test_stateful_sources.py).

Cases (`--cases`, comma separated), every one reading the items 0..47 once an epoch, in batches of 3:
- `stream`: a `ShardedStream` of 8 shards of 6 items (shard_sizes given), 2 loader workers; each process reads
  its own shards (the raw door: Accelerator.prepare, save_state/load_state);
- `state`: an IterableDataset with state_dict/load_state_dict (each worker reads every 2nd item), given as a
  torchdata StatefulDataLoader with 2 workers (the raw door; several processes: read by the main process alone,
  dispatch_batches' default for an IterableDataset);
- `hf`: an HF `datasets` streaming dataset built from 4 local JSON files, 2 workers (the raw door);
- `trainer`: the `stream` case through the Trainer (ModelCheckpoint, fit(ckpt_path="last")).

Every item read is appended to `<root>/<case>/reads-<phase>-<rank>.txt` (by the process or worker that reads it).
`--phase crash`: for each case an uninterrupted run (its steps and final weights recorded), then a run that saves
a checkpoint after step 3 (2 processes; one: 4) of epoch 0 and records what it trained on so far; the last case SIGKILLs itself two
steps later (its loader workers running), the others stop there. `--phase resume`: each case loads its checkpoint
(another number of processes allowed) and trains to the end; its steps and final weights are recorded.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common import parse, write_result
from fabric_lite import Accelerator, Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback, ModelCheckpoint
from fabric_lite.data import ShardedStream

args = parse({"--phase": {"required": True}, "--root": {"required": True}, "--cases": {"required": True}})

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
# saved after 3 steps of 2 processes (18 items) or 4 of one (12): what is left fills whole steps on 1 or 2
N, SHARD, BATCH, EPOCHS, SAVE_AT = 48, 6, 3, 2, 3 if WORLD == 2 else 4
KILL_AT = SAVE_AT + 2
CASE = ""  # the case running now (the readers log to its folder)
RESULT = {}


def log_read(item):
    with open(Path(args.root, CASE, f"reads-{args.phase}-{RANK}.txt"), "a") as f:
        f.write(f"{int(item)}\n")


def read_shard(shard, start):
    for i in range(shard * SHARD + start, (shard + 1) * SHARD):
        log_read(i)
        yield torch.tensor([i / N]), torch.tensor(i)


class Counting(IterableDataset):
    """Items 0..N-1; worker w of W reads items w, w + W, ...; its state: how many of those it has read."""

    def __init__(self):
        self.read = 0
        self.start = 0

    def __iter__(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(w, N, nw))
        start, self.start = self.start, 0
        for k in range(start, len(mine)):
            log_read(mine[k])
            self.read = k + 1
            yield torch.tensor([mine[k] / N]), torch.tensor(mine[k])

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.start = state["read"]


def hf_dataset():
    import datasets

    folder = Path(args.root, "hf-data")
    if RANK == 0 and not folder.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(4):
            rows = [json.dumps({"id": i}) for i in range(f * 12, (f + 1) * 12)]
            (folder / f"part{f}.jsonl.tmp").write_text("\n".join(rows) + "\n")
            os.replace(folder / f"part{f}.jsonl.tmp", folder / f"part{f}.jsonl")
    while len(list(folder.glob("part*.jsonl"))) < 4:
        pass
    files = sorted(str(p) for p in folder.glob("part*.jsonl"))
    data = datasets.load_dataset("json", data_files=files, split="train", streaming=True)

    def logged(row):
        log_read(row["id"])
        return {"x": [row["id"] / N], "id": row["id"]}

    return data.map(logged).with_format("torch")


def make_loader(case):
    if case in ("stream", "trainer"):
        stream = ShardedStream(list(range(N // SHARD)), read_shard, shard_sizes=[SHARD] * (N // SHARD))
        return DataLoader(stream, batch_size=BATCH, num_workers=2)
    if case == "state":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Counting(), batch_size=BATCH, num_workers=2)
    return DataLoader(hf_dataset(), batch_size=BATCH, num_workers=2)


def unpack(batch):
    if isinstance(batch, dict):
        return batch["x"].float(), batch["id"]
    return batch


class Module(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.steps = []

    def training_step(self, batch, batch_idx):
        x, ids = unpack(batch)
        self.steps.append(ids.tolist())
        return F.mse_loss(self.net(x), 2 * x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def weights(model):
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def raw(case, save=False, kill=False, resume=False):
    """(each step's ids on this process, final weights or None). `save`: save after step SAVE_AT of epoch 0 and
    stop there (`kill`: SIGKILL this process KILL_AT steps in)."""
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(case))
    if resume:
        accelerator.load_state(str(Path(args.root, case, "ckpt")))
    steps, step = [], 0
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            x, ids = unpack(batch)
            loss = F.mse_loss(model(x), 2 * x)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(ids.tolist())
            step += 1
            if save and step == SAVE_AT:
                accelerator.save_state(str(Path(args.root, case, "ckpt")))
                RESULT[case]["saved"] = list(steps)
                if not kill:
                    return steps, None
            if kill and step == KILL_AT:
                die(step)
    return steps, weights(model)


def die(step):
    """Write what the crash phase recorded, then SIGKILL this process (its loader workers running)."""
    write_result(args.out, RANK, RESULT)
    print(f"worker: rank {RANK} kills itself at step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(Callback):
    """The trainer door's crash: the steps up to the checkpoint recorded, SIGKILL two steps later."""

    def __init__(self, case, kill):
        self.case, self.kill = case, kill

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.kill and trainer.global_step == SAVE_AT:
            RESULT[self.case]["saved"] = list(module.steps)
        if self.kill and trainer.global_step == KILL_AT:
            trainer.accelerator.wait_for_checkpoint()
            die(trainer.global_step)


def trainer(case, save=False, kill=False, resume=False):
    set_seed(0)
    module = Module()
    root = Path(args.root, case, "trainer" if save or resume else "trainer-full")
    callbacks = [Killer(case, kill), ModelCheckpoint(every_n_train_steps=SAVE_AT, save_top_k=1)]
    fit = Trainer(max_epochs=EPOCHS, default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False,
                  num_sanity_val_steps=0, logger=False)
    fit.fit(module, make_loader(case), ckpt_path="last" if resume else None)
    return module.steps, weights(module.net)


def run(case, **kw):
    global CASE
    CASE = case
    Path(args.root, case).mkdir(parents=True, exist_ok=True)
    return (trainer if case == "trainer" else raw)(case, **kw)


cases = args.cases.split(",")
RESULT = {case: {} for case in cases}
if args.phase == "crash":
    assert "trainer" not in cases[:-1], "the trainer door is the killed case (last)"
    for case in cases:
        RESULT[case]["full"] = dict(zip(("steps", "weights"), run(case)))
    for case in cases[:-1]:
        run(case, save=True)
    run(cases[-1], save=True, kill=True)
    raise SystemExit("not killed")
for case in cases:
    RESULT[case] = dict(zip(("steps", "weights"), run(case, resume=True)))
write_result(args.out, RANK, RESULT)
