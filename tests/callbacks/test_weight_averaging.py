"""Weight averaging (EMAWeightAveraging, WeightAveraging, StochasticWeightAveraging; the raw door's
ExponentialMovingAverage): the average equals a hand-written EMA of a plain loop's weights, on one process and on 2
DDP processes; validation runs with it and fit ends with it in the module; a run killed by SIGKILL and resumed from
its last checkpoint ends bit for bit as one never stopped; under FSDP on 2 processes each process holds half of
the average, which equals DDP's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import WORKERS

sys.path.insert(0, str(WORKERS))
import averaging_run as ar  # noqa: E402

from fabric_lite.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging  # noqa: E402
from fabric_lite.utils import ExponentialMovingAverage, NotSupportedError, WeightAverage  # noqa: E402


def close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def reference():
    return ar.plain_loop_with_ema()


def test_ema_equals_a_hand_written_ema_of_a_plain_loop_and_validation_uses_it(tmp_path, reference):
    ar.VAL_WEIGHTS.clear()
    trainer, module, ema, trained = ar.fit(str(tmp_path))
    plain, hand_ema, at_epoch_end = reference
    assert trainer.global_step == 8 and int(ema.average.n_averaged) == 8
    close(trained, plain)  # the weights trained are the plain loop's
    close(ar.flat(module), hand_ema)  # fit ends with the average in the module
    close(ar.VAL_WEIGHTS[0], at_epoch_end[0])  # each epoch's validation ran with the average of then
    assert ar.VAL_WEIGHTS[0] != trainer.callbacks[0].weights


def test_should_update_chooses_the_steps_and_the_lightning_arguments_gate_them(tmp_path):
    asked = []

    class EveryThird(WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None):
            asked.append((step_idx, epoch_idx))
            return step_idx is not None and step_idx % 3 == 0

    _, _, cb, _ = ar.fit(str(tmp_path / "a"), ema=EveryThird())
    assert asked == [(i, None) for i in range(4)] + [(None, 0)] + [(i, None) for i in range(4, 8)] + [(None, 1)]
    assert int(cb.average.n_averaged) == 3  # steps 0, 3, 6
    _, module, cb, _ = ar.fit(str(tmp_path / "b"), ema=EMAWeightAveraging(decay=ar.DECAY, update_every_n_steps=2))
    assert int(cb.average.n_averaged) == 4
    close(ar.flat(module), ar.plain_loop_with_ema(steps_per_update=2)[1])
    _, _, cb, _ = ar.fit(str(tmp_path / "c"), ema=EMAWeightAveraging(update_starting_at_step=6,
                                                                      update_starting_at_epoch=1))
    assert int(cb.average.n_averaged) == 3  # steps 6 and 7, and the end of epoch 1 (Lightning's rule)
    with pytest.raises(TypeError, match="avg_fn and multi_avg_fn"):
        WeightAveraging(decay=0.9)
    with pytest.raises(ValueError, match="update_every_n_steps"):
        EMAWeightAveraging(update_every_n_steps=0)


def _worker(tmp_path, *args, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(WORKERS / "weight_averaging.py"), "--out", str(out),
                           "--root", str(tmp_path / "root"), *args], env=env, capture_output=True, text=True,
                          timeout=180)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, out


@pytest.mark.timeout(300)
def test_a_run_killed_mid_way_resumes_bit_for_bit_with_averaging_on(tmp_path, reference):
    import json

    _, module, _, trained = ar.fit(str(tmp_path / "whole"), checkpoint_every=2)
    killed, _ = _worker(tmp_path, "--kill-at", "5", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL after step 5, last checkpoint at step 4
    _, out = _worker(tmp_path, "--resume")
    result = json.loads((out / "rank0.json").read_text())
    assert result["global_step"] == 8 and result["n_averaged"] == 8
    assert result["final"] == ar.flat(module)  # bit for bit: the average (in the module at the end) ...
    assert result["trained"] == trained  # ... and the weights trained


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ddp_processes_average_as_one_and_fsdp_shards_the_average(tmp_path_factory, reference):
    from conftest import torchrun

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    runs = {}
    for strategy in ("ddp", "fsdp"):
        tmp = tmp_path_factory.mktemp(strategy)
        runs[strategy] = torchrun(WORKERS / "weight_averaging.py", 2, "--root", tmp / "root", "--strategy", strategy,
                                  out_dir=tmp, env=env)
    plain, hand_ema, _ = reference
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    for r in ddp:
        assert not r["sharded"] and r["average_bytes"] == r["model_bytes"]
        close(r["final"], hand_ema)
        close(r["trained"], plain)
    for r in fsdp:
        assert r["sharded"] and r["average_bytes"] * 2 == r["model_bytes"]  # each process holds half
        close(r["final"], ddp[0]["final"])


def test_the_raw_doors_ema_saves_and_loads_with_the_accelerators_state(tmp_path, reference):
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from fabric_lite import Accelerator

    def run(steps, load=None):
        acc = Accelerator(cpu=True)
        model = ar.Regression()
        opt = torch.optim.SGD(model.parameters(), lr=ar.LR, momentum=0.9)
        model, opt, loader = acc.prepare(model, opt, DataLoader(ar.data(), batch_size=ar.GLOBAL_BATCH))
        ema = ExponentialMovingAverage(model, decay=ar.DECAY, accelerator=acc)
        if load:
            acc.load_state(load)
        done = int(ema.n_averaged)
        for epoch in range(ar.EPOCHS):
            for i, (x, y) in enumerate(loader):
                if epoch * 4 + i < done:
                    continue
                if epoch * 4 + i == steps:
                    acc.save_state(str(tmp_path / "ckpt"))
                    return ema, model
                opt.zero_grad()
                acc.backward(F.mse_loss(model.body(x), y))
                opt.step()
                ema.update()
        return ema, model

    plain, hand_ema, _ = reference
    ema, model = run(99)
    with ema.averaged() as inner:
        close(ar.flat(inner), hand_ema)
    close(ar.flat(model), plain)
    run(5)
    resumed, model = run(99, load=str(tmp_path / "ckpt"))
    assert int(resumed.n_averaged) == 8
    assert [t.tolist() for t in resumed.averages] == [t.tolist() for t in ema.averages]


def test_swa_averages_epoch_starts_at_the_swa_learning_rate_and_copies_the_average(tmp_path):
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)
    ar.VAL_WEIGHTS.clear()
    trainer, module, cb, trained = ar.fit(str(tmp_path), ema=swa)
    # epochs 0 and 1; the average starts at epoch index 1 (swa_epoch_start=2, one-based)
    assert int(cb.average.n_averaged) == 1 and cb.swa_start == 1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)
    close(ar.flat(module), ar.VAL_WEIGHTS[0])  # the weights at the start of epoch 1 (validation ran on them)
    assert trained != ar.flat(module)
    with pytest.raises(ValueError, match="swa_lrs"):
        StochasticWeightAveraging(swa_lrs=-1.0)
    with pytest.raises(ValueError, match="swa_epoch_start"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=0)


def test_swa_recomputes_batch_norm_with_the_average(tmp_path):
    class WithNorm(ar.Regression):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))

    from fabric_lite import Trainer
    from torch.utils.data import DataLoader

    module = WithNorm()
    trainer = Trainer(max_epochs=2, callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)],
                      default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, logger=False)
    trainer.fit(module, DataLoader(ar.data(), batch_size=8))
    norm = module.body[1]
    with torch.no_grad():
        hidden = module.body[0](ar.data().tensors[0])
    close(norm.running_mean.tolist(), hidden.mean(0).tolist(), atol=1e-5)  # one pass, cumulative average
    assert norm.momentum == 0.1


def test_deepspeed_stage_3_parameters_are_refused():
    model = nn.Linear(2, 2)
    model.weight.ds_id = 0
    with pytest.raises(NotSupportedError, match="ZeRO stage 3"):
        WeightAverage(model)
