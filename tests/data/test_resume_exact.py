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


class _PythonAndNumpy(Plain):
    """Augmentation from Python's global `random` and NumPy's global RNG."""

    def __getitem__(self, i):
        import random

        import numpy as np

        return self.x[i] + random.random() + float(np.random.rand()), self.y[i]


@pytest.mark.timeout(120)
def test_python_and_numpy_randomness_in_workers_resumes_exactly(tmp_path):
    def make():
        return DataLoader(_PythonAndNumpy(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

    _assert_exact(resume_gaps(make, [("micro", 9), ("epoch", 1)], tmp_path))


def _saved_mid_epoch(make):
    from fabric_lite import Accelerator

    loader = Accelerator().prepare(make())
    it = iter(loader)
    next(it)
    next(it)
    return loader.state_dict()


def test_a_checkpoint_without_the_epoch_start_rng_state_warns_naming_the_sampler():
    """A checkpoint of an older version holds no global RNG state from the epoch's start: the custom sampler's
    order cannot be replayed, and the warning names the sampler's class and the cause, once."""
    from fabric_lite import Accelerator

    def make():
        return DataLoader(Plain(), batch_size=BATCH, sampler=GlobalShuffle(N))

    state = _saved_mid_epoch(make)
    del state["generator_state"]["global"]
    loader = Accelerator().prepare(make())
    loader.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"GlobalShuffle draws from the global random .* older version") as seen:
        assert len(list(loader)) == N // BATCH - 2
    assert len([w for w in seen if "GlobalShuffle" in str(w.message)]) == 1
    list(loader)  # the next epoch draws afresh, as the uninterrupted run: no warning


@pytest.mark.timeout(60)
def test_resuming_with_another_number_of_workers_warns_naming_both():
    from fabric_lite import Accelerator

    def make(workers):
        return lambda: DataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=workers)

    state = _saved_mid_epoch(make(2))
    loader = Accelerator().prepare(make(1)())
    with pytest.warns(UserWarning, match=r"num_workers=2 and resumes with num_workers=1"):
        loader.load_state_dict(state)
    assert len(list(loader)) == N // BATCH - 2


@pytest.mark.timeout(60)
def test_loading_into_a_loader_whose_persistent_workers_run_restarts_them_from_the_saved_states(tmp_path):
    """load_state in the same process, into a loader that already started its persistent workers: they cannot
    take the saved states, so new ones start; the rest of the epoch equals the saved run's."""
    from fabric_lite import Accelerator

    def make():
        return DataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True,
                          generator=torch.Generator().manual_seed(7))

    acc = Accelerator()
    loader = acc.prepare(make())
    list(loader)
    it = iter(loader)
    next(it)
    acc.save_state(tmp_path / "ckpt")
    rest = [x.tolist() for x, _ in it]
    list(loader)  # the workers go on into another epoch
    acc.load_state(tmp_path / "ckpt")
    assert [x.tolist() for x, _ in loader] == rest
