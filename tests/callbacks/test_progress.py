"""TQDMProgressBar and RichProgressBar under Lightning's names and arguments: a bar per epoch or one reset each
epoch (`leave`), refresh_rate=0 drawing nothing, the validation and test bars, the rich theme and console_kwargs,
and `trainer.progress_bar_callback`."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import ProgressBar, RichProgressBar, RichProgressBarTheme, TQDMProgressBar


class Regressor(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("pb_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n=20):
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 5 batches of 20


def trainer(callbacks=(), **kwargs):
    return Trainer(callbacks=list(callbacks), enable_checkpointing=False, enable_model_summary=False, logger=False,
                   **kwargs)


def finished_lines(err):
    """What a non-terminal shows once tqdm is done: the last redraw of each line that ended."""
    return [line.split("\r")[-1] for line in err.split("\n")[:-1] if line.split("\r")[-1].strip()]


def test_lightnings_defaults_and_the_trainers_default_bar():
    bar = TQDMProgressBar()
    assert (bar.refresh_rate, bar.process_position, bar.leave) == (1, 0, False)
    default = trainer().progress_bar_callback
    assert type(default) is ProgressBar and isinstance(default, TQDMProgressBar)
    assert (default.refresh_rate, default.leave) == (20, True)
    assert trainer(enable_progress_bar=False).progress_bar_callback is None
    rich = RichProgressBar()
    assert trainer([rich]).progress_bar_callback is rich
    with pytest.raises(ValueError, match="process_position=-1"):
        TQDMProgressBar(process_position=-1)


@pytest.mark.parametrize("leave, epochs_left", [(True, ["Epoch 0", "Epoch 1"]), (False, ["Epoch 1"])])
def test_leave_keeps_each_epochs_bar_or_resets_one(capsys, leave, epochs_left):
    trainer([TQDMProgressBar(refresh_rate=2, leave=leave)], max_epochs=2).fit(Regressor(), loader())
    lines = finished_lines(capsys.readouterr().err)
    assert [line.split(":")[0] for line in lines] == epochs_left
    assert all("5/5" in line and "pb_loss=" in line for line in lines)


def test_validation_and_test_bars(capsys):
    t = trainer([TQDMProgressBar(leave=True)], max_epochs=1, num_sanity_val_steps=0)
    t.fit(Regressor(), loader(), loader(8))
    err = capsys.readouterr().err
    assert "Validation: " in err  # drawn under the training bar (a line down), then cleared
    assert finished_lines(err)[-1].startswith("Epoch 0: 100%") and "5/5" in finished_lines(err)[-1]
    t.test(dataloaders=loader(12))
    assert [line.split(":")[0] for line in finished_lines(capsys.readouterr().err)] == ["Testing"]


def test_refresh_rate_zero_draws_and_reads_nothing(capsys, monkeypatch):
    reads = []
    original = Trainer.progress_bar_metrics.fget
    monkeypatch.setattr(Trainer, "progress_bar_metrics", property(lambda t: reads.append(1) or original(t)))
    for bar in (TQDMProgressBar(refresh_rate=0), RichProgressBar(refresh_rate=0)):
        t = trainer([bar], max_epochs=1)
        t.fit(Regressor(), loader(), loader(8))
        assert bar.is_disabled and t.global_step == 5
    assert reads == [] and capsys.readouterr().err == ""


def test_disable_turns_a_bar_off():
    bar = TQDMProgressBar()
    bar.disable()
    assert bar.is_disabled
    bar.enable()
    assert bar.is_enabled


def test_rich_theme_and_console_kwargs():
    buf = io.StringIO()
    theme = RichProgressBarTheme(metrics_format=".2f", metrics_text_delimiter=" | ")
    t = trainer([RichProgressBar(refresh_rate=5, theme=theme, console_kwargs={"file": buf, "width": 200})],
                max_epochs=1)
    t.fit(Regressor(), loader())
    line = buf.getvalue().strip().splitlines()[-1]
    assert line.startswith("Epoch 0") and "5/5" in line
    assert f"pb_loss={float(t.progress_bar_metrics['pb_loss']):.2f}" in line
    with pytest.raises(TypeError, match="RichProgressBarTheme"):
        RichProgressBar(theme={"metrics": "bold"})


def test_lightnings_customization_points(capsys):
    class LitProgressBar(TQDMProgressBar):
        def init_validation_tqdm(self):
            bar = super().init_validation_tqdm()
            bar.set_description("running validation ...")
            return bar

        def get_metrics(self, trainer, pl_module):
            items = super().get_metrics(trainer, pl_module)
            items["lr"] = "0.05"  # a string is shown as it is
            items["loss"] = items.pop("pb_loss")
            return items

    bar = LitProgressBar(leave=True)
    t = trainer([bar], max_epochs=1, num_sanity_val_steps=0)
    t.fit(Regressor(), loader(), loader(8))
    err = capsys.readouterr().err
    assert "running validation ..." in err
    last = finished_lines(err)[-1]
    assert f"loss={float(t.progress_bar_metrics['pb_loss']):.4g}" in last and "lr=0.05" in last
    assert "pb_loss" not in last and bar.trainer is t
    with pytest.raises(RuntimeError, match="no trainer yet"):
        TQDMProgressBar().trainer
