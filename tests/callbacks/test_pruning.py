"""ModelPruning: sparsity after each epoch (global and per-layer), the lottery ticket's reset to the initial
weights, the masks folded in at fit end, and checkpoints whose weights load into a module never pruned."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, ModelCheckpoint, ModelPruning
from fabric_lite.checkpoint.files import read_manifest
from fabric_lite.checkpoint.loading import load_file


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader():
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def sparsity(*tensors):
    return sum(int((t == 0).sum()) for t in tensors) / sum(t.numel() for t in tensors)


class Sparsity(Callback):
    """The zeros among both layers' weights after each epoch (runs after ModelPruning)."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_end(self, trainer, module):
        self.seen.append(sparsity(module.net[0].weight, module.net[2].weight))


def fit(callbacks, tmp_path, epochs=3, checkpointing=False):
    module = Net()
    t = Trainer(callbacks=callbacks, default_root_dir=tmp_path, enable_checkpointing=checkpointing,
                enable_progress_bar=False, enable_model_summary=False, logger=False, max_epochs=epochs)
    t.fit(module, loader())
    return module, t


def test_global_pruning_halves_what_is_left_each_epoch_and_is_made_permanent(tmp_path):
    notes = Sparsity()
    initial = Net()
    cb = ModelPruning("l1_unstructured", amount=0.5, parameter_names=["weight"])
    module, _ = fit([cb, notes], tmp_path)
    # 128 + 16 weights: half of what is left each epoch (rounded by torch to whole weights)
    assert notes.seen == [72 / 144, 108 / 144, 126 / 144]
    for layer in (module.net[0], module.net[2]):
        assert not prune.is_pruned(layer) and not hasattr(layer, "weight_orig")
        assert isinstance(layer.weight, nn.Parameter)
        assert not hasattr(layer, "weight_mask")
    assert sparsity(module.net[0].weight, module.net[2].weight) == 126 / 144
    # the lottery ticket (on by default): the surviving weights are back at their initial values
    for layer, first in ((module.net[0], initial.net[0]), (module.net[2], initial.net[2])):
        kept = layer.weight != 0
        assert torch.equal(layer.weight[kept], first.weight[kept])
    assert not torch.equal(module.net[0].bias, initial.net[0].bias)  # biases trained on, unpruned


def test_local_pruning_of_chosen_parameters_with_an_amount_per_epoch(tmp_path):
    holder = {}

    class Choose(ModelPruning):
        def filter_parameters_to_prune(self, parameters_to_prune=()):
            holder["chosen"] = [(type(m).__name__, n) for m, n in parameters_to_prune]
            return [(m, n) for m, n in parameters_to_prune if n == "weight"]

    cb = Choose("random_unstructured", use_global_unstructured=False, amount=lambda epoch: [4, 0, 2][epoch],
                use_lottery_ticket_hypothesis=False, make_pruning_permanent=False)
    module, _ = fit([cb], tmp_path)
    assert holder["chosen"] == [("Linear", "weight"), ("Linear", "weight"), ("Linear", "bias"), ("Linear", "bias")]
    # 4 weights of each layer at epoch 0, none at epoch 1, 2 more at epoch 2; the masks stay (not permanent)
    assert int((module.net[0].weight_mask == 0).sum()) == 6 and int((module.net[2].weight_mask == 0).sum()) == 6
    assert prune.is_pruned(module.net[0]) and not hasattr(module.net[0], "bias_mask")


def test_structured_pruning_removes_whole_rows(tmp_path):
    cb = ModelPruning("ln_structured", use_global_unstructured=False, amount=0.25, pruning_dim=0, pruning_norm=2,
                      parameter_names=["weight"], apply_pruning=lambda e: e == 0)
    module, _ = fit([cb], tmp_path, epochs=2)
    rows = (module.net[0].weight == 0).all(dim=1)
    assert int(rows.sum()) == 4  # a quarter of the 16 output units, pruned once


def test_checkpoints_hold_plain_weights_that_load_into_a_module_never_pruned(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1)
    fit([ModelPruning("l1_unstructured", amount=0.5, parameter_names=["weight"]), ckpt], tmp_path, epochs=2,
        checkpointing=True)
    url = str(tmp_path / "ck/epoch=0-step=4")
    state = load_file(url, "model_0.pt", read_manifest(url))
    assert sorted(state) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    fresh = Net()
    fresh.load_state_dict(state)  # strict: no *_orig / *_mask keys
    assert sparsity(fresh.net[0].weight, fresh.net[2].weight) == 72 / 144


def test_pruning_on_validation_epoch_end(tmp_path):
    notes = Sparsity()
    module = Net()
    t = Trainer(callbacks=[ModelPruning("l1_unstructured", amount=0.5, prune_on_train_epoch_end=False,
                                        parameter_names=["weight"]), notes],
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False,
                max_epochs=2, num_sanity_val_steps=2)
    t.fit(module, loader(), loader())
    # validation runs before the train epoch's end hooks: the sanity check prunes nothing
    assert notes.seen == [72 / 144, 108 / 144]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="allowed names are 'ln_structured'"):
        ModelPruning("l3_unstructured")
    with pytest.raises(ValueError, match="pass pruning_dim"):
        ModelPruning("random_structured", use_global_unstructured=False)
    with pytest.raises(ValueError, match="pass pruning_norm"):
        ModelPruning("ln_structured", use_global_unstructured=False, pruning_dim=0)
    with pytest.raises(ValueError, match="global pruning takes unstructured methods only"):
        ModelPruning("ln_structured", pruning_dim=0, pruning_norm=1)
    with pytest.raises(ValueError, match="parameter_names"):
        ModelPruning("l1_unstructured", parameter_names=["running_mean"])
    with pytest.raises(TypeError, match="the class, not an instance"):
        ModelPruning(prune.L1Unstructured(amount=0.2))
    with pytest.raises(ValueError, match="verbose"):
        ModelPruning("l1_unstructured", verbose=3)
    with pytest.raises(ValueError, match="not parameters of Net"):
        ModelPruning.sanitize_parameters_to_prune(Net(), [(nn.Linear(2, 2), "weight")])
