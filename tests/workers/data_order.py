"""A prepared loader's data order on every rank against a plain loader of the whole batch (tests/data/test_order.py).

Each case builds a plain DataLoader with batch W*b (what one process would read) and a prepared one with
batch b per rank, reads both for 3 epochs, and reports the plain batches and, step by step, every rank's
batch side by side (gathered: rank 0's first). Rank 0 writes the report; the others write their rank.
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator, set_seed

args = parse()
rank = int(os.environ.get("RANK", "0"))
acc = Accelerator()
W = acc.num_processes
EPOCHS = 3
B = 3
N = 23  # not a multiple of W*B: the last step is padded on the prepared side


def indices(batch):
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


def epochs(loader, count=EPOCHS):
    return [[indices(batch) for batch in loader] for _ in range(count)]


def joined(loader, count=EPOCHS):
    """Every epoch's steps, each the ranks' batches side by side, and the number of real samples in the last."""
    out = []
    for _ in range(count):
        steps = []
        for batch in loader:
            every = [None] * W
            dist.all_gather_object(every, indices(batch))
            steps.append(every)
        out.append({"steps": steps, "remainder": loader.remainder})
    return out


def data():
    return TensorDataset(torch.arange(N))


results = {}

# shuffle=True with a generator, seeded the same on every rank
g = torch.Generator().manual_seed(42)
results["generator"] = {"plain": epochs(DataLoader(data(), batch_size=W * B, shuffle=True, generator=g))}
g = torch.Generator().manual_seed(42)
results["generator"]["prepared"] = joined(acc.prepare(DataLoader(data(), batch_size=B, shuffle=True, generator=g)))
reference = torch.Generator().manual_seed(42)
for _ in range(EPOCHS):
    list(DataLoader(data(), batch_size=W * B, shuffle=True, generator=reference))
results["generator"]["state_after"] = torch.equal(g.get_state(), reference.get_state())

# shuffle=True without a generator: the global RNG of each rank differs (a per-process seed); rank 0's draw wins
set_seed(100)
results["global"] = {"plain": epochs(DataLoader(data(), batch_size=W * B, shuffle=True))}
set_seed(100 + rank)
results["global"]["prepared"] = joined(acc.prepare(DataLoader(data(), batch_size=B, shuffle=True)))

# the generator reseeded after prepare, at the start of every epoch
g = torch.Generator()
plain = DataLoader(data(), batch_size=W * B, shuffle=True, generator=g)
results["reseed"] = {"plain": []}
for epoch in range(EPOCHS):
    g.manual_seed(7 + epoch % 2)
    results["reseed"]["plain"].extend(epochs(plain, 1))
g = torch.Generator().manual_seed(1)
prepared = acc.prepare(DataLoader(data(), batch_size=B, shuffle=True, generator=g))
results["reseed"]["prepared"] = []
for epoch in range(EPOCHS):
    g.manual_seed(7 + epoch % 2)
    results["reseed"]["prepared"].extend(joined(prepared, 1))

# batches drawn by a sampler: DataLoader(sampler=BatchSampler(...), batch_size=None)
g = torch.Generator().manual_seed(5)
plain = DataLoader(data(), sampler=BatchSampler(RandomSampler(data(), generator=g), W * B, False), batch_size=None)
results["batch_sampler"] = {"plain": epochs(plain)}
g = torch.Generator().manual_seed(5)
loader = DataLoader(data(), sampler=BatchSampler(RandomSampler(data(), generator=g), B, False), batch_size=None)
prepared = acc.prepare(loader)
results["batch_sampler"]["len"] = len(prepared)
results["batch_sampler"]["prepared"] = joined(prepared)

# resume in the second epoch from the loader's state (generator and global RNG both in play)
for name, seeded in (("resume_generator", True), ("resume_global", False)):
    def build():
        return acc.prepare(DataLoader(data(), batch_size=B, shuffle=True,
                                      generator=torch.Generator().manual_seed(3) if seeded else None))
    set_seed(11)
    whole = joined(build())
    set_seed(11)
    first = build()
    part = joined(first, 1)
    it = iter(first)
    seen = []
    for _ in range(2):
        every = [None] * W
        dist.all_gather_object(every, indices(next(it)))
        seen.append(every)
    state, rng = first.state_dict(), torch.get_rng_state()
    del it
    set_seed(999)
    second = build()
    second.load_state_dict(state)
    torch.set_rng_state(rng)  # as a checkpoint restores it
    rest = joined(second, 2)
    results[name] = {"whole": whole, "resumed": part + [{"steps": seen + rest[0]["steps"],
                                                         "remainder": rest[0]["remainder"]}] + rest[1:]}

write_result(args.out, rank, results if rank == 0 else {"rank": rank})
