"""Checkpoints hold the user's module names whatever wraps the module: saved from a `torch.compile`d model
they load into a plain one and the reverse, keys equal, and weights from a DDP wrapper's ``module.`` keys load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator
from fabric_lite.checkpoint.names import canonical, for_module


class Net(nn.Module):
    def __init__(self, compile_inner: bool = False) -> None:
        super().__init__()
        inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.body = torch.compile(inner, backend="eager") if compile_inner else inner
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _prepared(compiled: str, seed: int):
    torch.manual_seed(seed)
    acc = Accelerator()
    model = Net(compile_inner=compiled == "inner")
    if compiled == "whole":
        model = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _weights(acc, model):
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


@pytest.mark.parametrize("saved_as,loaded_as", [("whole", "none"), ("none", "whole"), ("inner", "whole"),
                                                ("whole", "inner")])
def test_a_checkpoint_loads_with_or_without_torch_compile(tmp_path, saved_as, loaded_as):
    acc, model, opt = _prepared(saved_as, seed=0)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    expected = _weights(acc, model)
    assert sorted(expected) == ["body.0.bias", "body.0.weight", "head.bias", "head.weight"]  # no _orig_mod
    acc.save_state(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "model_0.pt", weights_only=True)
    assert sorted(saved) == sorted(expected)

    acc2, model2, opt2 = _prepared(loaded_as, seed=1)
    acc2.load_state(tmp_path / "ckpt")  # strict: every key must match
    got = _weights(acc2, model2)
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    saved_state = opt.state_dict()["state"]
    for index, state in opt2.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved_state[index]["exp_avg"])


def test_load_model_weights_takes_a_ddp_wrappers_keys_and_compiled_keys(tmp_path):
    acc, model, _ = _prepared("whole", seed=0)
    plain = Net()
    wrapped = {f"module.{k}": v + 1 for k, v in plain.state_dict().items()}  # as DDP(model).state_dict() names them
    acc.load_model_weights(model, wrapped)
    assert torch.equal(acc.unwrap_model(model).head.weight, plain.head.weight + 1)
    compiled_keys = {f"_orig_mod.{k}": v + 2 for k, v in plain.state_dict().items()}
    acc.load_model_weights(model, compiled_keys)
    assert torch.equal(acc.unwrap_model(model).head.weight, plain.head.weight + 2)


def test_names_keep_a_users_own_module_attribute():
    assert canonical("_orig_mod.body._checkpoint_wrapped_module.0.weight") == "body.0.weight"
    # a user's submodule really called "module" is not a wrapper: nothing is stripped when the names match
    assert for_module({"module.w": 1}, {"module.w": 0}) == {"module.w": 1}
    assert for_module({"w": 1}, {"_orig_mod.w": 0}) == {"_orig_mod.w": 1}
    assert for_module({"unknown": 1}, {"w": 0}) == {"unknown": 1}  # left for a strict load to report
