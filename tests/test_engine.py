"""The step engine under both doors (fabric_lite/engine.py): how the loss of an accumulation window is
divided (`divide_loss_by`), and that the Trainer's micro-steps are the Accelerator's."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, Trainer, TrainModule

BATCHES, BATCH, ACCUMULATE = 5, 2, 2  # 5 batches in windows of 2: the last window holds one batch


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(len(x), 1, generator=g))


def fresh_model():
    torch.manual_seed(1)
    return nn.Linear(3, 1)


def reference(divide_by_window: bool, epochs: int = 2):
    """A plain torch loop: windows of ACCUMULATE batches, the last one shorter; each micro-step's loss
    divided by the configured steps or by its window's real length."""
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data(), batch_size=BATCH)
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            start = i - i % ACCUMULATE
            window = min(ACCUMULATE, BATCHES - start) if divide_by_window else ACCUMULATE
            (nn.functional.mse_loss(model(x), y) / window).backward()
            if (i + 1) % ACCUMULATE == 0 or i + 1 == BATCHES:
                opt.step()
                opt.zero_grad()
    return model.weight.detach().clone()


def accelerator_run(epochs: int = 2, **kwargs):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE, **kwargs)
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data(), batch_size=BATCH))
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                steps += acc.sync_gradients
                opt.step()
                opt.zero_grad()
    assert steps == 3 * epochs  # windows of 2, 2 and 1 batch per epoch
    return acc.unwrap_model(model).weight.detach().clone()


def test_accelerator_divides_by_gradient_accumulation_steps_by_default():
    """Accelerate's documented behaviour: the last, shorter window is divided by the configured steps too."""
    ours = accelerator_run()
    assert torch.allclose(ours, reference(divide_by_window=False), atol=1e-7, rtol=0)
    assert not torch.allclose(ours, reference(divide_by_window=True), atol=1e-5, rtol=0)


def test_accelerator_divide_loss_by_window():
    ours = accelerator_run(divide_loss_by="window")
    assert torch.allclose(ours, reference(divide_by_window=True), atol=1e-7, rtol=0)
    assert not torch.allclose(ours, reference(divide_by_window=False), atol=1e-5, rtol=0)


class Regression(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = fresh_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_run(**kwargs):
    module = Regression()
    Trainer(max_epochs=2, accelerator="cpu", accumulate_grad_batches=ACCUMULATE, enable_progress_bar=False,
            enable_checkpointing=False, num_sanity_val_steps=0, **kwargs).fit(module, DataLoader(data(), batch_size=BATCH))
    return module.net.weight.detach().clone()


def test_trainer_divides_by_the_real_window_and_matches_the_accelerator(tmp_path):
    ours = trainer_run(default_root_dir=str(tmp_path))
    assert torch.allclose(ours, reference(divide_by_window=True), atol=1e-7, rtol=0)
    assert torch.equal(ours, accelerator_run(divide_loss_by="window"))  # one engine: the same arithmetic


def test_trainer_window_closes_at_the_batch_limit(tmp_path):
    """limit_train_batches=3 with windows of 2: the second window is one batch, divided by one."""
    ours = trainer_run(default_root_dir=str(tmp_path), limit_train_batches=3)
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for i, (x, y) in enumerate(DataLoader(data(), batch_size=BATCH)):
            if i == 3:
                break
            (nn.functional.mse_loss(model(x), y) / (2 if i < 2 else 1)).backward()
            if i in (1, 2):
                opt.step()
                opt.zero_grad()
    assert torch.allclose(ours, model.weight.detach(), atol=1e-7, rtol=0)


def test_unknown_divide_loss_by_is_refused():
    with pytest.raises(ValueError, match=r"divide_loss_by='steps'.*'gradient_accumulation_steps', 'window'"):
        Accelerator(cpu=True, divide_loss_by="steps")


def test_micro_steps_without_accumulate_still_close_windows():
    """No accumulation: every micro-step syncs and the loss is not divided (the hot path stays plain)."""
    acc = Accelerator(cpu=True)
    model = fresh_model()
    reference_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x, y = data().tensors
    acc.backward(nn.functional.mse_loss(model(x), y))
    nn.functional.mse_loss(reference_model(x), y).backward()
    assert acc.sync_gradients and acc.loss_divisor == 1
    assert torch.equal(model.weight.grad, reference_model.weight.grad)


def test_accelerate_style_division_also_without_accumulate():
    """Scripts that accumulate with no_sync themselves: backward still divides by the configured steps."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = fresh_model()
    reference_model = copy.deepcopy(model)
    model = acc.prepare(model)
    x, y = data().tensors
    acc.backward(nn.functional.mse_loss(model(x), y))
    (nn.functional.mse_loss(reference_model(x), y) / 4).backward()
    assert torch.equal(model.weight.grad, reference_model.weight.grad)


def window_divisors(n, batches, skip=0, sync_with_dataloader=True, epochs=1):
    """The divisor and window end the engine picks for each micro-step of a raw loop (divide_loss_by="window")."""
    from fabric_lite import GradientAccumulationPlugin, skip_first_batches

    acc = Accelerator(cpu=True, divide_loss_by="window", gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=n, sync_with_dataloader=sync_with_dataloader))
    loader = acc.prepare(DataLoader(torch.arange(batches), batch_size=1))
    seen = []
    for _ in range(epochs):
        for _batch in skip_first_batches(loader, skip) if skip else loader:
            with acc.accumulate():
                seen.append((acc.loss_divisor, acc.sync_gradients))
    return seen


def test_raw_door_window_division_follows_its_own_windows():
    # 10 batches in windows of 3: 3 3 3 | 3 3 3 | 3 3 3 | 1
    assert window_divisors(3, 10) == [(3, False), (3, False), (3, True)] * 3 + [(1, True)]
    # after skip_first_batches(loader, 4), 6 batches are left: two full windows
    assert window_divisors(3, 10, skip=4) == [(3, False), (3, False), (3, True)] * 2
    # windows that run over the epoch's end (sync_with_dataloader=False) are always full
    seen = window_divisors(3, 4, sync_with_dataloader=False, epochs=3)
    assert [d for d, _ in seen] == [3] * 12 and [s for _, s in seen] == [False, False, True] * 4


def test_manual_backward_after_an_accumulating_fit_is_not_divided(tmp_path):
    class Manual(Regression):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.grads = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            self.grads.append(self.net.weight.grad.clone())
            opt.step()

    trainer = Trainer(max_epochs=1, accelerator="cpu", accumulate_grad_batches=3, enable_progress_bar=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(Regression(), DataLoader(data(), batch_size=BATCH))  # leaves a window divisor behind
    trainer.max_epochs = 2  # one more epoch, manual this time
    module = Manual()
    reference_model = copy.deepcopy(module.net)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    x, y = next(iter(DataLoader(data(), batch_size=BATCH)))
    nn.functional.mse_loss(reference_model(x), y).backward()
    assert torch.equal(module.grads[0], reference_model.weight.grad)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset without a length: the loader finds its last batch by looking one ahead."""

    def __iter__(self):
        return iter(data())


def test_trainer_closes_the_last_window_of_an_iterable_dataset(tmp_path):
    """No length: the last window (one batch of 5 in windows of 2) still steps at the epoch's end, its
    micro-steps divided by the configured steps, and nothing leaks into the next epoch."""
    module = Regression()
    trainer = Trainer(max_epochs=2, accelerator="cpu", accumulate_grad_batches=ACCUMULATE, enable_progress_bar=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(Stream(), batch_size=BATCH))
    assert trainer.global_step == 6
    assert torch.allclose(module.net.weight.detach(), reference(divide_by_window=False), atol=1e-7, rtol=0)
