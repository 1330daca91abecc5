"""precision.py through the Accelerator: alias resolution, autocast, fp16 loss scaling, pure bf16."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, GradScalerKwargs, set_seed
from fabric_lite.strategies.precision import PRECISION_ALIASES, Precision, resolve_precision

class Probe(nn.Module):
    """Records the dtype its inner Linear computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.compute_dtype = None

    def forward(self, x):
        h = self.lin(x)
        self.compute_dtype = h.dtype
        return {"logits": h, "index": torch.arange(2)}


# -- aliases ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling, canonical, accelerate", [
    ("no", "32-true", "no"),
    ("32-true", "32-true", "no"),
    ("32", "32-true", "no"),
    ("fp32", "32-true", "no"),
    ("fp16", "16-mixed", "fp16"),
    ("16-mixed", "16-mixed", "fp16"),
    ("16", "16-mixed", "fp16"),
    ("bf16", "bf16-mixed", "bf16"),
    ("bf16-mixed", "bf16-mixed", "bf16"),
    ("bf16-true", "bf16-true", "bf16"),
    ("BF16-Mixed", "bf16-mixed", "bf16"),
])
def test_alias_resolution(spelling, canonical, accelerate):
    assert resolve_precision(spelling) == canonical
    assert Precision(spelling, "cpu").name == canonical
    acc = Accelerator(mixed_precision=spelling, cpu=True)
    assert acc.strategy.precision.name == canonical
    assert acc.mixed_precision == accelerate


@pytest.mark.parametrize("value, canonical", [(16, "16-mixed"), (32, "32-true")])
def test_lightning_integer_precisions(value, canonical):
    assert resolve_precision(value) == canonical


def test_fp16_refused_where_torch_cannot_scale_losses():
    with pytest.raises(ValueError, match="'mps'"):
        Precision("fp16", "mps")
    assert Precision("fp16", "cpu").scaler is not None
    assert Precision("bf16", "cpu").scaler is None and Precision("no", "cpu").scaler is None


def test_none_means_full_precision():
    assert resolve_precision(None) == "32-true"
    assert Accelerator().mixed_precision == "no"


@pytest.mark.parametrize("bad", ["fp4", "bf32", "mixed", "16-true"])
def test_unknown_precision_lists_allowed_values(bad):
    with pytest.raises(ValueError) as err:
        resolve_precision(bad)
    message = str(err.value)
    assert repr(bad) in message
    for allowed in ("'no'", "'32-true'", "'fp16'", "'16-mixed'", "'bf16'", "'bf16-mixed'", "'bf16-true'"):
        assert allowed in message
    with pytest.raises(ValueError, match="Allowed values"):
        Accelerator(mixed_precision=bad)


def test_every_alias_maps_to_a_canonical_name():
    assert set(PRECISION_ALIASES.values()) == {"32-true", "16-mixed", "bf16-mixed", "bf16-true", "fp8"}
    assert resolve_precision("FP8") == "fp8"


# -- autocast --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mp, compute", [("bf16", torch.bfloat16), ("bf16-mixed", torch.bfloat16),
                                         ("fp16", torch.float16), ("16-mixed", torch.float16),
                                         ("no", torch.float32)])
def test_autocast_changes_compute_dtype_but_outputs_are_float32(mp, compute):
    acc = Accelerator(mixed_precision=mp, cpu=True)
    model = acc.prepare(Probe())
    out = model(torch.randn(2, 4))
    assert model.compute_dtype == compute
    assert out["logits"].dtype == torch.float32  # convert_outputs_to_fp32
    assert out["index"].dtype == torch.int64  # non-floating outputs untouched
    assert model.lin.weight.dtype == torch.float32  # mixed precision keeps fp32 weights


def test_accelerator_autocast_context_for_code_outside_forward():
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    lin = nn.Linear(4, 4)
    with acc.autocast():
        inside = lin(torch.randn(2, 4)).dtype
    assert inside == torch.bfloat16
    assert lin(torch.randn(2, 4)).dtype == torch.float32
    with Accelerator(cpu=True).autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_mixed_precision_gradients_are_float32_and_close_to_fp32():
    set_seed(0)
    ref = nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    nn.functional.mse_loss(ref(x), y).backward()
    for mp in ("bf16", "fp16"):
        model = nn.Linear(4, 1)
        model.load_state_dict(ref.state_dict())
        acc = Accelerator(mixed_precision=mp, cpu=True)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.unscale_gradients()
        assert model.weight.grad.dtype == torch.float32
        torch.testing.assert_close(model.weight.grad, ref.weight.grad, atol=5e-2, rtol=5e-2)


# -- fp16 loss scaling -----------------------------------------------------------------------------

def _fp16_setup(init_scale=None):
    handlers = [GradScalerKwargs(init_scale=init_scale)] if init_scale is not None else None
    acc = Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=handlers)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def test_fp16_step_with_inf_gradients_is_skipped():
    # A small initial scale so that the finite step below does not overflow fp16 by itself.
    acc, model, opt, sched = _fp16_setup(init_scale=256.0)
    scaler = acc.strategy.precision.scaler
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale_before = scaler.get_scale()
    lr_before = sched.get_last_lr()[0]
    epoch_before = sched.last_epoch

    x = torch.tensor([[float("inf"), 1.0]])
    acc.backward(model(x).sum())
    assert not torch.isfinite(model.weight.grad).all()
    opt.step()
    sched.step()

    assert opt.step_was_skipped is True
    assert acc.optimizer_step_was_skipped is True
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert scale_before == 256.0
    assert scaler.get_scale() == scale_before * 0.5  # backoff
    assert sched.last_epoch == epoch_before
    assert sched.get_last_lr()[0] == lr_before
    assert opt.param_groups[0]["lr"] == lr_before

    # The next finite step goes through, and the scheduler moves with it.
    opt.zero_grad()
    acc.backward(model(torch.tensor([[1.0, 2.0]])).sum())
    opt.step()
    sched.step()
    assert opt.step_was_skipped is False
    assert not torch.equal(model.weight, before["weight"])
    assert sched.last_epoch == epoch_before + 1
    assert sched.get_last_lr()[0] == pytest.approx(lr_before * 0.5)


def test_fp16_gradients_are_scaled_then_unscaled_before_clipping():
    acc, model, opt, _ = _fp16_setup(init_scale=1024.0)
    x = torch.tensor([[1.0, 2.0]])
    acc.backward(model(x).sum())
    # d(sum(Wx+b))/dW = x, multiplied by the loss scale before unscaling.
    torch.testing.assert_close(model.weight.grad, 1024.0 * x)
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=100.0)
    true_norm = math.sqrt(1.0 + 4.0 + 1.0)
    assert float(norm) == pytest.approx(true_norm, rel=1e-3)
    torch.testing.assert_close(model.weight.grad, x)  # unscaled, not clipped (norm < 100)
    w = model.weight.detach().clone()
    opt.step()  # must not unscale a second time
    torch.testing.assert_close(model.weight.detach(), w - 0.5 * x)
    assert opt.step_was_skipped is False


# -- bf16-true -------------------------------------------------------------------------------------

def test_bf16_true_converts_weights_and_float_inputs_and_trains():
    set_seed(0)
    x = torch.randn(64, 8)
    labels = (x[:, 0] + x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, labels), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    acc = Accelerator(mixed_precision="bf16-true", cpu=True)
    model, opt, loader = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), loader)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())

    losses = []
    for epoch in range(8):  # 4 batches per epoch -> 32 steps
        for xb, yb in loader:
            assert yb.dtype == torch.int64  # integer tensors are left alone
            out = model(xb)  # the prepared forward casts float inputs to bf16 itself
            assert out.dtype == torch.float32  # and hands back fp32 outputs, as under mixed precision
            loss = nn.functional.cross_entropy(out, yb)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            losses.append(loss.item())
    assert len(losses) == 32
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_bf16_true_prepared_model_accepts_float32_inputs():
    """Inputs the user builds (not from a prepared loader) must reach a bf16 model too.

    Lightning Fabric's bf16-true converts forward inputs in the module wrapper; here the prepared
    model raises a bare torch dtype error, which DESIGN.md rules out ("never a bare traceback from
    deep inside torch for a mistake we could see").
    """
    acc = Accelerator(mixed_precision="bf16-true", cpu=True)
    model = acc.prepare(nn.Linear(4, 2))
    out = model(torch.randn(3, 4))
    assert out.shape == (3, 2)
