"""Lightning's names on the Trainer: `from fabric_lite import Callback`, the process's ranks, the model summary at
the start of fit, `profiler="simple"`, `sync_batchnorm=True`, and `logger=`."""

from __future__ import annotations

import csv
import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import torchrun
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import CSVLogger, EarlyStopping, TensorBoardLogger
from fabric_lite.callbacks.base import Callback
from fabric_lite.callbacks.summary import ModelSummary, summarize
from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.trainer.profiler import PassThroughProfiler, Profiler, SimpleProfiler
from fabric_lite.trainer.trainer import convert_sync_batchnorm


def data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def loader(n=32, batch_size=4):
    return DataLoader(data(n), batch_size=batch_size)


class Net(TrainModule):
    """Three top-level children: a Sequential with a BatchNorm, a frozen Linear, and a parameter-free ReLU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.frozen = nn.Linear(3, 5)
        self.frozen.requires_grad_(False)
        self.act = nn.ReLU()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.body(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.body(x), y))

    def predict_step(self, batch, batch_idx):
        return self.body(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer(tmp_path, **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return Trainer(accelerator="cpu", default_root_dir=str(tmp_path), **kwargs)


# -- names -----------------------------------------------------------------------------------------

def test_callback_is_a_top_level_name():
    import fabric_lite

    assert fabric_lite.Callback is Callback
    assert "Callback" in dir(fabric_lite)


def test_ranks_and_sizes_of_a_lone_process(tmp_path):
    t = trainer(tmp_path)
    assert (t.global_rank, t.local_rank, t.node_rank) == (0, 0, 0)
    assert (t.world_size, t.num_nodes, t.num_devices, t.is_global_zero) == (1, 1, 1, True)


def test_ranks_and_sizes_come_from_the_process(tmp_path, monkeypatch):
    t = trainer(tmp_path)
    monkeypatch.setattr(t.strategy, "process", ProcessInfo(world_size=8, global_rank=5, local_rank=1,
                                                           local_world_size=4, node_rank=1))
    assert (t.global_rank, t.local_rank, t.node_rank) == (5, 1, 1)
    assert (t.world_size, t.num_nodes, t.num_devices, t.is_global_zero) == (8, 2, 4, False)


# -- model summary ---------------------------------------------------------------------------------

def summary_lines(err):
    return [line for line in err.splitlines() if line.strip()]


def test_the_summary_is_printed_once_when_fit_starts_with_the_module_numbers(tmp_path, capsys):
    module = Net()
    trainer(tmp_path, max_epochs=2).fit(module, loader(), loader(8))
    err = capsys.readouterr().err
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    assert (total, trainable) == (4 * 16 + 16 + 16 + 16 + 16 + 1 + 3 * 5 + 5, total - 20)
    assert err.count("Total params") == 1  # once per fit, though fit runs two epochs and validation
    lines = summary_lines(err)
    assert f"{trainable:<10,}Trainable params" in lines
    assert f"{total - trainable:<10,}Non-trainable params" in lines
    assert f"{total:<10,}Total params" in lines
    size = next(line for line in lines if line.endswith("Total estimated model params size (MB)"))
    assert float(size.split()[0]) == pytest.approx(total * 4 / 1e6, abs=5e-4)
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.split("|")] for line in lines)
            if len(cells) == 5 and cells[0].isdigit()}
    body = sum(p.numel() for p in module.body.parameters())
    assert rows == {"body": ["Sequential", f"{body:,}", "train"], "frozen": ["Linear", "20", "train"],
                    "act": ["ReLU", "0", "train"]}


def test_enable_model_summary_false_prints_nothing(tmp_path, capsys):
    t = trainer(tmp_path, max_epochs=1, enable_model_summary=False)
    t.fit(Net(), loader())
    assert capsys.readouterr().err == ""
    assert not any(isinstance(c, ModelSummary) for c in t.callbacks)


def test_a_summary_of_ones_own_replaces_the_default(tmp_path, capsys):
    t = trainer(tmp_path, max_epochs=1, callbacks=[ModelSummary(max_depth=2)])
    t.fit(Net(), loader())
    err = capsys.readouterr().err
    assert err.count("Total params") == 1 and "body.1" in err and "BatchNorm1d" in err
    assert sum(isinstance(c, ModelSummary) for c in t.callbacks) == 1
    with pytest.raises(ValueError, match="enable_model_summary=False, but a ModelSummary"):
        trainer(tmp_path, enable_model_summary=False, callbacks=[ModelSummary()])
    with pytest.raises(TypeError, match=r"Trainer\(enable_model_summary='no'\)"):
        trainer(tmp_path, enable_model_summary="no")


def test_the_summary_is_main_process_only_and_not_under_explain(tmp_path, capsys):
    class NotZero:
        is_global_zero = False

    ModelSummary().on_fit_start(NotZero(), Net())
    ModelSummary(max_depth=0).on_fit_start(trainer(tmp_path), Net())
    assert capsys.readouterr().err == ""
    trainer(tmp_path, explain=True, max_epochs=1).fit(Net(), loader())
    captured = capsys.readouterr()
    assert "Total params" not in captured.out + captured.err


def test_summarize_counts_shared_parameters_once_and_every_depth():
    shared = nn.Linear(2, 2)
    module = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(2, 3)))
    s = summarize(module, max_depth=-1)
    assert s.total_parameters == s.trainable_parameters == 6 + 9
    assert [row[0] for row in s.rows] == ["0", "1", "1.1"]  # (the shared layer is listed once)
    assert summarize(module, max_depth=0).rows == []
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-2)


# -- profiler --------------------------------------------------------------------------------------

def table_rows(text):
    """{action: (mean, calls, total)} from a SimpleProfiler report."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[2].isdigit():
            rows[cells[0]] = (cells[1], int(cells[2]), cells[3])
    return rows


class CountsBatches(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        pass


def test_the_simple_profiler_times_each_call_and_prints_its_table_at_the_end(tmp_path, capsys):
    t = trainer(tmp_path, max_epochs=2, profiler="simple", accumulate_grad_batches=2, callbacks=[CountsBatches()],
                enable_model_summary=False)
    assert isinstance(t.profiler, SimpleProfiler)
    t.fit(Net(), loader(32), loader(8))  # 8 batches an epoch, 2 validation batches
    err = capsys.readouterr().err
    assert err.startswith("FIT Profiler Report")
    rows = table_rows(t.profiler.describe())
    assert rows["[Strategy]SingleDeviceStrategy.training_step"][1] == 16
    assert rows["[Strategy]SingleDeviceStrategy.backward"][1] == 16
    assert rows["[Strategy]SingleDeviceStrategy.optimizer_step"][1] == 8  # one per window of 2
    assert rows["train_dataloader_next"][1] == 2 * 9  # the fetch that finds the loader empty counts too
    assert rows["[Strategy]SingleDeviceStrategy.validation_step"][1] == 4
    assert rows["[Callback]CountsBatches.on_train_batch_end"][1] == 16
    assert rows["run_training_epoch"][1] == 2
    assert rows["Total"][1] == sum(n for action, (_, n, _) in rows.items() if action != "Total")
    assert not any("on_validation_batch_end" in action for action in rows)  # empty default hooks are not timed
    assert "[Strategy]SingleDeviceStrategy.training_step" in err

    t.validate(dataloaders=loader(8))
    text = capsys.readouterr().err
    assert text.startswith("VALIDATE Profiler Report")
    assert table_rows(text)["[Strategy]SingleDeviceStrategy.validation_step"][1] == 2


def test_a_profiler_object_writes_its_report_file(tmp_path, capsys):
    profiler = SimpleProfiler(dirpath=tmp_path / "prof", filename="perf")
    t = trainer(tmp_path, max_steps=3, profiler=profiler, enable_model_summary=False)
    assert t.profiler is profiler
    t.fit(Net(), loader())
    written = (tmp_path / "prof" / "fit-perf.txt").read_text()
    assert table_rows(written)["[Strategy]SingleDeviceStrategy.training_step"][1] == 3
    with profiler.profile("mine"):  # user code can time its own blocks
        pass
    assert table_rows(profiler.describe())["mine"][1] == 1


def test_no_profiler_means_no_timing_calls(tmp_path, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a timing call without a profiler")

    for name in ("start", "stop", "wrap", "iterate", "timed", "setup", "describe"):
        monkeypatch.setattr(PassThroughProfiler, name, must_not_run)
    t = trainer(tmp_path, max_epochs=1, callbacks=[CountsBatches()])
    assert isinstance(t.profiler, PassThroughProfiler) and not t.profiler.enabled
    t.fit(Net(), loader(), loader(8))
    t.validate(dataloaders=loader(8))
    t.predict(dataloaders=loader(8))
    assert "Profiler Report" not in capsys.readouterr().err


@pytest.mark.parametrize("value,exc,fragment", [
    ("fancy", ValueError, "must be one of 'simple', 'advanced', 'pytorch'"),
    (3, TypeError, "got int"), (SimpleProfiler, TypeError, "got type"),
])
def test_a_bad_profiler_is_refused_naming_it(value, exc, fragment):
    with pytest.raises(exc) as err:
        Trainer(profiler=value)
    assert f"Trainer(profiler={value!r})" in str(err.value) and fragment in str(err.value)
    assert issubclass(SimpleProfiler, Profiler)


# -- sync_batchnorm --------------------------------------------------------------------------------

def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    module = Net()
    bn = module.body[1]
    bn.running_mean.fill_(0.5)
    weight, stats = bn.weight, bn.running_mean
    kept = nn.SyncBatchNorm(3)
    module.extra = nn.Sequential(nn.BatchNorm2d(2), kept)
    assert convert_sync_batchnorm(module) == 2
    assert isinstance(module.body[1], nn.SyncBatchNorm) and isinstance(module.extra[0], nn.SyncBatchNorm)
    assert module.body[1].weight is weight and torch.equal(module.body[1].running_mean, stats)
    assert module.extra[1] is kept  # a SyncBatchNorm already there stays
    assert convert_sync_batchnorm(module) == 0


def test_sync_batchnorm_on_one_process_changes_nothing(tmp_path):
    module = Net()
    trainer(tmp_path, max_steps=2, sync_batchnorm=True).fit(module, loader())
    assert type(module.body[1]) is nn.BatchNorm1d


def test_sync_batchnorm_converts_the_module_before_it_is_prepared_on_several_processes(tmp_path, monkeypatch):
    """The Trainer told it has 2 processes (its collectives stay on this one, with no process group, where
    SyncBatchNorm normalizes as BatchNorm does, also on the CPU): the module's layers are converted in fit."""
    t = trainer(tmp_path, max_steps=2, sync_batchnorm=True)
    monkeypatch.setattr(Trainer, "world_size", property(lambda self: 2))
    module = Net()
    t.fit(module, loader())
    assert isinstance(module.body[1], nn.SyncBatchNorm) and int(module.body[1].num_batches_tracked) == 2
    assert t.global_step == 2
    assert any(p is module.body[1].weight for g in t.optimizers[0].param_groups for p in g["params"])
    with pytest.raises(TypeError, match=r"Trainer\(sync_batchnorm='yes'\)"):
        Trainer(sync_batchnorm="yes")


SYNC_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from fabric_lite import Trainer

    out = sys.argv[sys.argv.index("--out") + 1]
    result = {}
    try:
        Trainer(accelerator="cpu", sync_batchnorm=True, enable_progress_bar=False, enable_checkpointing=False)
    except ValueError as err:
        result["trainer"] = str(err)
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False)
    result["world"] = trainer.world_size
    try:  # what torch itself does with a CPU tensor under the process group
        torch.nn.SyncBatchNorm(3).train()(torch.randn(4, 3))
        result["torch"] = "ran"
    except ValueError as err:
        result["torch"] = str(err)
    with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sync_batchnorm_on_two_cpu_processes_is_a_clear_error_on_every_rank(tmp_path):
    script = tmp_path / "sync_bn_worker.py"
    script.write_text(SYNC_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    for result in torchrun(script, 2, out_dir=out, timeout=150):
        assert result["world"] == 2
        # torch refuses CPU tensors; if it ever stops refusing, the Trainer's refusal must go too
        assert "expected input tensor to be on GPU" in result["torch"]
        message = result["trainer"]
        assert message.startswith("Trainer(sync_batchnorm=True): ") and "'cpu'" in message and "2 processes" in message


# -- logger= ---------------------------------------------------------------------------------------

def test_a_logger_given_as_logger_is_a_callback_and_trainer_logger_returns_it(tmp_path):
    csv_logger = CSVLogger(str(tmp_path / "logs"))
    t = trainer(tmp_path, max_epochs=1, logger=csv_logger)
    assert t.logger is csv_logger and t.loggers == [csv_logger] and csv_logger in t.callbacks
    t.fit(Net(), loader())
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        assert "loss" in next(csv.reader(f))
    assert t.log_dir == csv_logger.log_dir


def test_a_list_of_loggers_and_loggers_among_the_callbacks(tmp_path):
    first, second = CSVLogger(str(tmp_path / "a")), TensorBoardLogger(str(tmp_path / "b"))
    t = trainer(tmp_path, logger=[first, second], callbacks=[first])  # (the same one twice: there once)
    assert t.loggers == [first, second] and t.callbacks.count(first) == 1 and t.logger is first
    t = trainer(tmp_path, logger=(first, second))
    assert t.loggers == [first, second] and t.logger is first
    t = trainer(tmp_path, callbacks=[second])  # logger=None: the loggers in callbacks are the loggers
    assert t.logger is second and t.loggers == [second]


def test_logger_true_false_none(tmp_path):
    assert trainer(tmp_path).logger is None and trainer(tmp_path).log_dir == str(tmp_path)
    t = trainer(tmp_path, max_steps=1, logger=True)
    assert isinstance(t.logger, TensorBoardLogger) and t.logger.name == "lightning_logs"
    t.fit(Net(), loader())
    assert t.log_dir == f"{tmp_path}/lightning_logs/version_0"
    mine = CSVLogger(str(tmp_path / "mine"))
    assert trainer(tmp_path, logger=True, callbacks=[mine]).loggers == [mine]  # one there already
    assert trainer(tmp_path, logger=False).loggers == []
    with pytest.raises(ValueError, match="logger=False, but a CSVLogger is in callbacks"):
        trainer(tmp_path, logger=False, callbacks=[mine])


@pytest.mark.parametrize("value,fragment", [
    ("tensorboard", "got str"), (3, "got int"), (EarlyStopping(monitor="loss"), "EarlyStopping is a Callback that logs "
                                                                                "nothing"),
    ([CSVLogger("x"), 3], "item 1 int is not a Callback"), ({"csv": CSVLogger("x")}, "got dict"),
])
def test_a_bad_logger_is_refused_naming_it(value, fragment):
    with pytest.raises(TypeError) as err:
        Trainer(logger=value)
    message = str(err.value)
    assert message.startswith("Trainer(logger=") and fragment in message, message


def test_hparams_reach_a_logger_given_as_logger(tmp_path):
    class Params(CSVLogger):
        got = None

        def on_hyperparameters(self, trainer, params):
            Params.got = json.loads(json.dumps(params))

    class WithHparams(Net):
        def __init__(self, hidden=3):
            super().__init__()
            self.save_hyperparameters()

    trainer(tmp_path, max_steps=1, logger=Params(str(tmp_path / "p"))).fit(WithHparams(), loader())
    assert Params.got == {"hidden": 3}
