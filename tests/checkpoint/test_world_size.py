"""A checkpoint saved by 2 processes resumes on 1 and on 3, in both doors (DDP): the epoch goes on in the same
order from the next unseen sample, so every sample of the epoch is trained exactly once across the break
(asserted from the recorded sample indices), whether the per-process batch or the global batch is kept; with
the global batch kept, the final weights equal an uninterrupted run's to 1e-6 (only the order in which the
processes' gradients are summed differs). Same-world-size resume is bit-exact (tests/checkpoint/test_resume.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from test_resume import Run

pytestmark = pytest.mark.slow
DOORS = ("raw", "trainer")
N = 96
#: Tolerance for weights after a resume on another number of processes, with the global batch kept.
TOLERANCE = 1e-6


def _epoch_order_of(batch):
    """The samples of the epoch in the order a plain DataLoader (the same generator) gives them."""
    plain = DataLoader(TensorDataset(torch.arange(N)), batch_size=batch, shuffle=True,
                       generator=torch.Generator().manual_seed(7))
    return [i for (batch,) in plain for i in batch.tolist()]


def _epoch_order():
    return _epoch_order_of(8)


def _launch(out, nproc, door, phase, batch, ckpt, save_at=0, accum=1):
    return Run("world_resume.py", out, "--door", door, "--phase", phase, "--batch", batch, "--save-at", save_at,
               "--ckpt", ckpt, "--accum", accum, nproc=nproc, launcher="torchrun" if nproc > 1 else None, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch, a few at a time: saves (and the uninterrupted references) first, then the resumes."""
    root = tmp_path_factory.mktemp("world_size")
    first, second = {}, {}
    for door in DOORS:
        first[door, "save-b8"] = _launch(root / door / "save-b8", 2, door, "save", 8, root / door / "ckpt-b8", 3)
        first[door, "save-g24"] = _launch(root / door / "save-g24", 2, door, "save", 12, root / door / "ckpt-g24", 2)
        first[door, "full-g24"] = _launch(root / door / "full-g24", 2, door, "full", 12, root / door / "none")
    # inside an accumulation window (2 micro-steps of a global 24 each; saved after micro-step 3)
    for nproc, batch in ((2, 12), (1, 24)):
        first["window", f"save-on-{nproc}"] = _launch(root / f"window-save-{nproc}", nproc, "raw", "save", batch,
                                                      root / f"window-ckpt-{nproc}", 3, accum=2)
    first["window", "full"] = _launch(root / "window-full", 2, "raw", "full", 12, root / "none", accum=2)
    results = {key: run.ok() for key, run in first.items()}
    for door in DOORS:
        for nproc, batch, kind in ((1, 8, "b8"), (3, 8, "b8"), (1, 24, "g24"), (3, 8, "g24")):
            second[door, f"resume-{kind}-on-{nproc}"] = _launch(root / door / f"resume-{kind}-{nproc}", nproc, door,
                                                                "resume", batch, root / door / f"ckpt-{kind}")
    for saved, nproc, batch in ((2, 1, 24), (2, 3, 8), (1, 2, 12)):
        second["window", f"{saved}-to-{nproc}"] = _launch(root / f"window-{saved}-to-{nproc}", nproc, "raw", "resume",
                                                          batch, root / f"window-ckpt-{saved}", accum=2)
    results.update({key: run.ok() for key, run in second.items()})
    return results


def _global_order(ranks):
    """A run's samples in global order: step by step, each rank's batch in rank order."""
    return [i for step in zip(*(r["steps"] for r in ranks)) for batch in step for i in batch]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("kept", ["b8", "g24"], ids=["per-process-batch-kept", "global-batch-kept"])
@pytest.mark.parametrize("nproc", [1, 3])
def test_every_sample_once_in_the_epochs_order_across_the_break(runs, door, kept, nproc):
    before = _global_order(runs[door, f"save-{kept}"])
    after = _global_order(runs[door, f"resume-{kept}-on-{nproc}"])
    assert len(before) == 48  # 3 steps of 2x8, or 2 steps of 2x12
    assert before + after == _epoch_order()  # nothing repeated, nothing skipped, the same order


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("nproc", [1, 3])
def test_with_the_global_batch_kept_the_weights_equal_the_uninterrupted_run(runs, door, nproc):
    resumed = torch.tensor(runs[door, f"resume-g24-on-{nproc}"][0]["weights"])
    straight = torch.tensor(runs[door, "full-g24"][0]["weights"])
    assert (resumed - straight).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("change", ["2-to-1", "2-to-3", "1-to-2"])
def test_a_checkpoint_inside_an_accumulation_window_resumes_on_another_number_of_processes(runs, change):
    """Every process of the resumed run takes the mean of the saved processes' partial gradients, so the
    window's closing all-reduce gives the uninterrupted run's gradient (not the saved rank 0's share alone)."""
    resumed = torch.tensor(runs["window", change][0]["weights"])
    straight = torch.tensor(runs["window", "full"][0]["weights"])
    before = _global_order(runs["window", f"save-on-{change[0]}"])
    assert len(before) == 72 and before + _global_order(runs["window", change]) == _epoch_order_of(24)
    assert (resumed - straight).abs().max().item() <= TOLERANCE
