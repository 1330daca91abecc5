"""Resume exactness, cell by cell: sampler kind x worker processes x randomness in the dataset x where the
checkpoint was saved. Each cell trains a Linear for 2 epochs of 6 batches (24 samples, batch 4) with
gradient_accumulation_steps=2, saving on its way at an epoch boundary, mid-epoch (after an optimizer step)
and inside an accumulation window (after an odd number of micro-steps); each checkpoint is resumed in a
fresh Accelerator with identically built objects and must end with the uninterrupted run's weights, bit for
bit, or warn, naming the cause, where that cannot be (one cell below). One process; world-size changes are
tests/checkpoint/test_world_size.py's. The uninterrupted run and its three resumes share one test, so a cell
starts its workers 4 to 6 times, not 12."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, WeightedRandomSampler

from resume_runs import BATCH, N, Augmented, GlobalShuffle, Plain, Stream, resume_gaps, unexpected

POINTS = [("epoch", 1), ("micro", 8), ("micro", 3)]  # epoch boundary, mid-epoch (epoch 2), mid-window (epoch 1)

SAMPLERS = {
    "sequential": lambda ds: {},
    "shuffled, generator": lambda ds: {"shuffle": True, "generator": torch.Generator().manual_seed(3)},
    "shuffled, global RNG": lambda ds: {"shuffle": True},
    "weighted": lambda ds: {"sampler": WeightedRandomSampler(torch.linspace(0.5, 2.0, N), N)},
    "custom, global RNG": lambda ds: {"sampler": GlobalShuffle(N)},
    "batch_sampler": lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), BATCH, drop_last=False)},
}
WORKERS = {"no workers": {}, "2 workers": {"num_workers": 2},
           "2 persistent workers": {"num_workers": 2, "persistent_workers": True}}
DATASETS = {"no randomness": Plain, "torch RNG in __getitem__": Augmented}

CELLS = [(s, w, d) for s in SAMPLERS for w in WORKERS for d in DATASETS]
CELLS += [("sequential", w, "IterableDataset drawing from the global RNG") for w in WORKERS]

# Where exactness cannot be: an IterableDataset's persistent workers draw their items themselves, and their random
# state after an earlier epoch is nowhere to be restored from; the resumed run says so.
PERSISTENT_ITERABLE = "IterableDataset with persistent_workers=True"


def _loader(sampler, workers, dataset):
    ds = Stream() if dataset.startswith("IterableDataset") else DATASETS[dataset]()
    kwargs = {**SAMPLERS[sampler](ds), **WORKERS[workers]}
    if "batch_sampler" not in kwargs:
        kwargs["batch_size"] = BATCH
    return DataLoader(ds, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampler, workers, dataset", CELLS)
def test_resume_is_exact(tmp_path, sampler, workers, dataset):
    gaps = resume_gaps(lambda: _loader(sampler, workers, dataset), POINTS, tmp_path)
    failures = []
    for point, gap in gaps.items():
        inexact = dataset.startswith("IterableDataset") and "persistent" in workers and point != ("micro", 3)
        if inexact:  # (the workers ran an epoch before the checkpoint)
            if not any(PERSISTENT_ITERABLE in w for w in gap["warnings"]):
                failures.append(f"{point}: no warning naming '{PERSISTENT_ITERABLE}' ({gap['warnings']})")
        elif not gap["exact"]:
            failures.append(f"{point}: max |diff| = {gap['diff']:.3g}")
        extra = unexpected(gap["warnings"], PERSISTENT_ITERABLE if inexact else None)
        if extra:
            failures.append(f"{point}: unexpected warnings {extra}")
    assert not failures, failures
