"""The table of Lightning's public names in docs/migration/lightning.md, kept honest: it lists exactly the names of
tests/trainer/lightning_reference_names.txt, each row's counterpart is where the table says, a `works` row names a
test that exists, a `refused` row raises NotSupportedError naming its feature when used, and a `later` row names
its issue. Also Lightning's other spellings the Trainer, TrainModule and DataModule answer to (no training here)."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import ROOT, import_dotted
from fabric_lite import Callback, DataModule, Trainer, TrainModule
from fabric_lite.callbacks import EarlyStopping, ModelCheckpoint
from fabric_lite.trainer.data_connector import STAGE_LOADERS
from fabric_lite.trainer.lightning_surface import REFUSED_TRAINER_ARGUMENTS, REFUSED_TRAINER_MEMBERS, fixed_property
from fabric_lite.utils import NotSupportedError

NAMES_FILE = ROOT / "tests" / "trainer" / "lightning_reference_names.txt"
PAGE = ROOT / "docs" / "migration" / "lightning.md"
SECTION = "## Lightning's public names, one by one"
ROW = re.compile(r"^\| `(?P<name>lightning\.pytorch[^`]*)` \| (?P<status>[^|]+?) \| (?P<path>[^|]+?) \| "
                 r"(?P<evidence>[^|]*?) \|$")
ARGUMENT = re.compile(r"fabric_lite\.Trainer\((\w+)=\)")
MEMBER = re.compile(r"fabric_lite\.(Trainer|TrainModule|DataModule|Callback)\.(\w+)")


def reference_names():
    names = [line.strip() for line in NAMES_FILE.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith(("#", "["))]
    assert len(names) == len(set(names)), "a name is listed twice in lightning_reference_names.txt"
    return names


def table_rows():
    text = PAGE.read_text(encoding="utf-8")
    assert SECTION in text, f"{PAGE} lost its section {SECTION!r}"
    rows = []
    for line in text.split(SECTION, 1)[1].splitlines():
        if line.startswith("## "):
            break
        match = ROW.match(line.strip())
        if match:
            rows.append({k: v.strip() for k, v in match.groupdict().items()})
    return rows


ROWS = table_rows()
#: Lightning's data hooks that the Trainer calls where a module defines them (TrainModule has no default of its own)
MODULE_DATA_HOOKS = {name for names in STAGE_LOADERS.values() for name in names} | {"prepare_data", "setup", "teardown"}
OWNERS = {"Trainer": Trainer, "TrainModule": TrainModule, "DataModule": DataModule, "Callback": Callback}


def new_trainer(**kwargs):
    for name in ("enable_progress_bar", "enable_checkpointing", "enable_model_summary"):
        kwargs.setdefault(name, False)
    return Trainer(accelerator="cpu", **kwargs)


def instance(owner):
    return new_trainer() if owner == "Trainer" else OWNERS[owner]()


def resolve(path):
    """Where a row's counterpart is: a Trainer argument, a member of Trainer/TrainModule/DataModule/Callback (on
    the class or on a fresh instance), or a dotted import path."""
    if match := ARGUMENT.fullmatch(path):
        name = match.group(1)
        assert name in inspect.signature(Trainer.__init__).parameters or name in REFUSED_TRAINER_ARGUMENTS, path
        return None
    if match := MEMBER.fullmatch(path):
        owner, name = match.groups()
        cls = OWNERS[owner]
        if owner == "TrainModule" and name in MODULE_DATA_HOOKS:
            return None
        if name in dir(cls) or (owner == "Trainer" and name in REFUSED_TRAINER_MEMBERS):
            return inspect.getattr_static(cls, name, None)
        assert name in vars(instance(owner)), f"{path}: neither {owner} nor a new {owner} has {name!r}"
        return None
    return import_dotted(path)


# -- the table ---------------------------------------------------------------------------------------------

def test_the_table_lists_exactly_the_reference_names():
    listed = [row["name"] for row in ROWS]
    assert len(listed) == len(set(listed)), sorted({n for n in listed if listed.count(n) > 1})
    expected = reference_names()
    assert set(listed) == set(expected), (f"missing from the table: {sorted(set(expected) - set(listed))}; "
                                         f"not Lightning's: {sorted(set(listed) - set(expected))}")


def test_every_status_is_works_refused_or_later_with_its_issue_and_reason():
    for row in ROWS:
        if row["status"].startswith("later"):
            assert re.fullmatch(r"later: issue [\w-]+", row["status"]), row
            assert row["evidence"], f"{row['name']}: a later row says why"
        else:
            assert row["status"] in ("works", "refused"), row


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] in ("works", "refused")], ids=lambda r: r["name"])
def test_each_row_is_where_the_table_says(row):
    resolve(row["path"].strip("`"))


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"].startswith("later")], ids=lambda r: r["name"])
def test_later_rows_are_not_there_yet(row):
    """A name that arrived is a works row with its test (or a refused one): the table follows the code."""
    with pytest.raises((AttributeError, ImportError, AssertionError)):
        resolve(row["path"].strip("`"))


def test_works_rows_name_tests_that_exist():
    cache = {}
    for row in ROWS:
        if row["status"] != "works":
            continue
        match = re.fullmatch(r"`(tests/[\w/]+\.py)::(\w+)`", row["evidence"])
        assert match, f"{row['name']}: a works row names its test as `tests/...py::test_name`, got {row['evidence']!r}"
        file, name = match.groups()
        if file not in cache:
            source = (ROOT / file).read_text(encoding="utf-8")
            cache[file] = {node.name for node in ast.walk(ast.parse(source))
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in cache[file], f"{row['name']}: {file} has no test {name}"


def use(path):
    """Use a refused counterpart as a Lightning script would: pass the argument, read the member or call it, set
    the setting to Lightning's other value, build the class."""
    if match := ARGUMENT.fullmatch(path):
        name = match.group(1)
        default = REFUSED_TRAINER_ARGUMENTS[name][0]
        new_trainer(**{name: (not default) if isinstance(default, bool) else object()})
    elif match := MEMBER.fullmatch(path):
        owner, name = match.groups()
        obj = instance(owner)
        member = inspect.getattr_static(OWNERS[owner], name, None)
        if isinstance(member, fixed_property):
            setattr(obj, name, not member.value)
        elif owner == "Trainer":
            getattr(obj, name)
        else:
            getattr(obj, name)()
    else:
        resolve(path)()


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] == "refused"], ids=lambda r: r["name"])
def test_refused_rows_raise_naming_the_feature(row):
    feature = re.fullmatch(r"names: (.+)", row["evidence"])
    assert feature, f"{row['name']}: a refused row says which words its error names ('names: ...')"
    with pytest.raises(NotSupportedError) as err:
        use(row["path"].strip("`"))
    message = str(err.value)
    assert isinstance(err.value, NotImplementedError)
    assert feature.group(1) in message and "not supported by fabric_lite; " in message, message


def test_the_counts_the_page_states_are_the_tables():
    text = PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1]
    said = re.search(r"(\d+) names,\s+(\d+) that work,\s+(\d+) refused,\s+(\d+) later\.", text)
    assert said, "the section says how many names work, are refused and come later"
    counts = [len(ROWS), *(sum(r["status"].startswith(s) for r in ROWS) for s in ("works", "refused", "later"))]
    assert [int(n) for n in said.groups()] == counts


# -- Lightning's other spellings ---------------------------------------------------------------------------

class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)

    def forward(self, x):
        return self.head(self.body(x))


def attached(**kwargs):
    trainer, module = new_trainer(**kwargs), Net()
    module.trainer = trainer
    trainer.module = module
    return trainer, module


def test_trainer_members_under_lightnings_names(capsys):
    stop, best, last = EarlyStopping(monitor="loss"), ModelCheckpoint(monitor="loss"), ModelCheckpoint()
    trainer, module = attached(callbacks=[stop, best, last], precision="bf16-mixed", enable_checkpointing=True,
                               limit_train_batches=5, limit_val_batches=0.5)
    assert trainer.lightning_module is module
    assert trainer.accelerator.device == trainer.device  # (fabric_lite's Accelerator, the raw door under the Trainer)
    assert trainer.precision == "bf16-mixed" and trainer.precision_plugin is trainer.strategy.precision
    assert trainer.scaler is None  # (loss scaling is for "16-mixed" only)
    assert trainer.early_stopping_callback is stop and trainer.early_stopping_callbacks == [stop]
    assert trainer.checkpoint_callback is best and trainer.checkpoint_callbacks == [best, last]
    assert trainer.progress_bar_callback is None
    assert trainer.train_dataloader is None and trainer.val_dataloaders is None  # (until fit sets them)
    assert (trainer.limit_train_batches, trainer.limit_val_batches) == (5, 0.5)
    assert (trainer.limit_test_batches, trainer.limit_predict_batches) == (None, None)
    assert new_trainer(precision="16-mixed").precision == "16-mixed"
    shown = Trainer(accelerator="cpu", enable_checkpointing=False, enable_model_summary=False)
    assert type(shown.progress_bar_callback).__name__ == "ProgressBar"
    trainer.print("only on the first process", 3)
    assert capsys.readouterr().out == "only on the first process 3\n"
    with trainer.init_module():
        layer = nn.Linear(2, 2)
    assert layer.weight.device == trainer.device


def test_a_refused_member_reads_as_absent_to_hasattr_and_introspection():
    trainer, module = attached()
    assert not hasattr(trainer, "fit_loop")
    assert getattr(trainer, "state", "absent") == "absent"
    with pytest.raises(NotSupportedError, match="Trainer.fit_loop: Lightning's loop objects"):
        trainer.fit_loop  # noqa: B018
    traced = torch.jit.trace(module, torch.ones(2, 3))  # (torch.jit reads every attribute it finds)
    assert traced(torch.ones(1, 3)).shape == (1, 1)
    assert module.fabric is None and module.strict_loading is True  # Lightning's values without Fabric


def test_num_nodes_is_the_launchs_and_another_count_is_refused():
    assert new_trainer(num_nodes=1).num_nodes == 1
    with pytest.raises(ValueError, match=r"num_nodes=2 disagrees with the launch environment.*--nnodes 2"):
        new_trainer(num_nodes=2)


def test_a_member_the_trainer_assigns_itself_replaces_the_lightning_spelling():
    trainer = new_trainer(limit_train_batches=3)
    trainer.limit_train_batches = 7  # an attribute of the Trainer's own wins over the spelling's property
    assert trainer.limit_train_batches == 7
    with pytest.raises(AttributeError, match="no attribute 'not_a_member'"):
        trainer.not_a_member  # noqa: B018 (a name nobody refuses is an ordinary AttributeError)


def test_module_members_under_lightnings_names(capsys):
    module = Net()
    assert (module.global_rank, module.local_rank, module.logger, module.loggers) == (0, 0, None, [])
    assert module.on_gpu is False and module.dtype == torch.float32
    assert module.to(torch.float64).dtype == torch.float64
    trainer, module = attached()
    assert (module.global_rank, module.local_rank, module.logger, module.loggers) == (0, 0, None, [])
    module.print("main process", end="!")
    assert capsys.readouterr().out == "main process!"
    module.freeze()
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    module.unfreeze()
    assert module.training and all(p.requires_grad for p in module.parameters())
    gathered = module.all_gather({"x": torch.tensor([1.0, 2.0]), "n": [torch.tensor(3)]})
    assert torch.equal(gathered["x"], torch.tensor([1.0, 2.0])) and int(gathered["n"][0]) == 3  # one process
    with pytest.raises(NotSupportedError, match="process subgroup"):
        module.all_gather(torch.ones(1), sync_grads=True)


def test_toggle_optimizer_leaves_gradients_to_that_optimizers_parameters_only():
    module = Net()
    module.head.bias.requires_grad = False  # the user's own choice is given back as it was
    first = torch.optim.SGD(module.body.parameters(), lr=0.1)
    second = torch.optim.SGD([module.head.weight], lr=0.1)
    module.toggle_optimizer(first)
    assert [p.requires_grad for p in module.parameters()] == [True, True, False, False]
    module.untoggle_optimizer(first)
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]
    with module.toggled_optimizer(second) as opt:
        assert opt is second
        assert [p.requires_grad for p in module.parameters()] == [False, False, True, False]
        module.head(module.body(torch.ones(4, 3))).sum().backward()
    assert module.body.weight.grad is None and module.head.weight.grad is not None
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]


def test_clip_gradients_by_norm_and_by_value_with_known_values():
    trainer, module = attached()
    optimizer = torch.optim.SGD(module.body.parameters(), lr=0.1)
    module.body.weight.grad = torch.full((2, 3), 3.0)
    module.body.bias.grad = torch.tensor([4.0, 0.0])
    module.head.weight.grad = torch.full((1, 2), 10.0)  # not the optimizer's: untouched
    module.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    assert torch.equal(module.body.weight.grad, torch.full((2, 3), 0.5))
    assert torch.equal(module.body.bias.grad, torch.tensor([0.5, 0.0]))
    module.body.weight.grad = torch.full((2, 3), 1.0)
    module.body.bias.grad = torch.tensor([1.0, 1.0])  # norm sqrt(8)
    module.clip_gradients(optimizer, gradient_clip_val=2.0 ** 0.5)  # by norm: halves every gradient
    assert torch.allclose(module.body.weight.grad, torch.full((2, 3), 0.5), atol=1e-6)
    assert torch.equal(module.head.weight.grad, torch.full((1, 2), 10.0))
    module.clip_gradients(optimizer)  # no value: nothing to do
    with pytest.raises(ValueError, match="'norm' or 'value'"):
        module.clip_gradients(optimizer, 1.0, "max")


def test_datamodule_members_under_lightnings_names():
    class Data(DataModule):
        def __init__(self, batch_size=4, root="data"):
            super().__init__()
            self.save_hyperparameters()

    data = Data(batch_size=8)
    assert data.hparams == {"batch_size": 8, "root": "data"} and data.hparams.batch_size == 8
    data.hparams.batch_size = 16
    assert data.hparams_initial == {"batch_size": 8, "root": "data"}  # (as save_hyperparameters recorded them)
    assert data.name is None and data.trainer is None and data.prepare_data_per_node is False
    data.prepare_data_per_node = False  # Lightning's other value is refused; this one is what happens here
    with pytest.raises(NotSupportedError, match="prepare_data on the first process of every machine"):
        data.prepare_data_per_node = True


def loader():
    return DataLoader(TensorDataset(torch.ones(4, 3), torch.ones(4, 1)), batch_size=2)


@pytest.mark.parametrize("hook", ["optimizer_step", "configure_gradient_clipping", "on_validation_model_zero_grad",
                                  "backward"])
def test_a_module_overriding_a_refused_hook_is_refused_before_anything_runs(hook, tmp_path):
    class Overrides(Net):
        def training_step(self, batch, batch_idx):
            return self.head(self.body(batch[0])).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    setattr(Overrides, hook, lambda self, *args, **kwargs: None)
    trainer = new_trainer(max_steps=1, default_root_dir=str(tmp_path))
    with pytest.raises(NotSupportedError, match=f"Overrides.{hook}: "):
        trainer.fit(Overrides(), loader())
    assert trainer.global_step == 0
    with pytest.raises(NotSupportedError, match=f"Overrides.{hook}: "):
        trainer.validate(Overrides(), loader())


def test_a_datamodules_own_state_goes_into_the_checkpoint_and_comes_back_on_resume(tmp_path):
    """Lightning's DataModule.state_dict/load_state_dict: saved with the fit's checkpoint under the class's name,
    handed back by fit(ckpt_path=...) before training goes on."""
    class Stateful(DataModule):
        def __init__(self):
            super().__init__()
            self.loaded = None
            self.served = 0

        def train_dataloader(self):
            self.served += 1
            return loader()

        def state_dict(self):
            return {"served": self.served}

        def load_state_dict(self, state_dict):
            self.loaded = dict(state_dict)

    class Trained(Net):
        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = new_trainer(max_steps=2, default_root_dir=str(tmp_path))
    first = Stateful()
    trainer.fit(Trained(), datamodule=first)
    path = str(tmp_path / "saved")
    trainer.save_checkpoint(path)
    again = Stateful()
    new_trainer(max_steps=3, default_root_dir=str(tmp_path)).fit(Trained(), datamodule=again, ckpt_path=path)
    assert again.loaded == {"served": first.served} and first.served >= 1
    assert DataModule().state_dict() == {}  # Lightning's default: nothing


def test_a_refused_trainer_argument_at_lightnings_default_is_accepted():
    new_trainer(enable_autolog_hparams=True)
    with pytest.raises(NotSupportedError, match=r"Trainer\(enable_autolog_hparams=False\)"):
        new_trainer(enable_autolog_hparams=False)
    with pytest.raises(TypeError, match="Unknown Trainer argument"):
        new_trainer(enable_autolog_hparam=True)


def test_the_trainer_keeps_lightnings_loop_arguments_under_their_names():
    trainer = new_trainer(min_epochs=2, min_steps=3, overfit_batches=2, reload_dataloaders_every_n_epochs=1)
    assert (trainer.min_epochs, trainer.min_steps, trainer.overfit_batches, trainer.reload_dataloaders_every_n_epochs,
            trainer.barebones) == (2, 3, 2, 1, False)
    assert new_trainer(barebones=True, num_sanity_val_steps=0, log_every_n_steps=None).barebones is True
    assert (new_trainer().min_epochs, new_trainer().min_steps, new_trainer().overfit_batches) == (None, None, 0)


class InjectedOptimizer(TrainModule):
    """A module that is given how to build its optimizer (the command line picks the class and its arguments)."""

    def __init__(self, hidden: int = 4, optimizer: "OptimizerCallable" = torch.optim.Adam):
        super().__init__()
        self.hidden, self.make_optimizer = hidden, optimizer


try:  # (the string hint above is resolved in this module's globals)
    from fabric_lite.cli import OptimizerCallable
except ImportError:  # pragma: no cover (jsonargparse not installed: the test below skips)
    OptimizerCallable = None


def test_lightning_cli_names_that_scripts_import():
    import typing

    cli = pytest.importorskip("fabric_lite.cli.trainer_cli")
    from fabric_lite.cli import ArgsType, LightningArgumentParser, LRSchedulerCallable, instantiate_class

    params = [nn.Parameter(torch.zeros(2))]
    optimizer = instantiate_class((params,), {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.25}})
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.25
    scheduler = instantiate_class(optimizer, {"class_path": "fabric_lite.cli.ReduceLROnPlateau",
                                              "init_args": {"monitor": "val_loss", "patience": 2}})
    assert isinstance(scheduler, cli.ReduceLROnPlateau) and scheduler.monitor == "val_loss"
    assert typing.List[str] in typing.get_args(ArgsType)
    assert typing.get_origin(OptimizerCallable) is typing.get_origin(LRSchedulerCallable)  # (Callable hints)

    parser = LightningArgumentParser()
    parser.add_lightning_class_args(InjectedOptimizer, "model")
    config = parser.parse_args(["--model.hidden", "8", "--model.optimizer", "torch.optim.SGD",
                                "--model.optimizer.lr", "0.5"])
    model = parser.instantiate_classes(config).model
    built = model.make_optimizer([nn.Parameter(torch.zeros(1))])
    assert model.hidden == 8 and isinstance(built, torch.optim.SGD) and built.param_groups[0]["lr"] == 0.5
