"""Progress bars (the tqdm default and RichProgressBar, over one base) and TensorBoardLogger(log_graph=True):
what they show, when they read metrics, rank 0 only, the Trainer's default-callback rules, and that tracing
the graph leaves training bit for bit as it was."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback, ProgressBar, ProgressBarBase, RichProgressBar, TensorBoardLogger


def data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]))


def loader(ds, batch_size=4):
    return DataLoader(ds, batch_size=batch_size)


class Regressor(TrainModule):
    """Logs `pb_loss` to the progress bar and `train/loss` to loggers only."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        self.log("pb_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def make_trainer(tmp_path, callbacks=(), **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(default_root_dir=tmp_path, callbacks=list(callbacks), **kwargs)


def console(**kwargs):
    from rich.console import Console

    buf = io.StringIO()
    return Console(file=buf, width=200, **kwargs), buf


def record_metric_reads(monkeypatch):
    """Patch `Trainer.progress_bar_metrics` to note (epoch, global_step) at every read; returns the notes."""
    reads = []
    original = Trainer.progress_bar_metrics.fget

    def read(trainer):
        reads.append((trainer.current_epoch, trainer.global_step))
        return original(trainer)

    monkeypatch.setattr(Trainer, "progress_bar_metrics", property(read))
    return reads


def weights(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- progress bars -------------------------------------------------------------------------------

def test_rich_progress_bar_shows_each_epoch_with_its_prog_bar_metrics(tmp_path):
    con, buf = console()
    trainer = make_trainer(tmp_path, [RichProgressBar(refresh_rate=3, console=con)], max_epochs=2)
    trainer.fit(Regressor(), loader(data()), loader(data(seed=5)))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines
    for epoch, line in enumerate(lines):
        assert line.startswith(f"Epoch {epoch} ") and "10/10" in line and "it/s" in line
        assert "pb_loss=" in line and "val/loss=" in line and "train/loss" not in line
    final = {k: f"{float(v):.4g}" for k, v in trainer.progress_bar_metrics.items()}
    assert f"pb_loss={final['pb_loss']}" in lines[-1] and f"val/loss={final['val/loss']}" in lines[-1]


def test_rich_progress_bar_total_follows_limit_train_batches(tmp_path):
    con, buf = console()
    make_trainer(tmp_path, [RichProgressBar(console=con)], max_epochs=1, limit_train_batches=0.5).fit(
        Regressor(), loader(data()))
    assert "5/5" in buf.getvalue()


def test_rich_progress_bar_on_a_terminal_shows_validation_and_puts_everything_back(tmp_path):
    con, buf = console(force_terminal=True)
    bar = RichProgressBar(refresh_rate=1, console=con)
    stdout, stderr = sys.stdout, sys.stderr
    make_trainer(tmp_path, [bar], max_epochs=1, val_check_interval=5).fit(
        Regressor(), loader(data()), loader(data(seed=5)))
    out = buf.getvalue()
    assert "Sanity checking" in out and "Validation" in out and "Epoch 0" in out and "pb_loss=" in out
    assert sys.stdout is stdout and sys.stderr is stderr
    assert bar._progress is None and not con._live_stack


@pytest.mark.parametrize("make_bar", [lambda: ProgressBar(refresh_rate=4),
                                      lambda: RichProgressBar(refresh_rate=4, console=console()[0])],
                         ids=["tqdm", "rich"])
def test_bars_read_metrics_only_every_refresh_rate_steps_and_at_epoch_end(tmp_path, monkeypatch, make_bar):
    reads = record_metric_reads(monkeypatch)
    make_trainer(tmp_path, [make_bar()], max_epochs=2).fit(Regressor(), loader(data()))
    # 10 batches an epoch: after batches 4 and 8, then at the epoch end
    assert reads == [(0, 4), (0, 8), (0, 10), (1, 14), (1, 18), (1, 20)]


@pytest.mark.parametrize("make_bar", [lambda: ProgressBar(refresh_rate=1),
                                      lambda: RichProgressBar(refresh_rate=1, console=console(force_terminal=True)[0])],
                         ids=["tqdm", "rich"])
def test_bars_on_a_non_zero_rank_draw_nothing_and_read_nothing(tmp_path, monkeypatch, capsys, make_bar):
    bar = make_bar()
    reads = record_metric_reads(monkeypatch)
    monkeypatch.setattr(Trainer, "is_global_zero", property(lambda self: False))
    trainer = make_trainer(tmp_path, [bar], max_epochs=2)
    trainer.fit(Regressor(), loader(data()), loader(data(seed=5)))
    assert trainer.global_step == 20 and reads == []
    assert capsys.readouterr().err == ""
    if isinstance(bar, RichProgressBar):
        assert bar.console.file.getvalue() == ""


def test_default_callbacks_add_the_tqdm_bar_only_when_no_bar_is_given(tmp_path):
    def bars(trainer):
        return [c for c in trainer.callbacks if isinstance(c, ProgressBarBase)]

    assert [type(b) for b in bars(make_trainer(tmp_path))] == [ProgressBar]
    rich_bar, tqdm_bar = RichProgressBar(), ProgressBar(refresh_rate=5)
    assert bars(make_trainer(tmp_path, [rich_bar])) == [rich_bar]
    assert bars(make_trainer(tmp_path, [tqdm_bar])) == [tqdm_bar]
    assert bars(make_trainer(tmp_path, enable_progress_bar=False)) == []


@pytest.mark.parametrize("bar", [ProgressBar, RichProgressBar])
def test_enable_progress_bar_false_with_a_bar_in_callbacks_is_a_clear_error(tmp_path, bar):
    with pytest.raises(ValueError, match=f"enable_progress_bar=False, but a {bar.__name__} is in callbacks"):
        make_trainer(tmp_path, [bar()], enable_progress_bar=False)


def test_refresh_rate_must_be_a_non_negative_integer():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="refresh_rate"):
            RichProgressBar(refresh_rate=bad)
        with pytest.raises(ValueError, match="refresh_rate"):
            ProgressBar(refresh_rate=bad)


def test_rich_progress_bar_without_rich_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(ImportError, match=r"pip install 'fabric-lite\[rich\]'"):
        RichProgressBar()


def test_importing_fabric_lite_does_not_import_rich():
    code = ("import sys, fabric_lite, fabric_lite.callbacks\n"
            "from fabric_lite.callbacks import RichProgressBar\n"
            "assert 'rich' not in sys.modules, 'rich imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- TensorBoard graph ---------------------------------------------------------------------------

def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


class TwoInputs(Regressor):
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(4, 1)
        self.example_input_array = (torch.randn(2, 4), torch.randn(2, 4))

    def forward(self, x, z=None):
        return self.net(x) if z is None else self.net(x) * self.scale(z)


@pytest.mark.parametrize("module_cls", [Regressor, TwoInputs], ids=["tensor", "tuple"])
def test_log_graph_writes_a_graph_that_tensorboard_reads_back(tmp_path, module_cls):
    module = module_cls()
    if module.example_input_array is None:
        module.example_input_array = torch.randn(3, 4)
    tb = TensorBoardLogger(tmp_path / "tb", log_graph=True)
    make_trainer(tmp_path, [tb], max_epochs=1, enable_progress_bar=False).fit(module, loader(data()))
    acc = _accumulator(tb.log_dir)
    assert acc.Tags()["graph"] is True and "train/loss" in acc.Tags()["scalars"]
    nodes = [n.name for n in acc.Graph().node]
    assert any("Linear[net]" in n for n in nodes), nodes
    inputs = [n for n in nodes if n.startswith("input/")]
    assert len(inputs) == (2 if module_cls is TwoInputs else 1), nodes
    assert module.example_input_array is not None


def test_no_graph_without_log_graph(tmp_path):
    module = Regressor()
    module.example_input_array = torch.randn(3, 4)
    tb = TensorBoardLogger(tmp_path / "tb")
    make_trainer(tmp_path, [tb], max_epochs=1, enable_progress_bar=False).fit(module, loader(data()))
    assert _accumulator(tb.log_dir).Tags()["graph"] is False


def test_log_graph_without_example_input_array_warns_once_and_trains(tmp_path):
    tb = TensorBoardLogger(tmp_path / "tb", log_graph=True)
    with pytest.warns(UserWarning, match="example_input_array") as record:
        for _ in range(2):
            trainer = make_trainer(tmp_path, [tb], max_epochs=1, enable_progress_bar=False)
            trainer.fit(Regressor(), loader(data()))
            assert trainer.global_step == 10
    assert len([w for w in record if "example_input_array" in str(w.message)]) == 1
    assert _accumulator(tb.log_dir).Tags()["graph"] is False


def test_log_graph_with_an_example_that_is_not_tensors_is_a_clear_error(tmp_path):
    module = Regressor()
    module.example_input_array = {"x": torch.randn(3, 4)}
    tb = TensorBoardLogger(tmp_path / "tb", log_graph=True)
    with pytest.raises(TypeError, match="example_input_array must be a tensor or a tuple of tensors"):
        make_trainer(tmp_path, [tb], max_epochs=1, enable_progress_bar=False).fit(module, loader(data()))


class Noisy(Regressor):
    """Dropout, a submodule left in eval mode, and noise drawn in every forward (training or not)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.frozen = nn.Dropout(0.5)
        self.frozen.eval()
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x):
        h = self.net(self.drop(self.frozen(x)))
        return h + 0.01 * torch.randn_like(h)


class StateAtFitStart(Callback):
    def on_fit_start(self, trainer, module):
        self.rng = torch.get_rng_state()
        self.modes = {name: m.training for name, m in module.named_modules()}
        self.grad_enabled = torch.is_grad_enabled()


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_log_graph_leaves_modes_rng_and_trained_weights_as_they_were(tmp_path):
    x = torch.randn(3, 4)
    probe = Noisy()
    before = torch.get_rng_state()
    probe(x)
    assert not torch.equal(before, torch.get_rng_state())  # the forward draws random numbers: tracing would too

    results = {}
    for log_graph in (False, True):
        torch.manual_seed(123)
        module = Noisy()
        first, last = StateAtFitStart(), StateAtFitStart()
        tb = TensorBoardLogger(tmp_path / f"tb_{log_graph}", log_graph=log_graph)
        trainer = make_trainer(tmp_path, [first, tb, last], max_epochs=2, enable_progress_bar=False)
        trainer.fit(module, loader(data()))
        assert torch.equal(first.rng, last.rng)
        assert first.modes == last.modes and last.modes["frozen"] is False and last.modes["drop"] is True
        assert first.grad_enabled and last.grad_enabled
        assert _accumulator(tb.log_dir).Tags()["graph"] is log_graph
        results[log_graph] = weights(module)
    assert torch.equal(results[False], results[True])
