"""prepare() refuses an optimizer that trains none of the prepared models (built on another copy of the model,
or before the model was created again), in both doors; what is legitimate and looks alike passes."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, Trainer, TrainModule


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def refused(call, optimizer="SGD", model="Sequential"):
    with pytest.raises(ValueError) as err:
        call()
    text = str(err.value)
    assert "\n" not in text
    assert f"The {optimizer} holds none of the parameters of {model}" in text, text
    assert "model.parameters()" in text or "self.parameters()" in text, text
    return text


def test_an_optimizer_on_a_copy_of_the_model_is_refused():
    model = net()
    optimizer = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)
    refused(lambda: Accelerator(cpu=True).prepare(model, optimizer))


def test_an_optimizer_built_before_the_model_was_created_again_is_refused():
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = net()  # e.g. a second `model = build()` line, after the optimizer
    acc = Accelerator(cpu=True)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    text = refused(lambda: acc.prepare(model, optimizer, loader), optimizer="AdamW")
    assert "accelerator.prepare(model, optimizer)" in text
    assert acc.models == [] and acc.optimizers == []  # refused before anything was prepared


def test_an_optimizer_on_a_copy_prepared_in_a_later_call_is_refused():
    acc = Accelerator(cpu=True)
    model = net()
    acc.prepare(model)
    refused(lambda: acc.prepare(torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)))


def test_a_gan_whose_second_optimizer_is_on_a_copy_is_refused():
    generator, discriminator = net(0), nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))
    opt_g = torch.optim.Adam(generator.parameters())
    opt_d = torch.optim.Adam(copy.deepcopy(discriminator).parameters())
    refused(lambda: Accelerator(cpu=True).prepare(generator, discriminator, opt_g, opt_d), optimizer="Adam")


def test_what_is_legitimate_passes():
    # the model's own optimizer; the model prepared first and the optimizer built on what prepare returned
    model = net()
    Accelerator(cpu=True).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(net())
    acc.prepare(torch.optim.SGD(prepared.parameters(), lr=0.1))
    # an optimizer built before prepare(model), prepared in a later call
    acc, model = Accelerator(cpu=True), net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc.prepare(model)
    acc.prepare(optimizer)
    # an optimizer over a part of the model only, frozen or not
    model = net()
    model[0].requires_grad_(False)
    Accelerator(cpu=True).prepare(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    # a frozen model and an optimizer over a soft prompt (a standalone parameter)
    frozen, prompt = net().requires_grad_(False), nn.Parameter(torch.zeros(3, 4))
    Accelerator(cpu=True).prepare(frozen, torch.optim.SGD([prompt], lr=0.1))
    # SAC-style: actor trained, a target network nobody steps, a temperature on its own optimizer
    actor, target, log_alpha = net(0), net(1), nn.Parameter(torch.zeros(()))
    Accelerator(cpu=True).prepare(actor, target, torch.optim.Adam(actor.parameters()),
                                  torch.optim.Adam([log_alpha]))
    # an optimizer alone, on a model kept outside prepare
    Accelerator(cpu=True).prepare(torch.optim.SGD(net().parameters(), lr=0.1))
    # a model prepared for evaluation, then an optimizer for something else
    acc = Accelerator(cpu=True)
    acc.prepare_model(net(), evaluation_mode=True)
    acc.prepare(torch.optim.SGD(net(2).parameters(), lr=0.1))


class Regressor(TrainModule):
    def __init__(self, copy_for_optimizer=False):
        super().__init__()
        self.net = net()
        self.copies = [copy.deepcopy(self.net)] if copy_for_optimizer else []  # (a list: not a submodule)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD((self.copies[0] if self.copies else self).parameters(), lr=0.1)


def test_the_trainer_refuses_configure_optimizers_on_another_copy(tmp_path):
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    trainer = Trainer(max_epochs=1, accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, logger=False)
    text = refused(lambda: trainer.fit(Regressor(copy_for_optimizer=True), loader), model="Regressor")
    assert "configure_optimizers" in text and "self.parameters()" in text
    module = Regressor()
    Trainer(max_epochs=1, accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False, logger=False).fit(module, loader)
