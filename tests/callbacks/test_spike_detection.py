"""SpikeDetection (fabric_lite.callbacks) and the raw door's watch_losses()/step_is_finite(): a spike decided by
every process together, before the optimizer steps. On 2 real processes (torchrun, gloo on CPU) the loss is NaN on
rank 1 only, at one batch: "skip" leaves both replicas equal to a plain loop without that step, "rollback" goes back
to the same checkpoint on both and never trains on the batch (nor after a later kill and resume), "error" raises on
both at that batch, "warn" warns on both; no mode hangs (the launch has a timeout). One process: the arguments and
the finite spikes of the loss and of the gradient norm."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from conftest import WORKERS

from fabric_lite.callbacks import SpikeDetection, TrainingSpikeException

sys.path.insert(0, str(WORKERS))
try:
    import spike_common as sc  # (the runs the 2-process worker makes, made here on one process)
finally:
    sys.path.remove(str(WORKERS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import torchrun

    tmp = tmp_path_factory.mktemp("spike_ddp")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    return torchrun(WORKERS / "spike_ddp.py", 2, "--root", tmp / "root", out_dir=tmp, env=env, timeout=120)


def close(a, b):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def two_processes(test):
    return pytest.mark.timeout(180)(pytest.mark.slow(test))


@two_processes
def test_skip_equals_a_plain_loop_without_that_step_and_costs_no_collective(runs):
    r0, r1 = runs
    assert r0["skip"]["weights"] == r1["skip"]["weights"]
    assert torch.isfinite(torch.tensor(r0["skip"]["weights"])).all()
    close(r0["skip"]["weights"], r0["reference"]["weights"])
    assert r0["skip"]["global_step"] == r1["skip"]["global_step"] == r0["reference"]["global_step"] - 1
    # under DDP the gradient all-reduce carries the decision: no all-reduce of its own
    assert r0["skip"]["reduces"] == r0["reference"]["reduces"]


@two_processes
def test_rollback_restores_the_same_checkpoint_and_never_trains_on_the_batch(runs):
    for r in runs:
        rb = r["rollback"]
        assert json.loads(rb["excluded"]) == [[0, 2]]
        # batch 2 ran its forward once (the spike); after going back to the checkpoint of step 2 it is left out
        assert rb["seen"] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [1, 3]]
        close(rb["weights"], r["skip"]["weights"])  # the same as never stepping on it
        assert rb["global_step"] == 7
    assert runs[0]["rollback"]["weights"] == runs[1]["rollback"]["weights"]


@two_processes
def test_a_later_kill_and_resume_still_leaves_the_batch_out(runs):
    for r in runs:  # resumed from the checkpoint taken before the spike, the loss finite this time
        assert r["resumed"]["seen"] == [[0, 3], [1, 0], [1, 1], [1, 2], [1, 3]]
        close(r["resumed"]["weights"], r["skip"]["weights"])


@two_processes
def test_error_raises_on_every_process_at_that_batch(runs):
    for r in runs:
        assert r["error"] is not None, "a process trained on past the spike"
        assert r["error"]["batch_idx"] == 2 and r["error"]["global_step"] == 2
        assert "batch 2 of epoch 0" in r["error"]["message"]


@two_processes
def test_warn_warns_on_every_process_in_one_all_reduce_per_step(runs):
    for r in runs:
        assert len(r["warn"]["warnings"]) == 1 and "batch 2 of epoch 0" in r["warn"]["warnings"][0]
        assert r["warn"]["global_step"] == 8
        assert r["warn"]["reduces"] == r["reference"]["reduces"] + 8


@two_processes
def test_raw_door_skips_the_step_on_every_process(runs):
    r0, r1 = runs
    assert r0["raw"]["skipped"] == r1["raw"]["skipped"] == [2]
    assert r0["raw"]["weights"] == r1["raw"]["weights"]
    close(r0["raw"]["weights"], r0["raw"]["reference"])
    assert r0["raw"]["reduces"] == 0  # (DDP: decided by the gradient all-reduce)


# -- one process -----------------------------------------------------------------------------------------


def test_one_process_skip_error_and_rollback(tmp_path):
    module = sc.Regression(bad_rank=0, bad_batch=5)
    trainer = sc.fit(str(tmp_path / "skip"), module, [sc.spike("skip")])
    reference = sc.Regression(skip={(0, 5)})
    sc.fit(str(tmp_path / "ref"), reference, [])
    close(sc.flat(module), sc.flat(reference))
    assert trainer.global_step == 15
    with pytest.raises(TrainingSpikeException, match="batch 5 of epoch 0"):
        sc.fit(str(tmp_path / "error"), sc.Regression(bad_rank=0, bad_batch=5), [sc.spike("error")])
    assert json.loads((tmp_path / "error" / "skip_batches.json").read_text()) == [[0, 5]]
    module = sc.Regression(bad_rank=0, bad_batch=5)
    sc.fit(str(tmp_path / "rb"), module, [sc.spike("rollback")], every_n_train_steps=2)
    assert module.seen[:9] == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 4], [0, 6], [0, 7]]
    close(sc.flat(module), sc.flat(reference))


def test_a_spike_leaves_out_its_whole_accumulation_window(tmp_path):
    module = sc.Regression(bad_rank=0, bad_batch=5)
    trainer = sc.fit(str(tmp_path / "skip"), module, [sc.spike("skip")], accumulate_grad_batches=2)
    reference = sc.Regression(skip={(0, 4), (0, 5)})
    sc.fit(str(tmp_path / "ref"), reference, [], accumulate_grad_batches=2)
    close(sc.flat(module), sc.flat(reference))
    assert trainer.global_step == 7
    module = sc.Regression(bad_rank=0, bad_batch=5)
    sc.fit(str(tmp_path / "rb"), module, [sc.spike("rollback")], every_n_train_steps=1, accumulate_grad_batches=2)
    assert json.loads((tmp_path / "rb" / "skip_batches.json").read_text()) == [[0, 4], [0, 5]]
    assert module.seen[:8] == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7]]
    close(sc.flat(module), sc.flat(reference))


def test_raw_door_on_one_process():
    weights, skipped = sc.raw_loop(bad_rank=0, bad_step=2)
    reference, _ = sc.raw_loop(skip_step=2, check=False)
    assert skipped == [2]
    close(weights, reference)
    assert sc.raw_loop(check=False)[0] == sc.raw_loop()[0]  # (nothing non-finite: the same steps)


def test_rollback_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(TrainingSpikeException, match="no whole checkpoint"):
        sc.fit(str(tmp_path), sc.Regression(bad_rank=0, bad_batch=1), [sc.spike("rollback")])


class Spiky(sc.Regression):
    """The loss times 100 at one batch: finite, but a spike against the running mean."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 100 if (self.trainer.current_epoch, batch_idx) == (0, 4) else loss


def test_a_finite_loss_spike_against_the_running_mean(tmp_path):
    module = Spiky()
    trainer = sc.fit(str(tmp_path), module, [SpikeDetection(mode="skip", window=3, warmup=2, grad_norm=False)])
    assert trainer.global_step == 15
    with warnings.catch_warnings(record=True) as caught:  # (stepped on, the spike spoils the batches after it)
        warnings.simplefilter("always")
        sc.fit(str(tmp_path / "w"), Spiky(), [SpikeDetection(mode="warn", window=3, warmup=2, grad_norm=False)])
    assert "batch 4 of epoch 0" in str(caught[0].message) and "mode='warn'" in str(caught[0].message)
    # without tolerances only non-finite values count
    trainer = sc.fit(str(tmp_path / "n"), Spiky(), [SpikeDetection(mode="skip", rtol=None)])
    assert trainer.global_step == 16


def test_a_gradient_norm_spike(tmp_path):
    class Steep(sc.Regression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + 1e3 * self.net[0].weight.sum() if (self.trainer.current_epoch, batch_idx) == (0, 6) \
                else loss

    # (the loss itself jumps too: direction "max" keeps it from counting)
    detection = SpikeDetection(mode="skip", window=4, rtol=10.0, direction="max", grad_norm=True)
    trainer = sc.fit(str(tmp_path), Steep(), [detection])
    assert trainer.global_step == 15 and detection.spikes == 1


def test_arguments():
    assert SpikeDetection(mode="max").mode == "error" and SpikeDetection(mode="max").direction == "max"  # Lightning's
    with pytest.raises(ValueError, match="allowed modes"):
        SpikeDetection(mode="ignore")
    with pytest.raises(ValueError, match="window"):
        SpikeDetection(window=0)


def test_state_and_lightnings_file_of_batch_indices(tmp_path):
    path = tmp_path / "skip.json"
    path.write_text(json.dumps([1, [0, 3]]))  # a plain index: left out in every epoch
    detection = SpikeDetection(mode="skip", exclude_batches_path=str(path))
    module = sc.Regression()
    sc.fit(str(tmp_path / "run"), module, [detection])
    assert [b for e, b in module.seen if e == 0] == [0, 2, 4, 5, 6, 7]
    assert [b for e, b in module.seen if e == 1] == [0, 2, 3, 4, 5, 6, 7]
    again = SpikeDetection(mode="skip")
    again.load_state_dict(detection.state_dict())
    assert again.excluded == {(0, 3)} and again.excluded_always == {1}
    assert again.loss_stats.values == detection.loss_stats.values


class Manual(sc.Regression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_manual_optimization_checks_after_the_batch_as_lightning_does(tmp_path):
    with pytest.raises(TrainingSpikeException, match="batch 3 of epoch 0"):
        sc.fit(str(tmp_path), Manual(bad_rank=0, bad_batch=3), [sc.spike("error")])
    with pytest.raises(ValueError, match="automatic_optimization=False"):
        sc.fit(str(tmp_path), Manual(), [sc.spike("skip")])
