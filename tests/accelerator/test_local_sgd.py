"""`fabric_lite.local_sgd.LocalSGD` (Accelerate's `accelerate.local_sgd.LocalSGD`): on 2 real processes (gloo) it
equals a plain loop written by hand with torch.distributed, with and without gradient accumulation; alone or
disabled it does nothing; where parameters are sharded it is refused."""

import pytest
import torch
import torch.nn.functional as F

from fabric_lite import Accelerator
from fabric_lite.local_sgd import LocalSGD
from test_ddp_comm_hooks import ddp_feature_runs  # (one launch serves both files)


def _gap(a, b):
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    results, stdout = ddp_feature_runs(tmp_path_factory, 2)
    return [r["local_sgd"] for r in results], stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, every, accumulation", [("k3", 3, 1), ("k4_accum2", 4, 2)])
def test_two_processes_equal_the_loop_written_by_hand(two_processes, name, every, accumulation):
    results, _ = two_processes
    assert results[0]["world"] == 2
    for rank, result in enumerate(results):
        run = result["runs"][name]
        # after every step, each process's weights are those of its own plain loop (local steps, averaged every K)
        assert len(run["steps"]) == len(run["by_hand"]["steps"]) == 16
        for step, (mine, theirs) in enumerate(zip(run["steps"], run["by_hand"]["steps"])):
            assert _gap(mine, theirs) < 1e-6, (name, rank, step)
        assert _gap(run["final"], run["by_hand"]["final"]) < 1e-6
    first, second = (r["runs"][name] for r in results)
    stepped = False  # an optimizer step since the last average
    for step, (a, b) in enumerate(zip(first["steps"], second["steps"])):
        count = step % 8 + 1  # (8 micro-steps an epoch; each epoch's block counts its own, and averaged at its end)
        stepped = (stepped and count > 1) or count % accumulation == 0
        stepped = stepped and count % every != 0
        # between averages the processes drift apart: no gradient was all-reduced
        assert (_gap(a, b) == 0) == (not stepped), (name, step, _gap(a, b))
    assert first["final"] == second["final"]  # leaving the block averaged them
    # after the block DDP all-reduces gradients again (different data per process, the same gradients)
    assert first["grads_after_block"] == second["grads_after_block"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_accelerate_example_shape_on_two_processes(two_processes):
    (r0, r1), stdout = two_processes
    example = r0["example"]
    assert example["enabled"] and example["distributed_type"] == "MULTI_CPU"
    # 96 samples, batch 8, 2 processes: 6 micro-steps each epoch, each followed by local_sgd.step()
    assert example["local_steps_counted"] == [6, 6, 6]
    assert example["weights"] == r1["example"]["weights"]  # averaged when each epoch's block ended
    assert example["evaluated"] == 40 and example["accuracies"][-1] > 0.5
    assert stdout.count("epoch 2:") == 2  # accelerator.print: the main process (this example and the hooks' one)
    lookup = r0["model_lookup"]
    assert lookup["unwrapped_finds_prepared"]
    assert "did not prepare" in lookup["unprepared_refused"] and "accelerator.prepare()" in lookup["unprepared_refused"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_alone_it_does_nothing(tmp_path_factory):
    (result,), _ = ddp_feature_runs(tmp_path_factory, 1)
    result = result["local_sgd"]
    for name, run in result["runs"].items():
        assert run["steps"] == run["by_hand"]["steps"], name  # (the plain loop alone never averages either)
    example = result["example"]
    assert not example["enabled"] and example["distributed_type"] == "NO"
    assert example["local_steps_counted"] == [12, 12, 12] and example["evaluated"] == 40


def test_disabled_or_alone_is_a_no_op_in_process():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    for enabled, steps in ((True, 2), (False, None)):
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=steps, enabled=enabled) as local_sgd:
            assert not local_sgd.enabled
            for _ in range(3):
                accelerator.backward(F.mse_loss(model(torch.ones(4, 3)), torch.zeros(4, 1)))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
        assert local_sgd.num_steps == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # (it trained, untouched)


@pytest.mark.parametrize("steps", [0, -1, None, 2.5, True])
def test_bad_local_sgd_steps(steps):
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"local_sgd_steps=.*an integer >= 1 \(or enabled=False"):
        LocalSGD(accelerator, model, steps)


def test_refused_where_parameters_are_sharded():
    accelerator = Accelerator(strategy="fsdp", cpu=True)
    try:
        with pytest.raises(NotImplementedError, match=r"this run is FSDP \(strategy FSDPStrategy\), which shards them.*"
                                                       r"strategy='ddp'.*enabled=False"):
            LocalSGD(accelerator=accelerator, model=torch.nn.Linear(2, 2), local_sgd_steps=4)
        # turned off, it does nothing anywhere
        with LocalSGD(accelerator=accelerator, model=torch.nn.Linear(2, 2), local_sgd_steps=None, enabled=False) as off:
            off.step()
    finally:
        accelerator.end_training()
