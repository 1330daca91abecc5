"""TrainerCLI, the config-file command line: a script run as Lightning users run theirs (`python train.py fit
--trainer.max_epochs 2 --model.lr 0.01`, `--config`, `--print_config`, class paths), and in-process builds."""

import json
import sys
from typing import Optional
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import ROOT, WORKERS, free_port, run_command
from fabric_lite import Callback, DataModule, TrainModule
from fabric_lite.callbacks import EarlyStopping

pytest.importorskip("jsonargparse")

from fabric_lite.cli.trainer_cli import SEED_VARIABLE  # noqa: E402
from fabric_lite.cli import (  # noqa: E402
    LightningCLI, LRSchedulerCallable, OptimizerCallable, SaveConfigCallback, TrainerCLI)

SCRIPT = WORKERS / "trainer_cli_script.py"

@pytest.fixture(autouse=True)
def _no_inherited_seed(monkeypatch):
    """A CLI that draws a random seed hands it down in the environment: none leaks from one test to the next."""
    monkeypatch.setenv(SEED_VARIABLE, "")


QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


class Script:
    """The worker script, with its own results folder and working directory."""

    def __init__(self, folder: Path):
        self.folder = folder
        (folder / "results").mkdir()

    def env(self):
        return {"RESULT_DIR": str(self.folder / "results"), "PYTHONPATH": str(ROOT)}


@pytest.fixture
def script(tmp_path):
    return Script(tmp_path)


def run_script(script, *args, timeout=120):
    return run_command([sys.executable, str(SCRIPT), *map(str, args)], timeout=timeout, env=script.env(),
                       cwd=script.folder)


def result(script, name):
    return json.loads((script.folder / "results" / f"{name}.json").read_text())


def test_fit_with_dotted_overrides_saves_a_config_that_reruns_the_same_run(script, tmp_path):
    """`fit --trainer.max_epochs 2 --model.lr 0.01 --data.batch_size 16`: the values reach the classes; the
    config saved in the log dir (with the random seed it drew) trains the same weights again."""
    first = run_script(script, "fit", "--trainer.max_epochs", 2, "--model.lr", 0.01, "--data.batch_size", 16,
                       "--trainer.default_root_dir", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    a = result(script, "fit_rank0")
    assert (a["max_epochs"], a["lr"], a["batch_size"], a["hidden"]) == (2, 0.01, 16, 8)
    assert a["global_step"] == 2 * 64 // 16 and a["optimizer"] == "SGD"
    saved = yaml.safe_load((Path(a["log_dir"]) / "config.yaml").read_text())
    assert saved["model"] == {"hidden": 8, "lr": 0.01} and saved["data"] == {"batch_size": 16, "n": 64}
    assert saved["trainer"]["max_epochs"] == 2 and saved["ckpt_path"] is None
    assert isinstance(saved["seed_everything"], int) and not isinstance(saved["seed_everything"], bool)

    again = run_script(script, "fit", "--config", Path(a["log_dir"]) / "config.yaml",
                       "--trainer.default_root_dir", tmp_path / "b")
    assert again.returncode == 0, again.stderr
    b = result(script, "fit_rank0")
    assert b["log_dir"] != a["log_dir"] and b["global_step"] == a["global_step"]
    assert b["weights"] == a["weights"]  # same seed, same data, same steps: bit for bit


def test_config_files_merge_in_order_and_print_config_exits_0(script, tmp_path):
    (tmp_path / "a.yaml").write_text("trainer:\n  max_epochs: 7\n  callbacks:\n    - class_path: EarlyStopping\n"
                                     "      init_args: {monitor: val_loss, patience: 2}\nmodel:\n  lr: 0.5\n  hidden: 3\n")
    (tmp_path / "b.yaml").write_text("model:\n  hidden: 4\ndata:\n  batch_size: 32\n")
    proc = run_script(script, "fit", "--config", tmp_path / "a.yaml", "--config", tmp_path / "b.yaml",
                      "--model.lr", 0.2, "--trainer.default_root_dir", tmp_path / "never", "--print_config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["model"] == {"hidden": 4, "lr": 0.2}  # b.yaml over a.yaml, the command line over both
    assert printed["trainer"]["max_epochs"] == 7 and printed["data"]["batch_size"] == 32
    (stopper,) = printed["trainer"]["callbacks"]  # a short class name in a file resolves as on the command line
    assert stopper["class_path"].endswith(".EarlyStopping") and stopper["init_args"]["patience"] == 2
    assert printed["trainer"]["enable_progress_bar"] is False  # trainer_defaults
    assert printed["seed_everything"] is True and "optimizer" in printed and "lr_scheduler" in printed
    assert not (tmp_path / "never").exists()  # printed, nothing built or trained


def test_callback_optimizer_and_scheduler_class_paths(script, tmp_path):
    """`--trainer.callbacks+=EarlyStopping --trainer.callbacks.monitor ...`, `--optimizer Adam --optimizer.lr`,
    `--lr_scheduler StepLR ...`: the module's configure_optimizers is replaced by them."""
    proc = run_script(script, "fit", "--trainer.max_epochs", 2, "--trainer.default_root_dir", tmp_path / "r",
                      "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "val_loss",
                      "--trainer.callbacks.patience", 5, "--optimizer", "Adam", "--optimizer.lr", 0.01,
                      "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", 1, "--lr_scheduler.gamma", 0.5)
    assert proc.returncode == 0, proc.stderr
    assert "configure_optimizers is replaced" in proc.stderr
    r = result(script, "fit_rank0")
    assert ["EarlyStopping", "val_loss", 5] in r["callbacks"]
    assert "SaveConfigCallback" in [c[0] for c in r["callbacks"]]
    assert r["optimizer"] == "Adam" and r["schedulers"] == ["StepLR"]
    assert r["optimizer_lr"] == pytest.approx(0.01 * 0.5 ** 2)  # stepped once per epoch, two epochs
    saved = yaml.safe_load((Path(r["log_dir"]) / "config.yaml").read_text())
    assert saved["optimizer"]["class_path"] == "torch.optim.Adam" and saved["optimizer"]["init_args"]["lr"] == 0.01
    assert saved["trainer"]["callbacks"][0]["class_path"].endswith("EarlyStopping")


def test_fit_ckpt_path_resumes_and_test_runs_the_test_loop(script, tmp_path):
    first = run_script(script, "fit", "--trainer.max_epochs", 1, "--trainer.default_root_dir", tmp_path / "a",
                       "--seed_everything", 3)
    assert first.returncode == 0, first.stderr
    ckpt = next((tmp_path / "a" / "checkpoints").glob("epoch=0-*"))
    resumed = run_script(script, "fit", "--trainer.max_epochs", 2, "--trainer.default_root_dir", tmp_path / "b",
                         "--ckpt_path", ckpt)
    assert resumed.returncode == 0, resumed.stderr
    r = result(script, "fit_rank0")
    assert (r["start_step"], r["global_step"]) == (8, 16)

    # `test --ckpt_path PATH`: the test loop on the resumed run's last weights, in a new process
    last = next((tmp_path / "b" / "checkpoints").glob("epoch=1-*"))
    tested = run_script(script, "test", "--trainer.default_root_dir", tmp_path / "c", "--ckpt_path", last)
    assert tested.returncode == 0, tested.stderr
    t = result(script, "test_rank0")
    assert t["weights"] == r["weights"] and t["global_step"] == 0
    module = nn.Module()
    module.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    module.load_state_dict(torch.load(last / "model_0.pt", weights_only=True))
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    expected = nn.functional.mse_loss(module.net(x), x.sum(1, keepdim=True)).item()  # one batch: the whole set
    assert t["metrics"]["test_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("args, names", [
    (["fit", "--trainer.max_epochs", "abc"], ["--trainer.max_epochs", "'abc'", "int"]),
    (["fit", "--trainer.max_epoch", "3"], ["--trainer.max_epoch", "did you mean --trainer.max_epochs"]),
    (["fit", "--model.hidden", "wide"], ["--model.hidden", "'wide'", "int"]),
    (["fit", "--data.batch_size", "1.5"], ["--data.batch_size", "'1.5'"]),
    (["fit", "--trainer.callbacks+=NoSuchCallback"], ["--trainer.callbacks", "'NoSuchCallback'"]),
    (["fit", "--optimizer.lr", "0.1"], ["--optimizer.lr", "without a class"]),
    (["fit", "--optimizer", "Adam", "--optimizer.lrr", "0.1"], ["--optimizer.lrr", "Adam has no argument 'lrr'"]),
    (["fit", "--trainer.devices", "0"], ["--trainer.devices", "Trainer(devices=0)"]),
    (["fit", "--config", "missing.yaml"], ["--config", "missing.yaml"]),
    (["launch"], ["subcommand", "fit"]),
])
def test_bad_values_exit_2_with_one_line_naming_the_option(args, names, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        TrainerCLI(Regressor, Data, args=args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("run", [True, False])
def test_an_unknown_key_in_a_config_file_exits_2_naming_it(run, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("trainer:\n  max_epoch: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        TrainerCLI(Regressor, Data, run=run, args=["fit"] * run + ["--config", str(tmp_path / "bad.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trainer.max_epoch " in err and "did you mean --trainer.max_epochs" in err


def test_a_missing_required_argument_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        TrainerCLI(NeedsWidth, Data, args=["fit"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model.width is required") and len(err.splitlines()) == 1, err


def test_a_bad_value_in_a_real_process_exits_2(script):
    proc = run_script(script, "fit", "--trainer.max_epochs", "many")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--trainer.max_epochs" in proc.stderr


# -- in-process ------------------------------------------------------------------------------------------
class Regressor(TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        self.predicted = batch_idx + 1
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class WideRegressor(Regressor):
    """A second module class, chosen by class path (subclass mode)."""

    def __init__(self, hidden: int = 16, lr: float = 0.1, depth: int = 2):
        super().__init__(hidden, lr)
        self.depth = depth


class NeedsWidth(Regressor):
    def __init__(self, width: int):
        super().__init__(width)


class Data(DataModule):
    def __init__(self, batch_size: int = 8, n: int = 32):
        super().__init__()
        self.batch_size = batch_size
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.dataset = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)


def test_run_false_builds_model_datamodule_trainer_and_config(tmp_path):
    cli = LightningCLI(Regressor, Data, seed_everything_default=1234, run=False,
                       args=["--trainer.max_epochs", "3", "--model.lr", "0.05", "--data.batch_size", "4",
                             "--trainer.default_root_dir", str(tmp_path)])
    assert LightningCLI is TrainerCLI
    assert isinstance(cli.model, Regressor) and cli.model.lr == 0.05
    assert isinstance(cli.datamodule, Data) and cli.datamodule.batch_size == 4
    assert cli.trainer.max_epochs == 3 and cli.trainer.global_step == 0  # built, not run
    assert cli.config.model.lr == 0.05 and cli.config.seed_everything == 1234 and cli.subcommand is None
    assert any(isinstance(c, SaveConfigCallback) for c in cli.trainer.callbacks)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # the way Lightning's examples go on
    assert cli.trainer.global_step == 3 * 32 // 4
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["batch_size"] == 4


def test_hooks_links_and_subclass_mode(tmp_path):
    calls = []

    class MyCLI(TrainerCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_argument("--note", default="none")
            parser.link_arguments("data.batch_size", "model.init_args.depth")

        def before_instantiate_classes(self):
            calls.append(("before_instantiate", self.config.fit.note))

        def before_fit(self):
            calls.append(("before_fit", self.trainer.global_step))

        def after_fit(self):
            calls.append(("after_fit", self.trainer.global_step))

    cli = MyCLI(None, Data, args=["fit", "--model", "test_trainer_cli.WideRegressor", "--model.lr", "0.3",
                                  "--data.batch_size", "16", "--note", "hi", "--trainer.max_epochs", "1",
                                  "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert type(cli.model).__name__ == "WideRegressor" and cli.model.lr == 0.3 and cli.model.depth == 16
    assert calls == [("before_instantiate", "hi"), ("before_fit", 0), ("after_fit", 2)]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "test_trainer_cli.WideRegressor" and saved["note"] == "hi"


def test_subclass_mode_model_takes_a_subclass_by_its_short_name(tmp_path):
    cli = TrainerCLI(Regressor, Data, subclass_mode_model=True, run=False,
                     args=["--model", "WideRegressor", "--model.depth", "3", "--trainer.default_root_dir", str(tmp_path)])
    assert type(cli.model) is WideRegressor and cli.model.depth == 3 and cli.model.hparams["hidden"] == 16
    assert cli.config.model.class_path == "test_trainer_cli.WideRegressor"


class WithOwnLoaders(Regressor):
    """Lightning's basic docs: the module defines its own dataloaders; the CLI is given no datamodule."""

    def __init__(self, hidden: int = 8, lr: float = 0.1, batch_size: int = 4):
        super().__init__(hidden, lr)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(Data().dataset, batch_size=self.batch_size)


def test_a_module_with_its_own_dataloaders_needs_no_datamodule(tmp_path):
    cli = TrainerCLI(WithOwnLoaders, args=["fit", "--model.batch_size", "16", "--trainer.max_epochs", "2",
                                           "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert cli.datamodule is None and cli.trainer.global_step == 2 * 32 // 16
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"] is None


def test_reduce_lr_on_plateau_follows_its_monitor(tmp_path):
    with pytest.warns(UserWarning, match="Regressor.configure_optimizers is replaced"):
        cli = TrainerCLI(Regressor, Data, run=False, save_config_callback=None,
                         args=["--optimizer", "SGD", "--optimizer.lr", "0.2", "--lr_scheduler", "ReduceLROnPlateau",
                               "--lr_scheduler.monitor", "val_loss", "--lr_scheduler.patience", "0",
                               "--lr_scheduler.factor", "0.5", "--trainer.default_root_dir", str(tmp_path)])
    returned = cli.model.configure_optimizers()
    assert returned["lr_scheduler"]["monitor"] == "val_loss"
    assert type(returned["optimizer"]).__name__ == "SGD" and returned["optimizer"].param_groups[0]["lr"] == 0.2
    assert not any(isinstance(c, SaveConfigCallback) for c in cli.trainer.callbacks)


def test_save_config_refuses_to_overwrite_unless_asked(tmp_path):
    args = ["fit", "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path), *QUIET]
    TrainerCLI(Regressor, Data, args=args)
    (tmp_path / "config.yaml").write_text("first run\n")
    with pytest.raises(RuntimeError, match="config.yaml exists already"):
        TrainerCLI(Regressor, Data, args=args)
    assert (tmp_path / "config.yaml").read_text() == "first run\n"
    TrainerCLI(Regressor, Data, args=args, save_config_kwargs={"overwrite": True})
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_epochs"] == 1


def test_validate_and_predict_subcommands_run_the_built_module(tmp_path):
    args = ["--seed_everything", "5", "--model.hidden", "3", "--trainer.default_root_dir", str(tmp_path), *QUIET]
    cli = TrainerCLI(Regressor, Data, args=["validate", *args])
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    expected = nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)).item()  # four equal batches: their mean
    assert cli.subcommand == "validate" and cli.trainer.global_step == 0
    assert float(cli.trainer.callback_metrics["val_loss"]) == pytest.approx(expected, rel=1e-5)

    # (a run of its own: each writes its config.yaml where its logs go, and refuses to overwrite another run's)
    args[args.index(str(tmp_path))] = str(tmp_path / "predict")
    cli = TrainerCLI(Regressor, Data, args=["predict", *args])
    assert cli.model.predicted == 32 // 8


def test_default_config_files_per_subcommand(tmp_path, capsys):
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("trainer:\n  max_epochs: 9\nmodel:\n  lr: 0.25\n")
    with pytest.raises(SystemExit) as exit_info:
        TrainerCLI(Regressor, Data, parser_kwargs={"fit": {"default_config_files": [str(defaults)]}},
                   args=["fit", "--model.lr", "0.5", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_epochs"] == 9 and printed["model"]["lr"] == 0.5


class Injected(Regressor):
    """Lightning's dependency-injection pattern: the module takes a function that builds its optimizer."""

    def __init__(self, optimizer: OptimizerCallable = torch.optim.SGD, scheduler: Optional[LRSchedulerCallable] = None):
        super().__init__()
        self.optimizer, self.scheduler = optimizer, scheduler

    def configure_optimizers(self):
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        return [optimizer], [self.scheduler(optimizer)]


def test_optimizer_and_scheduler_given_to_the_module_as_callables(tmp_path):
    cli = TrainerCLI(Injected, Data, run=False, args=[
        "--model.optimizer", "Adam", "--model.optimizer.lr", "0.03", "--model.scheduler", "StepLR",
        "--model.scheduler.step_size", "4", "--trainer.default_root_dir", str(tmp_path)])
    (optimizer,), (scheduler,) = cli.model.configure_optimizers()
    assert type(optimizer).__name__ == "Adam" and optimizer.param_groups[0]["lr"] == 0.03
    assert type(scheduler).__name__ == "StepLR" and scheduler.step_size == 4
    saved = cli.parser.dump(cli.config)
    assert "torch.optim.Adam" in saved and "step_size: 4" in saved


def test_options_from_environment_variables_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRIC_LITE_TRAINER__MAX_EPOCHS", "6")
    monkeypatch.setenv("FABRIC_LITE_MODEL__LR", "0.125")
    cli = TrainerCLI(Regressor, Data, run=False, parser_kwargs={"default_env": True},
                     args=["--model.lr", "0.5", "--trainer.default_root_dir", str(tmp_path)])
    assert cli.trainer.max_epochs == 6 and cli.model.lr == 0.5  # the command line over the environment
    cli = TrainerCLI(Regressor, Data, run=False, args=["--trainer.default_root_dir", str(tmp_path)])
    assert cli.trainer.max_epochs != 6  # off by default


class Backbone(nn.Module):
    def __init__(self, hidden_dim: int = 128):
        super().__init__()
        self.l1 = nn.Linear(4, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class WithBackbone(Regressor):
    """The shape of Lightning's backbone image classifier example: a sub-network passed to the module."""

    def __init__(self, backbone: Optional[Backbone] = None, learning_rate: float = 0.0001):
        super().__init__(lr=learning_rate)
        self.net = backbone if backbone is not None else Backbone()


class CountEpochs(Callback):
    def __init__(self):
        self.epochs = 0

    def on_train_epoch_end(self, trainer, module):
        self.epochs += 1


def test_the_lightning_example_shape_run_false_with_trainer_defaults_and_a_sub_network(tmp_path):
    counter = CountEpochs()
    cli = LightningCLI(WithBackbone, Data, seed_everything_default=1234, run=False,
                       trainer_defaults={"callbacks": counter, "max_epochs": 2, "enable_progress_bar": False},
                       save_config_kwargs={"overwrite": True},
                       args=["--model.backbone", "Backbone", "--model.backbone.hidden_dim", "16",
                             "--model.learning_rate", "0.01", "--trainer.default_root_dir", str(tmp_path)])
    assert cli.model.net.l1.out_features == 16 and cli.model.lr == 0.01
    assert counter in cli.trainer.callbacks and cli.trainer.max_epochs == 2
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert counter.epochs == 2
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # a second fit: the config is written once
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["backbone"] == {"class_path": "test_trainer_cli.Backbone", "init_args": {"hidden_dim": 16}}
    assert saved["seed_everything"] == 1234 and saved["trainer"]["max_epochs"] == 2


def test_a_callback_group_is_always_added_with_its_own_options(tmp_path):
    class WithEarlyStopping(TrainerCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(EarlyStopping, "early_stopping")

    cli = WithEarlyStopping(Regressor, Data, run=False, args=["--early_stopping.monitor", "val_loss",
                                                              "--early_stopping.patience", "7",
                                                              "--trainer.default_root_dir", str(tmp_path)])
    stoppers = [c for c in cli.trainer.callbacks if isinstance(c, EarlyStopping)]
    assert [(s.monitor, s.patience) for s in stoppers] == [("val_loss", 7)]
    assert cli.config.early_stopping.monitor == "val_loss"


def test_the_guide_page_script_runs_its_command_lines(tmp_path):
    """docs/guides/trainer-cli.md: its python blocks are train.py; its command lines run as written (one epoch)."""
    from test_docs import python_blocks

    page = ROOT / "docs" / "guides" / "trainer-cli.md"
    (tmp_path / "train.py").write_text("\n\n".join(python_blocks(page)))
    text = page.read_text()
    env = {"PYTHONPATH": str(ROOT)}
    for line in ["python train.py fit --trainer.max_epochs 2 --model.lr 0.01 --data.batch_size 64",
                 "python train.py fit --print_config > base.yaml"]:
        assert line in text
        command, _, target = line.partition(" > ")
        proc = run_command([sys.executable, *command.split()[1:], *QUIET], env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "config.yaml").is_file() and yaml.safe_load(proc.stdout)["model"] == {"hidden": 16, "lr": 0.05}


def test_lightning_names_of_the_cli_module():
    """Every name of Lightning's `lightning.pytorch.cli` a script imports, under fabric_lite.cli."""
    import typing

    import fabric_lite.cli as cli

    assert cli.LightningCLI is cli.TrainerCLI and cli.LightningArgumentParser is cli.TrainerArgumentParser
    assert issubclass(cli.ReduceLROnPlateau, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert cli.LRSchedulerTypeTuple == (torch.optim.lr_scheduler.LRScheduler, cli.ReduceLROnPlateau)
    assert set(typing.get_args(cli.LRSchedulerTypeUnion)) == set(cli.LRSchedulerTypeTuple)
    assert {typing.get_args(t)[0] for t in typing.get_args(cli.LRSchedulerType)} == set(cli.LRSchedulerTypeTuple)
    adam = cli.instantiate_class(torch.nn.Linear(2, 1).parameters(),
                                 {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.5}})
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["lr"] == 0.5
    assert typing.get_args(cli.ArgsType) and cli.SaveConfigCallback.__name__ == "SaveConfigCallback"


def test_import_is_light_and_without_jsonargparse_says_what_to_install(monkeypatch):
    proc = run_command([sys.executable, "-c", "import sys, fabric_lite.cli; "
                        "print(sorted(m for m in ('jsonargparse', 'fabric_lite.trainer.trainer', "
                        "'fabric_lite.cli.trainer_cli') if m in sys.modules))"])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "fabric_lite.cli.trainer_parser", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fabric-lite\[cli\]'"):
        TrainerCLI(Regressor, Data, args=["fit"])


@pytest.mark.slow
def test_devices_2_relaunches_under_torchrun_with_the_command_line(script, tmp_path):
    """`--trainer.devices 2` from a plain `python train.py fit ...`: the Trainer starts the script again on two
    processes, each parses the same command line (and the same random seed) and trains."""
    proc = run_script(script, "fit", "--trainer.devices", 2, "--trainer.accelerator", "cpu",
                      "--trainer.max_epochs", 1, "--model.lr", 0.02, "--trainer.default_root_dir", tmp_path / "ddp",
                      timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [result(script, f"fit_rank{r}") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["lr"] for r in ranks] == [0.02, 0.02]
    assert ranks[0]["global_step"] == 64 // (8 * 2)  # each step: one batch per rank
    assert ranks[0]["weights"] == ranks[1]["weights"]
    saved = yaml.safe_load((Path(ranks[0]["log_dir"]) / "config.yaml").read_text())
    assert saved["trainer"]["devices"] == 2 and isinstance(saved["seed_everything"], int)
    assert ranks[0]["seed"] == ranks[1]["seed"] == saved["seed_everything"]  # drawn once, in the first process
    assert ranks[0]["argv"] == ranks[1]["argv"] == [str(a) for a in proc.args[2:]]


@pytest.mark.slow
def test_under_torchrun_every_rank_draws_the_same_random_seed(script, tmp_path):
    """Started by torchrun, each rank parses the command line on its own; `--seed_everything true` gives them one
    seed all the same (ranks seeding differently would draw different shuffles of one dataset)."""
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), "fit", "--trainer.max_epochs",
                        "1", "--trainer.default_root_dir", str(tmp_path / "tr")], env=script.env(), cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [result(script, f"fit_rank{r}") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["seed"] == ranks[1]["seed"]
