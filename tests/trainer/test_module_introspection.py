"""Every attribute of a TrainModule reads without raising: `hasattr`, torch.jit.trace (which TensorBoardLogger(
log_graph=True) runs) and other code that walks a module's attributes see Lightning's names as values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric_lite import Trainer, TrainModule
from fabric_lite.utils.refusals import NotSupportedError


class Net(TrainModule):
    def __init__(self, width: int = 4, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 2)

    def forward(self, x):
        return self.layer(x)


def test_every_attribute_of_a_module_reads_and_the_module_traces():
    module = Net()
    module.trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    for name in dir(module):
        hasattr(module, name)  # raises on a member that refuses to be read
    traced = torch.jit.trace(module, torch.randn(3, 4))
    x = torch.randn(5, 4)
    torch.testing.assert_close(traced(x), module(x))


def test_fabric_is_none_hparams_initial_is_a_copy_and_strict_loading_is_fixed():
    module = Net(width=4, lr=0.5)
    assert module.fabric is None  # (Lightning's value for a module its Trainer runs)
    module.hparams.lr = 0.01
    assert dict(module.hparams_initial) == {"width": 4, "lr": 0.5}
    assert dict(TrainModule().hparams_initial) == {}
    assert module.strict_loading is True
    module.strict_loading = True
    with pytest.raises(NotSupportedError, match="strict_loading=False"):
        module.strict_loading = False
