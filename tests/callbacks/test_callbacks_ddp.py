"""The callbacks that change what trains under DDP, on 2 real processes (torchrun, gloo on CPU), against one
process with the global batch: BackboneFinetuning (frozen backbone, then a new parameter group that DDP
all-reduces), GradientAccumulationScheduler (the window changes between epochs on every rank) and ModelPruning
(the same L1 masks on every rank)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import WORKERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import torchrun

    tmp = tmp_path_factory.mktemp("callbacks_ddp")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    return torchrun(WORKERS / "callbacks_ddp.py", 2, "--root", tmp / "root", out_dir=tmp, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    sys.path.insert(0, str(WORKERS))
    try:
        import callbacks_common as cc

        tmp = tmp_path_factory.mktemp("reference")
        ft_trainer, ft = cc.fit(str(tmp / "ft"), 8, cc.finetuning())
        acc_trainer, acc = cc.fit(str(tmp / "acc"), 4, cc.accumulation())
        prune_trainer, pruned = cc.fit(str(tmp / "prune"), 8, cc.pruning())
        return {"finetuning": (ft_trainer.global_step, ft), "accumulation": (acc_trainer.global_step, acc),
                "pruning": (prune_trainer.global_step, pruned)}
    finally:
        sys.path.remove(str(WORKERS))


@pytest.mark.parametrize("name", ["finetuning", "accumulation", "pruning"])
def test_two_processes_equal_one_with_the_global_batch(runs, reference, name):
    r0, r1 = (r[name] for r in runs)
    assert "world" not in r0 or r0["world"] == 2
    step, weights = reference[name]
    assert r0["global_step"] == r1["global_step"] == step
    assert r0["weights"] == r1["weights"]  # the replicas stay identical: the new group's gradients are all-reduced
    torch.testing.assert_close(torch.tensor(r0["weights"]), torch.tensor(weights), rtol=0, atol=1e-6)
    if name == "pruning":  # 3 epochs of 30% of what is left: 1 - 0.7**3 of the 40 weights, rounded each time
        assert sum(v == 0.0 for v in weights) == 26


def test_finetuning_under_ddp_without_find_unused_parameters_is_refused_on_every_rank(runs):
    for r in runs:
        assert "DDPStrategy(find_unused_parameters=True)" in r["refused"]
