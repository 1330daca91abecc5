"""OnExceptionCheckpoint: a failure during fit leaves a whole checkpoint at the place it failed, and a fit from it
finishes the run; a fit that ends well removes an older one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import OnExceptionCheckpoint
from fabric_lite.checkpoint.files import read_manifest


class Failing(TrainModule):
    """Raises at `fail_at` = (epoch, batch_idx)."""

    def __init__(self, fail_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.fail_at = fail_at
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        if (self.current_epoch, batch_idx) == self.fail_at:
            raise RuntimeError("disk on fire")
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader():
    x = torch.randn(24, 3, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 6 batches


def trainer(callbacks, tmp_path, **kwargs):
    return Trainer(callbacks=callbacks, default_root_dir=tmp_path, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, logger=False, **kwargs)


def test_a_failure_saves_where_it_stopped_and_fit_resumes_from_it(tmp_path, capsys):
    cb = OnExceptionCheckpoint(tmp_path / "crash")
    assert cb.ckpt_path == f"{tmp_path}/crash/on_exception.ckpt"
    module = Failing(fail_at=(1, 2))
    with pytest.raises(RuntimeError, match="disk on fire"):
        trainer([cb], tmp_path, max_epochs=3).fit(module, loader())
    meta = read_manifest(cb.ckpt_path)["meta"]
    assert (meta["epoch"], meta["global_step"]) == (1, 8)  # 6 steps of epoch 0, batches 0 and 1 of epoch 1
    assert "resume with fit(..., ckpt_path=" in capsys.readouterr().err
    weights_at_failure = module.net.weight.detach().clone()

    resumed = Failing()
    cb2 = OnExceptionCheckpoint(tmp_path / "crash")
    t = trainer([cb2], tmp_path, max_epochs=3)
    t.fit(resumed, loader(), ckpt_path=cb.ckpt_path)
    # the failing batch was drawn from the loader before it failed: the resumed epoch goes on after it
    assert t.global_step == 8 + 3 + 6
    assert not torch.equal(resumed.net.weight, weights_at_failure)
    assert not os.path.exists(cb.ckpt_path)  # this fit ended well: the failure's checkpoint is gone


def test_a_failure_before_the_first_step_saves_a_checkpoint_of_the_start(tmp_path):
    cb = OnExceptionCheckpoint(str(tmp_path), filename="boom")
    module = Failing(fail_at=(0, 0))
    with pytest.raises(RuntimeError):
        trainer([cb], tmp_path, max_epochs=1).fit(module, loader())
    assert read_manifest(f"{tmp_path}/boom.ckpt")["meta"]["global_step"] == 0


def test_an_empty_filename_is_refused():
    with pytest.raises(ValueError, match="needs a name"):
        OnExceptionCheckpoint("somewhere", filename="")


def test_a_keyboard_interrupt_saves_too(tmp_path):
    class Interrupted(Failing):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    cb = OnExceptionCheckpoint(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        trainer([cb], tmp_path, max_epochs=1).fit(Interrupted(), loader())
    assert read_manifest(cb.ckpt_path)["meta"]["global_step"] == 3
