"""A checkpoint that does not fit the run is refused before anything changes: the model, optimizer and
scheduler stay as they were, and one CheckpointError lists what differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.checkpoint import fit
from fabric_lite.checkpoint.files import CheckpointError


def _run(width=8, optimizer=torch.optim.SGD, scheduler=None, buffer_dtype=torch.float32, groups=1, **opt_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    model.register_buffer("count", torch.zeros(3, dtype=buffer_dtype))
    params = ([{"params": model[0].parameters()}, {"params": model[2].parameters()}] if groups == 2
              else model.parameters())
    opt = optimizer(params, lr=0.1, **opt_kwargs)
    acc = Accelerator(cpu=True)
    objects = [model, opt] + ([scheduler(opt)] if scheduler else [])
    prepared = acc.prepare(*objects)
    model, opt = prepared[0], prepared[1]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return acc, model, opt, prepared[2] if scheduler else None


def _snapshot(model, opt, sched):
    return ({k: v.clone() for k, v in model.state_dict().items()}, repr(opt.state_dict()),
            repr(sched.state_dict()) if sched else None)


def _saved(tmp_path, **kwargs):
    acc, *_ = _run(**kwargs)
    acc.save_state(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _refused(ckpt, *expected_in_message, **kwargs):
    acc, model, opt, sched = _run(**kwargs)
    before = _snapshot(model, opt, sched)
    with pytest.raises(CheckpointError, match="nothing was loaded") as info:
        acc.load_state(ckpt)
    for text in expected_in_message:
        assert text in str(info.value), str(info.value)
    after = _snapshot(model, opt, sched)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:] == after[1:]
    model(torch.randn(3, 4)).sum().backward()  # the run goes on as if nothing happened
    opt.step()
    return str(info.value)


def test_another_width_is_refused_and_nothing_changes(tmp_path):
    _refused(_saved(tmp_path, width=16), "model 0", "differ in shape", "0.weight: saved (16, 4), model (8, 4)")


@pytest.mark.parametrize("momentum", [0.0, 0.9])  # 0.0: SGD has no per-parameter state to give it away
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_another_optimizer_class_is_refused(tmp_path, optimizer, momentum):
    ckpt = _saved(tmp_path, optimizer=torch.optim.SGD, momentum=momentum)
    _refused(ckpt, f"optimizer 0: saved by SGD, this run has {optimizer.__name__}", optimizer=optimizer)


def test_another_scheduler_class_is_refused(tmp_path):
    ckpt = _saved(tmp_path, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    _refused(ckpt, "scheduler 0: saved by StepLR, this run has ExponentialLR",
             scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5))


def test_another_parameter_group_layout_is_refused(tmp_path):
    _refused(_saved(tmp_path, groups=2), "saved with 2 parameter group(s), this one has 1")


def test_an_integer_buffer_saved_where_the_model_has_floats_is_refused(tmp_path):
    _refused(_saved(tmp_path, buffer_dtype=torch.int64), "another kind of number", "count: saved torch.int64")


def test_every_mismatch_is_listed_in_one_error(tmp_path):
    ckpt = _saved(tmp_path, width=16, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    message = _refused(ckpt, "model 0", "optimizer 0", "scheduler 0", optimizer=torch.optim.Adam,
                       scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5))
    assert "3 mismatch(es)" in message


def test_a_fitting_checkpoint_still_loads(tmp_path):
    ckpt = _saved(tmp_path, optimizer=torch.optim.AdamW, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    acc, model, opt, sched = _run(optimizer=torch.optim.AdamW, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    acc.load_state(ckpt)


def test_checkpoints_without_recorded_classes_are_compared_by_their_settings():
    """Checkpoints of earlier versions do not record class names: another optimizer or scheduler shows
    in settings that only one side has."""
    model = nn.Linear(2, 2)
    sgd, adam = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(model.parameters())
    problems = fit.optimizer_problems("optimizer 0", adam, sgd.state_dict(), None)
    assert problems and "another optimizer's settings" in problems[0] and "momentum" in problems[0]
    assert fit.optimizer_problems("optimizer 0", sgd, sgd.state_dict(), None) == []
    model(torch.randn(1, 2)).sum().backward()
    adam.step()
    other = torch.optim.Adam(nn.Linear(3, 2).parameters())  # as many parameters, of other shapes
    assert any("exp_avg" in p for p in fit.optimizer_problems("optimizer 0", other, adam.state_dict(), None))
    step = torch.optim.lr_scheduler.StepLR(sgd, 1)
    cyclic = torch.optim.lr_scheduler.CyclicLR(sgd, 0.01, 0.1)
    assert fit.scheduler_problems("scheduler 0", cyclic, step.state_dict(), None)
    assert fit.scheduler_problems("scheduler 0", step, step.state_dict(), None) == []
    assert "not an optimizer state" in fit.optimizer_problems("optimizer 0", sgd, [1, 2], None)[0]


class _Module(TrainModule):
    def __init__(self, optimizer):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=0.01)


def test_the_trainer_refuses_another_optimizer_before_changing_the_module(tmp_path):
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    common = dict(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False)
    first = Trainer(**common)
    first.fit(_Module(torch.optim.SGD), data)
    first.save_checkpoint(str(tmp_path / "sgd"))
    torch.manual_seed(1)
    module = _Module(torch.optim.Adam)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError, match="saved by SGD, this run has Adam"):
        Trainer(**common).fit(module, data, ckpt_path=str(tmp_path / "sgd"))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
