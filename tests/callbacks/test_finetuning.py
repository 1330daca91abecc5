"""BaseFinetuning / BackboneFinetuning: the backbone is frozen until its epoch, then trains in its own parameter
group at the learning rate Lightning computes; the weights equal a plain two-group SGD loop, and a run resumed
from a checkpoint after the unfreeze ends bit for bit where the uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import BackboneFinetuning, BaseFinetuning, Callback, ModelCheckpoint


class WithBackbone(TrainModule):
    def __init__(self, filtered=True):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.filtered = filtered

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        params = filter(lambda p: p.requires_grad, self.parameters()) if self.filtered else self.parameters()
        return torch.optim.SGD(params, lr=0.1)


def loader():
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(2))
    return DataLoader(TensorDataset(x, torch.sin(x.sum(1, keepdim=True))), batch_size=5)  # 4 batches


def trainer(callbacks, tmp_path, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(callbacks=callbacks, default_root_dir=tmp_path, enable_progress_bar=False,
                   enable_model_summary=False, logger=False, **kwargs)


class Notes(Callback):
    """At each epoch start (after the finetuning callback): is the backbone trainable, the groups' learning rates."""

    def __init__(self):
        self.epochs = []

    def on_train_epoch_start(self, trainer, module):
        opt = trainer.optimizers[0]
        self.epochs.append((module.backbone[0].weight.requires_grad, [g["lr"] for g in opt.param_groups],
                            len(opt.optimizer.param_groups)))


def plain_loop(epochs, unfreeze_at, lrs):
    """The same training by hand: the head alone at 0.1, then the backbone in a second group at lrs[epoch]."""
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1)
    backbone.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for epoch in range(epochs):
        if epoch == unfreeze_at:
            backbone.requires_grad_(True)
            opt.add_param_group({"params": list(backbone.parameters()), "lr": lrs[epoch]})
        elif epoch > unfreeze_at:
            opt.param_groups[-1]["lr"] = lrs[epoch]
        for x, y in loader():
            F.mse_loss(head(backbone(x)), y).backward()
            opt.step()
            opt.zero_grad()
    return backbone, head


def test_backbone_frozen_then_trained_at_lightnings_learning_rates(tmp_path):
    module, notes = WithBackbone(), Notes()
    start = module.backbone[0].weight.detach().clone()
    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.1)
    trainer([cb, notes], tmp_path, max_epochs=4).fit(module, loader())
    lrs = [None, 0.1 * 0.1, 0.1 * 0.1 * 1.5, 0.1 * 0.1 * 1.5 * 1.5]
    assert [n[0] for n in notes.epochs] == [False, True, True, True]
    assert [n[2] for n in notes.epochs] == [1, 2, 2, 2]  # the group reached the optimizer under the wrapper
    for (_, groups, _), lr in zip(notes.epochs[1:], lrs[1:]):
        assert groups[0] == 0.1 and groups[1] == pytest.approx(lr)
    assert not torch.equal(module.backbone[0].weight, start)
    backbone, head = plain_loop(4, 1, lrs)
    torch.testing.assert_close(module.backbone[0].weight, backbone[0].weight)
    torch.testing.assert_close(module.head.weight, head.weight)


def test_an_optimizer_over_every_parameter_gets_the_frozen_ones_taken_out(tmp_path):
    module, notes = WithBackbone(filtered=False), Notes()
    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)
    trainer([cb, notes], tmp_path, max_epochs=2).fit(module, loader())
    assert [n[2] for n in notes.epochs] == [1, 2]
    backbone, head = plain_loop(2, 1, [None, 0.01])
    torch.testing.assert_close(module.head.weight, head.weight)
    torch.testing.assert_close(module.backbone[0].weight, backbone[0].weight)


def test_should_align_holds_the_backbone_at_the_models_rate(tmp_path):
    notes = Notes()
    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=0, lambda_func=lambda epoch: 4.0, backbone_initial_lr=0.05)
    trainer([cb, notes], tmp_path, max_epochs=3).fit(WithBackbone(), loader())
    assert [n[1] for n in notes.epochs] == [[0.1, 0.05], [0.1, 0.1], [0.1, 0.1]]  # 0.2 would pass 0.1


def test_resuming_after_the_unfreeze_equals_the_uninterrupted_run(tmp_path):
    def callbacks():
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)]

    whole = WithBackbone()
    trainer(callbacks(), tmp_path, max_epochs=4).fit(whole, loader())

    first = trainer([*callbacks(), ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1)], tmp_path,
                    enable_checkpointing=True, max_epochs=2)
    first.fit(WithBackbone(), loader())
    resumed, notes = WithBackbone(), Notes()
    cbs = callbacks()
    trainer([*cbs, notes], tmp_path, max_epochs=4).fit(resumed, loader(), ckpt_path=str(tmp_path / "ck/epoch=1-step=8"))
    assert [n[2] for n in notes.epochs] == [2, 2] and notes.epochs[0][0]  # the backbone's group came back
    assert cbs[0].previous_backbone_lr == pytest.approx(0.01 * 1.5 * 1.5)
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def test_base_finetuning_tools():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.Linear(3, 1)))
    assert len(BaseFinetuning.flatten_modules(net)) == 3
    BaseFinetuning.freeze(net, train_bn=True)
    assert [p.requires_grad for p in net.parameters()] == [False, False, True, True, False, False]
    assert len(list(BaseFinetuning.filter_params(net, train_bn=False, requires_grad=False))) == 4
    BaseFinetuning.freeze(net, train_bn=False)
    assert not any(p.requires_grad for p in net.parameters()) and not net[1].track_running_stats
    opt = torch.optim.SGD(net[0].parameters(), lr=0.3)
    net[0].weight.requires_grad_(True)
    BaseFinetuning.unfreeze_and_add_param_group(net[2], opt, initial_denom_lr=3.0)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == pytest.approx(0.1)
    assert all(p.requires_grad for p in net[2].parameters())
    BaseFinetuning.make_trainable(net)
    assert net[1].track_running_stats and all(p.requires_grad for p in net.parameters())


def test_a_module_without_a_backbone_is_refused(tmp_path):
    class NoBackbone(WithBackbone):
        def __init__(self):
            super().__init__()
            self.body = self.backbone
            del self.backbone

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.body(x)), y)

    with pytest.raises(ValueError, match="`backbone` attribute"):
        trainer([BackboneFinetuning()], tmp_path, max_epochs=1).fit(NoBackbone(), loader())
