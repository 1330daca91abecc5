"""A checkpoint of a 2x2 layout (FSDP over dp_shard 2 x tensor parallel 2) resumes *training* on other layouts:
FSDP over 4 processes without tensor parallelism, one process, and DDP on 2 processes. Each resumed run goes on
with the next unseen sample of the saved epoch, trains every remaining sample of both epochs exactly once (asserted
from the recorded sample indices) and ends with the weights of the uninterrupted 2x2 run to 1e-6: the DCP load
reshards the weights and AdamW's state from the tensor-parallel shards, and the data position, kept in global
samples, carries over because the global batch is the same (tests/workers/nd_resume.py; real processes, gloo)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
N, EPOCHS = 48, 2
STOP_AFTER = 2  # optimizer steps: 4 micro-batches of 8, two thirds into the first epoch
#: Tolerance for the weights after a resume on another layout (the gradients are summed in another order).
TOLERANCE = 1e-6


def _order(ranks):
    """A run's (epoch, sample) pairs in global order: micro-batch by micro-batch, each data-parallel replica's
    batch in dp-rank order, counting one rank of each tensor-parallel group."""
    by_dp = {}
    for r in ranks:
        by_dp.setdefault(r["dp_rank"], []).append(r["seen"])
    assert sorted(by_dp) == list(range(ranks[0]["dp"]))
    for group in by_dp.values():  # the ranks of one tensor-parallel group trained on the same batches
        assert all(seen == group[0] for seen in group)
    pairs = []
    for step in zip(*(by_dp[d][0] for d in sorted(by_dp))):
        assert len({epoch for epoch, _ in step}) == 1
        pairs += [(step[0][0], i) for _, batch in step for i in batch]
    return pairs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted 2x2 run, and a 2x2 run saved after STOP_AFTER optimizer steps (one checkpoint, read by
    every resume)."""
    from conftest import torchrun, WORKERS

    root = tmp_path_factory.mktemp("nd_resume")
    full = torchrun(WORKERS / "nd_resume.py", 4, "--sizes", "1,2,2", out_dir=root, timeout=240)
    (root / "stop").mkdir()
    ckpt = root / "ckpt"
    stopped = torchrun(WORKERS / "nd_resume.py", 4, "--sizes", "1,2,2", "--stop-after", STOP_AFTER, "--save", ckpt,
                       out_dir=root / "stop", timeout=240)
    return {"full": full, "stopped": stopped, "ckpt": ckpt}


@pytest.mark.timeout(400)
def test_the_2x2_run_trains_each_epoch_once_and_is_saved_with_its_layout(saved):
    full = _order(saved["full"])
    for epoch in range(EPOCHS):
        assert sorted(i for e, i in full if e == epoch) == list(range(N))
    assert _order(saved["stopped"]) == full[:2 * STOP_AFTER * 8]
    meta = json.loads((saved["ckpt"] / "manifest.json").read_text())["meta"]
    assert meta["layout"] == {"dp": 2, "tp": 2} and meta["world_size"] == 4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sizes, nproc", [("1,4,1", 4), ("1,1,1", 1), ("ddp", 2)],
                         ids=["fsdp_4x1", "one_process", "ddp_2"])
def test_a_2x2_checkpoint_resumes_training_on_another_layout_exactly(launch, saved, sizes, nproc):
    resumed = launch("nd_resume", nproc, "--sizes", sizes, "--load", saved["ckpt"], timeout=240)
    before, after, full = _order(saved["stopped"]), _order(resumed), _order(saved["full"])
    # every remaining sample of the saved epoch and all of the next, once each, in the uninterrupted run's order
    assert len(before) == 32 and len(after) == EPOCHS * N - 32
    assert before + after == full
    weights, straight = resumed[0]["weights"], saved["full"][0]["weights"]
    assert sorted(weights) == sorted(straight)
    for name, value in straight.items():
        assert len(weights[name]) == len(value)
        assert max(abs(a - b) for a, b in zip(weights[name], value)) <= TOLERANCE, name
