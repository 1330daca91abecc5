"""The raw door on one process: Accelerate's loop, accumulation, clipping, collectives, checkpoints,
trackers, configuration objects and the errors people see."""

from __future__ import annotations

import datetime
import glob
import json
import os
import random
import uuid

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import (
    Accelerator, DistributedDataParallelKwargs, DistributedType, GradientAccumulationPlugin, GradScalerKwargs,
    InitProcessGroupKwargs, ProjectConfiguration, set_seed,
)
from fabric_lite.checkpoint.files import CheckpointError

def _regression_data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 1)


# -- the migration-guide loop ----------------------------------------------------------------------

def test_migration_guide_loop_trains():
    set_seed(0)
    accelerator = Accelerator()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(_regression_data(), batch_size=8, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    epoch_losses = []
    for _ in range(5):
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            total += loss.item()
        epoch_losses.append(total / len(loader))
    assert epoch_losses[-1] < 0.1 * epoch_losses[0]
    assert all(a > b for a, b in zip(epoch_losses, epoch_losses[1:]))
    assert scheduler.last_epoch == 5 * len(loader) == 40
    assert scheduler.get_last_lr()[0] == pytest.approx(0.05 * 0.9 ** 5)


def test_prepare_returns_objects_in_order_and_passes_unknown_objects_through():
    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = DataLoader(list(range(4)), batch_size=2)
    marker, config = object(), {"lr": 0.1}
    out = acc.prepare(sched, marker, loader, model, "text", opt, 7, config)
    assert len(out) == 8
    p_sched, p_marker, p_loader, p_model, p_text, p_opt, p_seven, p_config = out
    assert p_marker is marker and p_text == "text" and p_seven == 7 and p_config is config
    assert isinstance(p_model, nn.Module) and p_model.weight is model.weight
    assert isinstance(p_opt, torch.optim.Optimizer) and p_opt.optimizer is opt
    assert p_sched.scheduler is sched and p_sched.optimizers == [p_opt]
    assert [b.tolist() for b in p_loader] == [[0, 1], [2, 3]]
    # One object comes back as itself, not a 1-tuple.
    single = acc.prepare(nn.Linear(2, 2))
    assert isinstance(single, nn.Linear)
    assert acc.prepare(marker) is marker


# -- gradient accumulation -------------------------------------------------------------------------

def _accumulated_weights(accumulation_steps, batch_size, epochs=2):
    acc = Accelerator(gradient_accumulation_steps=accumulation_steps)
    model = _model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_regression_data(32), batch_size=batch_size, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                steps += acc.sync_gradients
                opt.step()
                opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), steps


def test_accumulate_equals_one_step_per_big_batch():
    accumulated, steps_a = _accumulated_weights(4, 2)
    big, steps_b = _accumulated_weights(1, 8)
    assert steps_a == steps_b == 8
    torch.testing.assert_close(accumulated, big, atol=1e-6, rtol=0)
    # ...and both equal plain PyTorch with the big batch.
    model = _model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in DataLoader(_regression_data(32), batch_size=8):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    torch.testing.assert_close(accumulated, torch.cat([p.detach().flatten() for p in model.parameters()]),
                               atol=1e-6, rtol=0)
    assert not torch.allclose(accumulated, _accumulated_weights(1, 2)[0], atol=1e-4)


def test_optimizer_step_and_zero_grad_are_no_ops_on_accumulation_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    w0 = model.weight.detach().clone()

    with acc.accumulate(model):
        assert acc.sync_gradients is False
        acc.backward(nn.functional.mse_loss(model(x), y))
        g1 = model.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        assert torch.equal(model.weight, w0)
        assert model.weight.grad is not None and torch.equal(model.weight.grad, g1)
        assert acc.clip_grad_norm_(model.parameters(), 1e-3) is None  # incomplete gradients: untouched
        assert torch.equal(model.weight.grad, g1)

    with acc.accumulate(model):
        assert acc.sync_gradients is True
        acc.backward(nn.functional.mse_loss(model(x), y))
        torch.testing.assert_close(model.weight.grad, 2 * g1)  # two halves of the same loss
        opt.step()
        assert torch.allclose(model.weight, w0 - 0.1 * 2 * g1)
        opt.zero_grad()
        assert model.weight.grad is None


def test_scheduler_steps_only_on_sync_steps_and_at_the_end_of_the_dataloader():
    acc = Accelerator(gradient_accumulation_steps=4)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(_regression_data(12), batch_size=2)  # 6 micro-batches
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    lrs, syncs = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            syncs.append(acc.sync_gradients)
            lrs.append(sched.get_last_lr()[0])
    assert syncs == [False, False, False, True, False, True]
    assert lrs == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.025])
    assert sched.last_epoch == 2


def test_gradient_accumulation_plugin_and_bad_values():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=0))


# -- backward and clipping -------------------------------------------------------------------------

def test_backward_on_a_non_scalar_loss_names_the_shape():
    acc = Accelerator()
    model = acc.prepare(_model())
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        acc.backward(model(torch.randn(3, 4)))
    with pytest.raises(ValueError, match="scalar"):
        acc.backward(1.0)
    acc.backward(model(torch.randn(1, 4)).reshape(1))  # one element is fine
    assert model.weight.grad is not None


def _grad_model():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def test_clip_grad_norm_returns_the_norm_and_clips():
    acc = Accelerator()
    model = _grad_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.tensor([[3.0, 4.0]])).sum())
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert float(norm) == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.8]]), atol=1e-5, rtol=0)
    # Below the limit nothing changes.
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=10.0)
    assert float(norm) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.8]]), atol=1e-5, rtol=0)


def test_clip_grad_value():
    acc = Accelerator()
    model = _grad_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.tensor([[3.0, -4.0]])).sum())
    acc.clip_grad_value_(model.parameters(), 3.5)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[3.0, -3.5]]))


# -- collectives on one process --------------------------------------------------------------------

def test_gather_and_gather_object():
    acc = Accelerator()
    t = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(acc.gather(t), t)
    assert acc.gather(torch.tensor(5)).tolist() == [5]  # 0-dim becomes length 1
    nested = acc.gather({"a": t, "b": [torch.ones(2, 2)]})
    assert torch.equal(nested["a"], t) and nested["b"][0].shape == (2, 2)
    with pytest.raises(TypeError, match="gather_object"):
        acc.gather(3)
    assert acc.gather_object([1, "two", {"three": 3}]) == [1, "two", {"three": 3}]
    assert acc.gather_object({"k": 1}) == [{"k": 1}]


def test_gather_for_metrics_drops_padding_of_the_last_batch():
    acc = Accelerator()
    model = acc.prepare(nn.Identity())
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    seen, names = [], []
    for (x,) in loader:
        seen.append(acc.gather_for_metrics(model(x)))
        names.extend(acc.gather_for_metrics([f"id{int(i)}" for i in x], use_gather_object=True))
    assert torch.cat(seen).tolist() == [float(i) for i in range(10)]
    assert names == [f"id{i}" for i in range(10)]
    # Outside a loader nothing is dropped.
    assert acc.gather_for_metrics(torch.arange(7)).tolist() == list(range(7))


def test_reduce():
    acc = Accelerator()
    t = torch.tensor([1.0, 2.0])
    summed = acc.reduce(t)
    assert torch.equal(summed, t) and summed is not t
    assert torch.equal(acc.reduce(t, reduction="mean"), t)
    assert torch.equal(acc.reduce(t, reduction="sum", scale=3.0), 3 * t)
    assert acc.reduce(t, reduction="none") is t
    assert torch.equal(acc.reduce({"x": t})["x"], t)
    assert torch.equal(acc.reduce(torch.tensor([4, 6]), reduction="mean"), torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="avg"):
        acc.reduce(t, reduction="avg")


def test_pad_across_processes_and_broadcast():
    acc = Accelerator()
    t = torch.arange(6).reshape(2, 3)
    for kwargs in ({}, {"dim": 1}, {"pad_index": -1, "pad_first": True}):
        assert torch.equal(acc.pad_across_processes(t, **kwargs), t)
    out = acc.pad_across_processes({"a": t, "s": torch.tensor(1)})
    assert torch.equal(out["a"], t) and out["s"].item() == 1
    assert torch.equal(acc.broadcast(t), t)
    assert torch.equal(acc.broadcast({"a": t}, from_process=0)["a"], t)


@pytest.mark.parametrize("padding", [False, True])
def test_split_between_processes_gives_everything_to_the_lone_process(padding):
    acc = Accelerator()
    with acc.split_between_processes(["a", "b", "c"], apply_padding=padding) as part:
        assert part == ["a", "b", "c"]
    with acc.split_between_processes(torch.arange(5), apply_padding=padding) as part:
        assert torch.equal(part, torch.arange(5))
    with acc.split_between_processes({"x": [1, 2, 3], "y": torch.arange(3)}, apply_padding=padding) as part:
        assert part["x"] == [1, 2, 3] and torch.equal(part["y"], torch.arange(3))
    with acc.split_between_processes(("p", "q"), apply_padding=padding) as part:
        assert part == ("p", "q")


def test_main_process_first_wait_for_everyone_and_print(capsys):
    acc = Accelerator()
    order = []
    with acc.main_process_first():
        order.append("inside")
    order.append("after")
    acc.wait_for_everyone()
    assert order == ["inside", "after"]
    with acc.local_main_process_first():
        order.append("local")
    acc.print("hello", 42, sep="-")
    assert capsys.readouterr().out == "hello-42\n"
    assert acc.on_main_process(lambda v: v * 2)(21) == 42
    assert acc.on_local_main_process(lambda: "ran")() == "ran"


def test_rank_properties_of_a_lone_process():
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 1
    assert acc.process_index == 0
    assert acc.local_process_index == 0
    assert acc.is_main_process is True
    assert acc.is_local_main_process is True
    assert acc.is_last_process is True
    assert acc.use_distributed is False
    assert acc.device == torch.device("cpu")
    assert acc.mixed_precision == "no"
    assert acc.distributed_type == DistributedType.NO == "NO"
    assert acc.gradient_accumulation_steps == 1
    assert acc.sync_gradients is True
    assert acc.split_batches is False and acc.even_batches is True


# -- models and checkpoints ------------------------------------------------------------------------

class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.compute_dtype = None

    def forward(self, x):
        h = self.lin(x)
        self.compute_dtype = h.dtype
        return h


def test_unwrap_model_and_removing_the_autocast_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = Probe()
    prepared = acc.prepare(model)
    unwrapped = acc.unwrap_model(prepared)
    assert unwrapped is model
    out = unwrapped(torch.randn(2, 4))
    assert unwrapped.compute_dtype == torch.bfloat16 and out.dtype == torch.float32

    plain = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert plain is model
    x = torch.randn(2, 4)
    out = plain(x)
    assert plain.compute_dtype == torch.float32
    torch.testing.assert_close(out, nn.functional.linear(x, model.lin.weight, model.lin.bias))
    with acc.autocast():  # the caller can still ask for autocast explicitly
        assert plain(x).dtype == torch.bfloat16


def test_deepcopy_of_a_mixed_precision_model_runs_the_copy():
    """`copy.deepcopy(prepared_model)` (an EMA or best-model snapshot) must compute with the copy's weights.

    The autocast forward is an instance attribute closing over the *original* module's bound
    forward, so the copy silently runs the original. Accelerate binds its wrapper with
    MethodType, which deepcopy rebinds to the copy.
    """
    import copy

    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(nn.Linear(2, 2))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.weight.zero_()
        clone.bias.zero_()
    x = torch.ones(1, 2)
    assert torch.count_nonzero(model(x)) > 0
    assert torch.equal(clone(x), torch.zeros(1, 2))


def _fresh_copy(model_factory, state):
    fresh = model_factory()
    fresh.load_state_dict(state)
    return fresh


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def test_save_writes_torch_and_safetensors_files(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(_mlp())
    state = acc.get_state_dict(model)
    acc.save(state, tmp_path / "weights.pt")
    acc.save(state, tmp_path / "weights.safetensors", safe_serialization=True)
    loaded_pt = torch.load(tmp_path / "weights.pt", weights_only=True)
    loaded_st = load_file(str(tmp_path / "weights.safetensors"))
    assert loaded_pt.keys() == loaded_st.keys() == state.keys()
    for k in state:
        assert torch.equal(loaded_pt[k], state[k]) and torch.equal(loaded_st[k], state[k])
    acc.save({"step": 3, "note": "x"}, tmp_path / "meta.pt")
    assert torch.load(tmp_path / "meta.pt", weights_only=True) == {"step": 3, "note": "x"}
    assert sorted(os.listdir(tmp_path)) == ["meta.pt", "weights.pt", "weights.safetensors"]  # no temp files left


def test_save_model_safetensors_loads_into_a_fresh_module(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = acc.prepare(_mlp())
    acc.save_model(model, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    fresh = _fresh_copy(_mlp, load_file(str(tmp_path / "out" / "model.safetensors")))
    x = torch.randn(3, 8)
    torch.testing.assert_close(fresh(x), acc.unwrap_model(model, keep_fp32_wrapper=False)(x))

    acc.save_model(model, tmp_path / "bin", safe_serialization=False)
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    torch.testing.assert_close(_fresh_copy(_mlp, state)(x), fresh(x))


def test_save_model_shards_above_max_shard_size(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(_mlp())  # largest tensor: 16x16 fp32 = 1024 bytes
    acc.save_model(model, tmp_path, max_shard_size="1100B")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    shards = sorted(glob.glob(str(tmp_path / "model-*-of-*.safetensors")))
    assert len(shards) > 1
    assert set(index["weight_map"].values()) == {os.path.basename(s) for s in shards}
    merged = {}
    for shard in shards:
        part = load_file(shard)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 1100 or len(part) == 1
        merged.update(part)
    fresh = _fresh_copy(_mlp, merged)
    x = torch.randn(2, 8)
    torch.testing.assert_close(fresh(x), model(x))


def test_save_model_with_tied_weights(tmp_path):
    from safetensors.torch import load_file

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    acc = Accelerator()
    model = acc.prepare(Tied())
    acc.save_model(model, tmp_path)
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(loaded["a.weight"], model.a.weight) and torch.equal(loaded["b.weight"], model.a.weight)


class Counter:
    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _training_objects(acc, seed=0):
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return model, opt, sched, counter


def _train_steps(acc, model, opt, sched, counter, steps):
    for _ in range(steps):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.value += 1


def _snapshot(model, opt, sched, counter):
    opt_state = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": [s["exp_avg"].clone() for s in opt_state["state"].values()],
        "steps": [float(s["step"]) for s in opt_state["state"].values()],
        "sched": sched.state_dict()["last_epoch"],
        "lr": sched.get_last_lr()[0],
        "counter": counter.value,
    }


def _assert_snapshot(model, opt, sched, counter, snap):
    now = _snapshot(model, opt, sched, counter)
    assert now["model"].keys() == snap["model"].keys()
    for k in snap["model"]:
        assert torch.equal(now["model"][k], snap["model"][k]), k
    assert len(now["exp_avg"]) == len(snap["exp_avg"]) > 0
    for a, b in zip(now["exp_avg"], snap["exp_avg"]):
        assert torch.equal(a, b)
    assert now["steps"] == snap["steps"]
    assert now["sched"] == snap["sched"] and now["lr"] == snap["lr"]
    assert now["counter"] == snap["counter"]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_save_state_load_state_round_trip(tmp_path, where):
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://fabric-lite-test-{uuid.uuid4().hex}/ckpt"
    set_seed(0)
    acc = Accelerator()
    objects = _training_objects(acc)
    _train_steps(acc, *objects, steps=3)
    snap = _snapshot(*objects)
    assert acc.save_state(url) == url
    after_save = (torch.rand(3), np.random.rand(), random.random())

    _train_steps(acc, *objects, steps=4)  # move everything on
    assert objects[3].value == 7 and objects[2].last_epoch == 7
    acc.load_state(url)
    _assert_snapshot(*objects, snap)
    after_load = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(after_load[0], after_save[0])
    assert after_load[1:] == after_save[1:]

    # A new run (fresh objects, different init) resumes the same way.
    acc2 = Accelerator()
    objects2 = _training_objects(acc2, seed=5)
    acc2.load_state(url)
    _assert_snapshot(*objects2, snap)
    assert torch.equal(torch.rand(3), after_save[0])


def test_resumed_training_matches_uninterrupted_training_bit_for_bit(tmp_path):
    set_seed(0)
    acc = Accelerator()
    objects = _training_objects(acc)
    _train_steps(acc, *objects, steps=2)
    acc.save_state(tmp_path / "mid")
    _train_steps(acc, *objects, steps=3)
    straight = {k: v.clone() for k, v in objects[0].state_dict().items()}

    acc2 = Accelerator()
    objects2 = _training_objects(acc2, seed=3)
    acc2.load_state(tmp_path / "mid")
    _train_steps(acc2, *objects2, steps=3)  # draws the same random batches after the RNG restore
    for k, v in objects2[0].state_dict().items():
        assert torch.equal(v, straight[k]), k


def _accumulating_run(ckpt, stop_at=None, resume=False):
    """Two epochs of a shuffled loader, dropout, Adam, a scheduler and accumulation over 3 micro-batches.

    With `stop_at`, save after that many micro-batches and stop; with `resume`, load first.
    """
    set_seed(0)
    acc = Accelerator(gradient_accumulation_steps=3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(_regression_data(40), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if resume:
        acc.load_state(ckpt)
    micro = 0
    while loader.epoch < 2:
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            micro += 1
            if micro == stop_at:
                assert acc.sync_gradients is False  # saved in the middle of an accumulation window
                acc.save_state(ckpt)
                return None
    return {k: v.clone() for k, v in model.state_dict().items()}, sched.last_epoch


def test_resume_in_the_middle_of_accumulation_matches_uninterrupted(tmp_path):
    straight, steps = _accumulating_run(tmp_path / "c")
    assert steps == 8  # 10 micro-batches per epoch, 3 per step, plus a step at each epoch's end
    _accumulating_run(tmp_path / "c", stop_at=5)
    resumed, resumed_steps = _accumulating_run(tmp_path / "c", resume=True)
    assert resumed_steps == steps
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k


def test_fp16_grad_scaler_state_is_checkpointed(tmp_path):
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    model = nn.Linear(2, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = acc.strategy.precision.scaler

    def inf_step():
        acc.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
        opt.step()
        opt.zero_grad()

    inf_step()
    assert scaler.get_scale() == 512.0
    acc.save_state(tmp_path / "c")
    inf_step()
    assert scaler.get_scale() == 256.0
    acc.load_state(tmp_path / "c")
    assert scaler.get_scale() == 512.0


def test_load_state_refuses_a_different_set_of_objects(tmp_path):
    acc = Accelerator()
    _training_objects(acc)
    acc.save_state(tmp_path / "c")
    other = Accelerator()
    other.prepare(_model(), _model())
    with pytest.raises(CheckpointError, match="model"):
        other.load_state(tmp_path / "c")


def test_register_for_checkpointing_needs_state_dict():
    with pytest.raises(ValueError, match="state_dict"):
        Accelerator().register_for_checkpointing(object())


def test_automatic_checkpoint_naming_keeps_total_limit(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    model = acc.prepare(_model())
    saved = []
    for i in range(4):
        with torch.no_grad():
            model.weight.fill_(float(i))
        saved.append(acc.save_state())
    assert [os.path.basename(p) for p in saved] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3", "latest"]
    assert acc.save_iteration == 4
    for name in ("checkpoint_2", "checkpoint_3"):
        assert "manifest.json" in os.listdir(tmp_path / "checkpoints" / name)

    # load_state() with no path takes the newest one and continues the numbering after it.
    config2 = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc2 = Accelerator(project_config=config2)
    model2 = acc2.prepare(_model(seed=9))
    loaded = acc2.load_state()
    assert os.path.basename(loaded) == "checkpoint_3"
    assert torch.all(model2.weight == 3.0)
    assert acc2.save_iteration == 4
    assert os.path.basename(acc2.save_state()) == "checkpoint_4"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_3", "checkpoint_4", "latest"]


def test_save_state_without_a_path_or_naming_is_an_error():
    acc = Accelerator()
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        acc.save_state()


def test_corrupted_checkpoint_file_is_refused(tmp_path):
    acc = Accelerator()
    _training_objects(acc)
    acc.save_state(tmp_path / "c")
    target = tmp_path / "c" / "model_0.pt"
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model_0.pt"):
        acc.load_state(tmp_path / "c")


def test_checkpoint_without_manifest_is_refused(tmp_path):
    acc = Accelerator()
    _training_objects(acc)
    acc.save_state(tmp_path / "c")
    os.remove(tmp_path / "c" / "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json"):
        acc.load_state(tmp_path / "c")
    with pytest.raises(CheckpointError, match="No checkpoint"):
        acc.load_state(tmp_path / "missing")


def test_save_state_leaves_no_staging_directories(tmp_path):
    acc = Accelerator()
    _training_objects(acc)
    acc.save_state(tmp_path / "c")
    acc.save_state(tmp_path / "c")  # overwrite in place
    assert os.listdir(tmp_path) == ["c"]
    assert sorted(os.listdir(tmp_path / "c")) == [
        "manifest.json", "model_0.pt", "rng_0.pt", "training_state.pt",
    ]


def test_set_seed_reproducibility(monkeypatch):
    def draw():
        return torch.rand(4), np.random.rand(3), random.random(), nn.Linear(3, 3).weight.detach().clone()

    assert set_seed(123) == 123
    a = draw()
    set_seed(123)
    b = draw()
    set_seed(124)
    c = draw()
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and torch.equal(a[3], b[3])
    assert not torch.equal(a[0], c[0]) and a[2] != c[2]
    assert set_seed(10, device_specific=True, process_index=3) == 13
    monkeypatch.setenv("RANK", "2")  # the rank comes from the launch when not given
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert set_seed(10, device_specific=True) == 12
    with pytest.raises(ValueError, match="seed"):
        set_seed("1")  # type: ignore[arg-type]


# -- configuration ---------------------------------------------------------------------------------

def test_two_accelerators_with_different_settings_coexist():
    mixed = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    plain = Accelerator()
    assert (mixed.mixed_precision, mixed.gradient_accumulation_steps) == ("bf16", 2)
    assert (plain.mixed_precision, plain.gradient_accumulation_steps) == ("no", 1)

    m1, m2 = Probe(), Probe()
    m1, o1 = mixed.prepare(m1, torch.optim.SGD(m1.parameters(), lr=0.1))
    m2, o2 = plain.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    m1(x), m2(x)
    assert m1.compute_dtype == torch.bfloat16 and m2.compute_dtype == torch.float32

    w2 = m2.lin.weight.detach().clone()
    with mixed.accumulate(m1):
        assert mixed.sync_gradients is False
        assert plain.sync_gradients is True  # the other accelerator's step is unaffected
        plain.backward(m2(x).sum())
        o2.step()
        assert not torch.equal(m2.lin.weight, w2)
        mixed.backward(m1(x).sum())
        w1 = m1.lin.weight.detach().clone()
        o1.step()
        assert torch.equal(m1.lin.weight, w1)
    assert mixed.mixed_precision == "bf16" and plain.mixed_precision == "no"


def test_kwargs_handlers():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024, growth_interval=7)])
    scaler = acc.strategy.precision.scaler
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 7
    model = _grad_model()
    model = acc.prepare(model)
    acc.backward(model(torch.tensor([[1.0, 2.0]])).sum())
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1024.0, 2048.0]]))

    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True),
                InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))]
    acc = Accelerator(kwargs_handlers=handlers)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w = model.weight.detach().clone()
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    assert not torch.equal(model.weight, w)
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {"find_unused_parameters": True}
    with pytest.raises(TypeError, match="KwargsHandler"):
        Accelerator(kwargs_handlers=[{"init_scale": 2}])


def test_unknown_strategy_names_the_allowed_values():
    with pytest.raises(ValueError) as err:
        Accelerator(strategy="horovod")
    message = str(err.value)
    assert "'horovod'" in message
    for name in ("'auto'", "'single'", "'ddp'"):
        assert name in message


def test_devices_greater_than_one_in_a_lone_process_points_to_the_launcher():
    with pytest.raises(ValueError) as err:
        Accelerator(devices=2, cpu=True)
    assert "fabric-lite launch" in str(err.value) and "devices=2" in str(err.value)
    with pytest.raises(ValueError, match="devices=0"):
        Accelerator(devices=0, cpu=True)
    assert Accelerator(devices=1, cpu=True).num_processes == 1


def test_cpu_flag_and_single_strategy():
    acc = Accelerator(cpu=True, strategy="single")
    assert acc.device.type == "cpu"
    model = acc.prepare(_model())
    assert model.weight.device.type == "cpu"


# -- trackers --------------------------------------------------------------------------------------

def test_tensorboard_tracker_writes_scalars_that_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run1", config={"lr": 0.1, "epochs": 3})
    acc.log({"train/loss": 1.5, "train/acc": torch.tensor(0.25)}, step=0)
    acc.log({"train/loss": 0.75}, step=1)
    acc.log({"train/loss": 0.5}, step=2)
    writer = acc.get_tracker("tensorboard", unwrap=True)
    assert os.path.realpath(writer.log_dir) == os.path.realpath(tmp_path / "run1")
    acc.end_training()
    assert acc.trackers == []

    files = glob.glob(str(tmp_path / "run1" / "events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(tmp_path / "run1"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(0, 1.5), (1, 0.75), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("train/acc")] == [(0, 0.25)]


def test_tracker_errors():
    acc = Accelerator(log_with="tensorboard")
    with pytest.raises(ValueError, match="project_dir"):
        acc.init_trackers("run")
    with pytest.raises(ValueError, match="wandb-ish"):
        Accelerator(log_with="wandb-ish", project_dir="unused").init_trackers("run")
    with pytest.raises(ValueError, match="No tracker named"):
        Accelerator().get_tracker("tensorboard")


def test_tracker_refuses_values_it_cannot_log(tmp_path):
    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run")
    with pytest.raises(ValueError, match="bad"):
        acc.log({"bad": [1, 2]}, step=0)
    acc.end_training()


def test_project_dir_argument_sets_the_logging_dir_next_to_a_project_config(tmp_path):
    """Accelerate: `project_dir` fills in the configuration's directories when it has none.

    Here project_dir is copied onto the config but logging_dir stays None, so trackers refuse to start.
    """
    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path,
                      project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    assert acc.project_dir == os.fspath(tmp_path)
    assert acc.logging_dir == os.fspath(tmp_path)
    acc.init_trackers("run")
    acc.log({"x": 1.0}, step=0)
    acc.end_training()
    assert glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))


def test_manifests_name_their_checksum_and_sha256_ones_still_verify(tmp_path):
    import hashlib
    import json

    acc = Accelerator()
    model, _ = _training_objects(acc)[:2]
    acc.save_state(tmp_path / "c")
    manifest_path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    # local files: a digest of the zip's structure and per-record CRC-32s (torch's writer computes those)
    assert manifest["format_version"] == 3 and all(v.startswith("zip:") and len(v) == 12
                                                   for v in manifest["files"].values())
    # whole-file CRC-32s (as files streamed to other stores, and version 2 checkpoints, have) load
    import zlib

    manifest.update(format_version=2, checksum="crc32")
    manifest["files"] = {n: f"{zlib.crc32((tmp_path / 'c' / n).read_bytes()):08x}" for n in manifest["files"]}
    manifest_path.write_text(json.dumps(manifest))
    acc.load_state(tmp_path / "c")
    # a manifest that records SHA-256 digests (as earlier checkpoints did) loads
    manifest["checksum"] = "sha256"
    manifest["files"] = {n: hashlib.sha256((tmp_path / "c" / n).read_bytes()).hexdigest() for n in manifest["files"]}
    manifest_path.write_text(json.dumps(manifest))
    acc.load_state(tmp_path / "c")
    manifest["checksum"] = "md4"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="Unknown checksum 'md4'"):
        acc.load_state(tmp_path / "c")


def test_a_forked_child_can_save_and_load_after_its_parent_did(tmp_path):
    # the checksum thread pool is per process: a child inheriting the parent's would wait for ever
    import multiprocessing

    acc = Accelerator()
    _training_objects(acc)
    acc.save_state(tmp_path / "parent")
    acc.load_state(tmp_path / "parent")

    def child():
        acc.save_state(tmp_path / "child")
        acc.load_state(tmp_path / "child")

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0
