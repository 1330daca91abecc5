"""The table of Accelerate's documented names in docs/migration/accelerate.md, kept honest: it lists exactly the
names of Accelerate's package reference (tests/accelerator/accelerate_reference_names.txt), each row's name is
where the table says, a `works` row names a test that exists, a `refused` row raises NotSupportedError naming
the feature, and `later` members of N-D parallelism read as Accelerate's defaults where they exist."""

import ast
import re

import pytest
import torch
from torch import nn

from conftest import ROOT, import_dotted
from fabric_lite import Accelerator, PartialState
from fabric_lite.utils import NotSupportedError

NAMES_FILE = ROOT / "tests" / "accelerator" / "accelerate_reference_names.txt"
PAGE = ROOT / "docs" / "migration" / "accelerate.md"
SECTION = "## Accelerate's documented names, one by one"
ROW = re.compile(r"^\| `(?P<name>accelerate[^`]*)` \| (?P<status>[^|]+?) \| (?P<path>[^|]+?) \| "
                 r"(?P<evidence>[^|]*?) \|$")


def documented_names():
    names = [line.strip() for line in NAMES_FILE.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith(("#", "["))]
    assert len(names) == len(set(names)), "a name is listed twice in accelerate_reference_names.txt"
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


@pytest.fixture(autouse=True)
def _fresh_state():
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def resolve(path):
    """The object at a dotted fabric_lite path (`fabric_lite.Accelerator.<member>` is looked up on an instance)."""
    if path.startswith("fabric_lite.Accelerator."):
        member = path.rsplit(".", 1)[1]
        if hasattr(Accelerator, member):
            return getattr(Accelerator, member)
        return getattr(Accelerator(), member)
    return import_dotted(path)


def test_the_table_lists_exactly_the_documented_names():
    listed = [row["name"] for row in ROWS]
    assert len(listed) == len(set(listed)), sorted({n for n in listed if listed.count(n) > 1})
    expected = documented_names()
    assert set(listed) == set(expected), (f"missing from the table: {sorted(set(expected) - set(listed))}; "
                                         f"not documented by Accelerate: {sorted(set(listed) - set(expected))}")


def test_every_status_is_works_refused_or_later():
    for row in ROWS:
        assert row["status"] in ("works", "refused") or re.fullmatch(r"later: [\w -]+", row["status"]), row


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] in ("works", "refused")], ids=lambda r: r["name"])
def test_each_row_is_where_the_table_says(row):
    path = row["path"].strip("`")
    if path.startswith("fabric-lite "):
        from fabric_lite.cli.main import COMMANDS

        assert path.split()[1] in COMMANDS, path
        return
    resolve(path)  # an attribute may read None (a handler not given): being there is what is checked


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


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] == "refused"], ids=lambda r: r["name"])
def test_refused_rows_raise_naming_the_feature(row):
    feature = re.fullmatch(r"names: (.+)", row["evidence"])
    assert feature, f"{row['name']}: a refused row says which words its error names ('names: ...')"
    obj = resolve(row["path"].strip("`"))
    with pytest.raises(NotSupportedError) as err:
        if isinstance(obj, type):
            obj()
        elif isinstance(obj, property):  # an Accelerator member: raises when read, as Accelerate's does
            obj.fget(Accelerator())
        else:
            obj(nn.Linear(2, 2), {"": "cpu"})  # a model and a device map: what scripts pass most of these
    message = str(err.value)
    assert isinstance(err.value, NotImplementedError)
    assert feature.group(1) in message and "not supported by fabric_lite; " in message, message


def test_n_d_parallelism_members_read_as_accelerates_defaults_where_they_exist():
    acc = Accelerator()
    for member in ("context_parallel_rank", "pipeline_parallel_rank"):  # Accelerate raises NotImplementedError too
        with pytest.raises(NotImplementedError):
            getattr(acc, member)
    for member in ("parallelism_config", "torch_device_mesh"):  # Accelerate gives None without a parallelism config
        assert getattr(acc, member) is None, member


def test_accelerator_members_scripts_read_as_accelerates():
    model = nn.Linear(3, 2)
    acc = Accelerator()
    for handler in ("autocast_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler",
                    "fp8_recipe_handler", "profile_handler"):
        assert getattr(acc, handler) is None, handler
    assert acc.device_placement is True and acc.step_scheduler_with_optimizer is True
    assert acc.native_amp is False and acc.step == 0 and acc.deepspeed_plugin is None
    assert acc.dispatch_batches is None and acc.project_configuration.automatic_checkpoint_naming is False
    loader = torch.utils.data.DataLoader(torch.arange(8.0).view(4, 2), batch_size=2)
    prepared_model = acc.prepare_model(model)
    optimizer = acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = acc.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1))
    prepared_loader = acc.prepare_data_loader(loader)
    from fabric_lite.optimizer import AcceleratedOptimizer
    from fabric_lite.scheduler import AcceleratedScheduler

    assert isinstance(optimizer, AcceleratedOptimizer) and isinstance(scheduler, AcceleratedScheduler)
    assert [b.tolist() for b in prepared_loader] == [b.tolist() for b in loader]
    with acc.no_sync(prepared_model), acc.trigger_sync_in_backward(prepared_model), \
            acc.join_uneven_inputs([prepared_model]):
        acc.backward(prepared_model(torch.ones(1, 3)).sum())
    assert prepared_model.weight.grad is not None
    assert acc.free_memory(prepared_model, optimizer) == [None, None]
    assert acc.clear() == []


def test_the_counts_the_page_states_are_the_tables():
    text = PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1]
    said = re.search(r"(\d+) names,\s+(\d+) that work, (\d+) refused, (\d+) later\.", text)
    assert said, "the section says how many names work, are refused and come later"
    counts = [len(ROWS), *(sum(r["status"].startswith(s) for r in ROWS) for s in ("works", "refused", "later"))]
    assert [int(n) for n in said.groups()] == counts
