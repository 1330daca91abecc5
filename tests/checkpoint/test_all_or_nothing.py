"""A load_state that fails changes nothing: every check runs before anything is applied, and an object that
refuses its saved state during the apply phase gets the objects already applied put back. save_state never
replaces a file."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fabric_lite import Accelerator
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.seed import capture_rng_state


class EveryOther(Sampler):
    """A custom sampler (no generator, cannot be cut part-way)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))

    def __len__(self):
        return self.n


class Counter:
    def __init__(self, limit=None):
        self.count, self.limit = 0, limit

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        if self.limit is not None and state["count"] > self.limit:
            raise ValueError(f"this counter refuses a count above {self.limit}")
        self.count = state["count"]


def _run(batch, counter=None, seed=0):
    torch.manual_seed(seed)
    acc = Accelerator(cpu=True)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = DataLoader(TensorDataset(torch.randn(32, 3)), batch_size=batch, sampler=EveryOther(32))
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    counter = counter or Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, data, sched, counter


def _everything(acc, model, opt, data, sched, counter):
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in enumerate(opt.optimizer.state.values())},
            "lr": [g["lr"] for g in opt.param_groups], "scheduler": sched.state_dict(),
            "loader": {k: v for k, v in data.state_dict().items() if k != "generator_state"},
            "counter": counter.count, "rng": capture_rng_state()["torch"].clone(), "step": acc.step}


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key == "weights":
            assert all(torch.equal(x[k], y[k]) for k in x), key
        elif key == "optimizer":
            assert x.keys() == y.keys() and all(
                torch.equal(x[i][k], y[i][k]) if torch.is_tensor(x[i][k]) else x[i][k] == y[i][k]
                for i in x for k in x[i]), key
        elif key == "rng":
            assert torch.equal(x, y), key
        else:
            assert x == y, key


@pytest.fixture
def mid_epoch(tmp_path):
    """A checkpoint 3 batches of 4 into an epoch, after 3 optimizer and scheduler steps."""
    acc, model, opt, data, sched, counter = _run(batch=4)
    for i, (x,) in enumerate(data):
        acc.backward(model(x).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.count += 1
        if i == 2:
            break
    acc.save_state(str(tmp_path / "ckpt"))
    return str(tmp_path / "ckpt")


def _train_one(acc, model, opt, data, sched, counter):
    """Give the loading run state of its own (an optimizer step, a loader position) so that changes show."""
    for (x,) in data:
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        break


def test_a_loader_position_that_cannot_be_carried_over_changes_nothing(mid_epoch):
    run = _run(batch=8, seed=5)  # another global batch: 12 samples seen is not a whole number of its batches
    _train_one(*run)
    before = _everything(*run)
    with pytest.raises(CheckpointError, match=r"dataloader 0 .*cannot be cut part-way.*put back as it was"):
        run[0].load_state(mid_epoch)
    _same(before, _everything(*run))


def test_an_object_refusing_its_state_puts_back_those_applied_before_it(mid_epoch):
    run = _run(batch=4, counter=Counter(limit=2), seed=5)
    _train_one(*run)
    before = _everything(*run)  # the loader is one batch into its epoch; the checkpoint's is three
    with pytest.raises(CheckpointError, match=r"registered object 0 \(Counter\).*refuses a count above 2.*put back as it was"):
        run[0].load_state(mid_epoch)
    _same(before, _everything(*run))


def test_the_same_checkpoint_loads_whole_when_it_fits(mid_epoch):
    run = _run(batch=4, seed=5)
    run[0].load_state(mid_epoch)
    assert run[5].count == 3 and run[4].state_dict()["last_epoch"] == 3 and run[3].state_dict()["batches_seen"] == 3


def test_save_state_onto_an_existing_file_refuses_and_keeps_the_file(tmp_path):
    acc, model, opt, data, sched, counter = _run(batch=4)
    target = tmp_path / "results.txt"
    target.write_text("precious")
    with pytest.raises(FileExistsError, match="a file exists at that path"):
        acc.save_state(str(target))
    assert target.read_text() == "precious"


def test_a_model_that_fails_to_load_puts_the_optimizer_back_and_says_the_weights_may_be_partly_loaded(
        mid_epoch, monkeypatch):
    run = _run(batch=4, seed=5)
    _train_one(*run)
    before = _everything(*run)
    strategy = run[0].strategy

    def failing(*_, **__):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(strategy.checkpoint_format, "load_module_state_dict", failing)
    with pytest.raises(CheckpointError, match=r"model 0 failed .*out of memory.*put back as it was, but model 0 may "
                                              r"be partly loaded"):
        run[0].load_state(mid_epoch)
    after = _everything(*run)
    assert after["optimizer"].keys() == before["optimizer"].keys() and all(
        torch.equal(after["optimizer"][i][k], before["optimizer"][i][k]) for i in before["optimizer"]
        for k in before["optimizer"][i] if torch.is_tensor(before["optimizer"][i][k]))
    assert after["scheduler"] == before["scheduler"] and after["loader"] == before["loader"]
    assert after["counter"] == before["counter"] and after["lr"] == before["lr"]
