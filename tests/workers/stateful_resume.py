"""Accelerate-style training with `DataLoaderConfiguration(use_stateful_dataloader=...)`, killed mid-epoch.

`--phase crash`: for each case, an uninterrupted run (its batches and final weights recorded), then a second
run that `save_state`s mid-epoch and goes on; after the last case's save every process SIGKILLs itself in the
middle of that epoch (loader workers running). `--phase resume`: a fresh process per rank, for each case, builds
everything again, `load_state`s and continues as Accelerate's examples do (the loader as it is when stateful,
`skip_first_batches(loader, resume_step)` when not), recording its batches and final weights.

With `--dispatch-checks` the crash phase also compares, for a few loaders, the batches each process gets with
`dispatch_batches=True` and with False (recorded in the result).
"""

import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from common import parse, write_result
from fabric_lite import Accelerator, DataLoaderConfiguration, set_seed

args = parse({"--phase": {"required": True}, "--root": {"required": True},
              "--dispatch-checks": {"action": "store_true"}})

N, BATCH, EPOCHS = 26, 2, 2


class Augmented(Dataset):
    """Sample i: fixed features plus noise drawn from torch's RNG (the worker's with num_workers > 0)."""

    def __init__(self, n=N):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), torch.tensor(i)


class Stream(IterableDataset):
    """The same samples, streamed (read by the main process alone under dispatch_batches)."""

    def __init__(self, n=N):
        self.data = Augmented(n)

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        global READS
        for i in range(len(self.data)):
            READS += 1
            yield self.data[i]


READS = 0  # samples this process read from a Stream


CASES = {  # name: (stateful, num_workers, dataset, dispatch_batches)
    "stateful_w0": (True, 0, Augmented, None),
    "stateful_w2": (True, 2, Augmented, None),
    "plain_w0": (False, 0, Augmented, None),
    "plain_w2": (False, 2, Augmented, None),
}
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    CASES["stateful_stream_dispatched"] = (True, 0, Stream, None)  # (None: dispatched, an IterableDataset)
    CASES["stateful_dispatched_w2"] = (True, 2, Augmented, True)


def build(case):
    stateful, workers, dataset, dispatch = CASES[case]
    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, dispatch_batches=dispatch)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shuffle = not isinstance(dataset(), IterableDataset)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=shuffle, num_workers=workers)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def train_step(accelerator, model, optimizer, batch, seen):
    x, ids = batch
    loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    seen.append({"ids": ids.tolist(), "x": float(x.sum()), "loss": float(loss.detach())})


def run(case, save=False, resume_from=None, stop_after_save=False, kill=False):
    """Train EPOCHS epochs the way Accelerate's examples do; returns (steps seen, final weights). `save`: save
    three steps into the second epoch; then return (`stop_after_save`), or SIGKILL this process two steps
    later (`kill`)."""
    accelerator, model, optimizer, loader = build(case)
    stateful = CASES[case][0]
    steps_per_epoch = len(loader)
    overall, starting_epoch, resume_step, seen = 0, 0, None, []
    save_at = steps_per_epoch + 3 if save else None
    if resume_from is not None:
        accelerator.load_state(resume_from)
        resume_step = int(Path(resume_from, "step.txt").read_text())
        starting_epoch, resume_step = divmod(resume_step, steps_per_epoch)
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        if resume_step is not None and epoch == starting_epoch:
            active = loader if stateful else accelerator.skip_first_batches(loader, resume_step)
            overall += epoch * steps_per_epoch + resume_step
        else:
            active = loader
        for batch in active:
            train_step(accelerator, model, optimizer, batch, seen)
            overall += 1
            if overall == save_at:
                where = Path(args.root, case)
                accelerator.save_state(str(where))
                if accelerator.is_main_process:
                    (where / "step.txt").write_text(str(overall))
                accelerator.wait_for_everyone()
                if stop_after_save:
                    return seen, None
            if kill and overall == steps_per_epoch + 5:
                os.kill(os.getpid(), signal.SIGKILL)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return seen, weights


def dispatch_checks():
    """Each process's batches for two epochs, with dispatch_batches True and False (same loaders otherwise)."""
    from torch.utils.data import TensorDataset

    results = {}
    for name, make, split, even in (
        ("map", lambda: DataLoader(TensorDataset(torch.arange(23)), batch_size=3, shuffle=True), False, True),
        ("map_split", lambda: DataLoader(TensorDataset(torch.arange(23)), batch_size=4, shuffle=True), True, True),
        ("map_uneven", lambda: DataLoader(TensorDataset(torch.arange(23)), batch_size=3), False, False),
        ("stream", lambda: DataLoader(Stream(23), batch_size=3), False, True),
        ("stream_uneven", lambda: DataLoader(Stream(23), batch_size=3), False, False),
        ("dict_batches", lambda: DataLoader([{"a": torch.tensor(i), "name": f"s{i}"} for i in range(11)],
                                            batch_size=2), False, True),
    ):
        runs = {}
        for dispatch in (True, False):
            global READS
            READS = 0
            set_seed(3)
            config = DataLoaderConfiguration(dispatch_batches=dispatch, split_batches=split, even_batches=even)
            accelerator = Accelerator(cpu=True, dataloader_config=config)
            loader = accelerator.prepare(make())
            epochs = []
            for _ in range(2):
                batches = []
                for batch in loader:
                    if isinstance(batch, dict):
                        batches.append([batch["a"].tolist(), batch["name"], accelerator.gradient_state.end_of_dataloader])
                    else:
                        values = batch[0]
                        batches.append([values.tolist() if values.dtype == torch.int64 else round(float(values.sum()), 5),
                                        accelerator.gradient_state.end_of_dataloader])
                epochs.append(batches)
            runs[str(dispatch)] = {"epochs": epochs, "len": len(loader), "remainder": loader.remainder,
                                   "reads": READS}
        results[name] = runs
    return results


rank = int(os.environ.get("RANK", "0"))
if args.phase == "crash":
    result = {"full": {}}
    if args.dispatch_checks:
        result["dispatch"] = dispatch_checks()
    names = list(CASES)
    for case in names:
        steps, weights = run(case)
        result["full"][case] = {"steps": steps, "weights": weights}
    for case in names[:-1]:
        run(case, save=True, stop_after_save=True)
    write_result(args.out, rank, result)
    # the last case: saved mid-epoch, then killed while its epoch (and its loader's workers) are running
    run(names[-1], save=True, kill=True)
    raise SystemExit("not killed")
else:
    result = {"resumed": {}}
    for case in CASES:
        steps, weights = run(case, resume_from=str(Path(args.root, case)))
        result["resumed"][case] = {"steps": steps, "weights": weights}
    write_result(args.out, rank, result)
    print(json.dumps({"done": True}))
