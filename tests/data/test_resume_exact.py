"""Resume faults that once made a resumed run differ from the uninterrupted one (CPU, bit for bit): a custom
sampler shuffling with the global RNG, an IterableDataset drawing from the global RNG, and random
augmentation in `__getitem__` loaded by worker processes (mid-epoch, persistent workers at an epoch boundary,
WeightedRandomSampler). The full grid is tests/data/test_resume_matrix.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, WeightedRandomSampler

from resume_runs import BATCH, N, Augmented, GlobalShuffle, Plain, Stream, resume_gaps, unexpected


def _assert_exact(gaps):
    for point, gap in gaps.items():
        assert gap["exact"], f"resumed from {point}: max |diff| = {gap['diff']:.3g}"
        assert not unexpected(gap["warnings"]), (point, gap["warnings"])


def test_a_custom_sampler_shuffling_with_the_global_rng_resumes_mid_epoch_exactly(tmp_path):
    """Its epoch is replayed from the global RNG as it was when the order was drawn, not redrawn from the
    checkpoint's mid-epoch state and cut (which saw some samples twice and others never)."""
    def make():
        return DataLoader(Plain(), batch_size=BATCH, sampler=GlobalShuffle(N))

    _assert_exact(resume_gaps(make, [("micro", 8), ("micro", 3)], tmp_path))


def test_the_global_rng_after_a_custom_sampler_replay_is_the_checkpoints(tmp_path):
    """The replayed draw leaves the global RNG where the checkpoint put it (training draws after it match)."""
    from fabric_lite import Accelerator

    def make():
        return DataLoader(Plain(), batch_size=BATCH, sampler=GlobalShuffle(N))

    acc = Accelerator()
    loader = acc.prepare(make())
    it = iter(loader)
    whole = [next(it)[1].tolist() for _ in range(2)]
    acc.save_state(tmp_path / "ckpt")
    after = torch.rand(5)
    whole += [batch[1].tolist() for batch in it]
    torch.rand(3)

    acc2 = Accelerator()
    loader2 = acc2.prepare(make())
    acc2.load_state(tmp_path / "ckpt")
    resumed = iter(loader2)
    first = next(resumed)[1].tolist()
    assert torch.equal(torch.rand(5), after)
    assert [first] + [batch[1].tolist() for batch in resumed] == whole[2:]


def test_an_iterable_dataset_drawing_from_the_global_rng_resumes_mid_epoch_exactly(tmp_path):
    """The skipped items are drawn under the epoch-start RNG state, then the checkpoint's state is restored."""
    def make():
        return DataLoader(Stream(), batch_size=BATCH)

    _assert_exact(resume_gaps(make, [("micro", 8), ("micro", 3), ("micro", 6)], tmp_path))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["mid-epoch", "persistent, epoch boundary", "persistent, mid-epoch",
                                  "weighted sampler", "one batch into the epoch"])
def test_random_augmentation_loaded_by_workers_resumes_exactly(tmp_path, case):
    persistent = case.startswith("persistent")

    def make():
        sampler = WeightedRandomSampler(torch.linspace(0.5, 2.0, N), N) if case == "weighted sampler" else None
        return DataLoader(Augmented(), batch_size=BATCH, shuffle=sampler is None, sampler=sampler, num_workers=2,
                          persistent_workers=persistent)

    points = {"mid-epoch": [("micro", 9)], "persistent, epoch boundary": [("epoch", 1)],
              "persistent, mid-epoch": [("micro", 9)], "weighted sampler": [("micro", 8)],
              "one batch into the epoch": [("micro", 7)]}[case]
    _assert_exact(resume_gaps(make, points, tmp_path))
