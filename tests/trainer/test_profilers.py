"""The Trainer's profilers as Lightning users write them: `Trainer(profiler="pytorch" | "advanced")` and
`PyTorchProfiler(...)` / `AdvancedProfiler(...)` from `fabric_lite.profilers`, on real fits of a tiny module."""

from __future__ import annotations

import importlib.util
import json
import pstats
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import torchrun, WORKERS
from fabric_lite import Trainer, TrainModule
from fabric_lite.accelerator.profiling import ProfileKwargs
from fabric_lite.profilers import (
    AdvancedProfiler, PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler, XLAProfiler, resolve_profiler,
)
from fabric_lite.utils import NotSupportedError

STEP = "[pl][profile][Strategy]SingleDeviceStrategy.training_step"
VAL_STEP = "[pl][profile][Strategy]SingleDeviceStrategy.validation_step"
LINEAR = "[pl][module]torch.nn.modules.linear.Linear: body.0"


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.body(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(batches=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * batches, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def trainer(root, **kwargs):
    kwargs = {"max_epochs": 1, "default_root_dir": root, "enable_progress_bar": False, "enable_checkpointing": False,
              "enable_model_summary": False, "logger": False, **kwargs}
    return Trainer(**kwargs)


def trace_events(path):
    return json.loads(path.read_text())["traceEvents"]


def names(events):
    return [e.get("name", "") for e in events]


# -- PyTorchProfiler: one fit and one validate, shared by several tests ------------------------------

@pytest.fixture(scope="module")
def pytorch_run(tmp_path_factory):
    """8 training steps (2 sanity-check validation steps first, 6 validation steps after), then validate() over 6
    batches, with the default schedule (wait 1, warm up 1, record 3, for each kind of step)."""
    root = tmp_path_factory.mktemp("pytorch_profiler")
    profiler = PyTorchProfiler(dirpath=root / "prof", filename="perf", record_shapes=True, profile_memory=True,
                               row_limit=7, sort_by_key="cpu_time_total")
    t = trainer(root, profiler=profiler)
    t.fit(Net(), loader(8), loader(6))
    fit_report = profiler.describe()
    fit_events = [e.name for e in profiler.function_events]
    t.validate(dataloaders=loader(6))
    return t, profiler, root / "prof", fit_report, fit_events


def test_pytorch_profiler_writes_the_report_and_one_chrome_trace_per_kind_of_step(pytorch_run):
    t, profiler, prof_dir, _, _ = pytorch_run
    assert t.global_step == 8  # profiling changes nothing in the training
    assert sorted(p.name for p in prof_dir.iterdir()) == [
        "fit-perf-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json",
        "fit-perf-[Strategy]SingleDeviceStrategy.validation_step.2.pt.trace.json", "fit-perf.txt",
        "validate-perf-[Strategy]SingleDeviceStrategy.validation_step.1.pt.trace.json", "validate-perf.txt"]
    assert t.profiler is profiler and profiler.profiler is None  # (stopped once each stage ended)


def test_the_default_schedule_records_three_training_steps_after_one_waited_and_one_warmed_up(pytorch_run):
    _, _, prof_dir, _, _ = pytorch_run
    events = trace_events(prof_dir / "fit-perf-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json")
    assert names(events).count(STEP) == 3
    assert {n for n in names(events) if n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3",
                                                                          "ProfilerStep#4"}
    assert VAL_STEP not in names(events)  # the sanity check ran before the recorded steps
    # the operators, with their shapes (record_shapes), inside the labelled layers (record_module_names)
    addmm = [e for e in events if e.get("name") == "aten::addmm"]
    assert addmm and [[8], [4, 4], [4, 8]] in [e["args"]["Input Dims"][:3] for e in addmm]
    assert names(events).count(LINEAR) == 3 * 1  # one forward of the first layer per recorded step
    assert "[pl][module]torch.nn.modules.activation.ReLU: body.1" in names(events)
    assert "[pl][profile][Strategy]SingleDeviceStrategy.backward" in names(events)
    assert "[pl][profile]train_dataloader_next" in names(events)
    for name in ("fit-perf-[Strategy]SingleDeviceStrategy.validation_step.2.pt.trace.json",
                 "validate-perf-[Strategy]SingleDeviceStrategy.validation_step.1.pt.trace.json"):
        val = names(trace_events(prof_dir / name))
        assert val.count(VAL_STEP) == 3 and STEP not in val
        assert len({n for n in val if n.startswith("ProfilerStep#")}) == 3


def test_the_report_is_torchs_operator_table_limited_to_row_limit(pytorch_run):
    _, profiler, prof_dir, fit_report, fit_events = pytorch_run
    assert fit_events.count(STEP) == 3 and fit_events.count(VAL_STEP) == 3  # the table covers both cycles
    written = (prof_dir / "fit-perf.txt").read_text()
    assert written.strip() == fit_report.strip()
    assert fit_report.startswith("FIT Profiler Report\nProfile stats for: records\n")
    lines = fit_report.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Name"))
    rows = [line for line in lines[header + 2:] if line.strip() and not line.startswith("-")
            and not line.startswith("Self CPU time total")]
    assert len(rows) == 7  # row_limit
    assert "CPU Mem" in lines[header]  # profile_memory=True adds the memory columns
    shares = [float(re.split(r"\s{2,}", row.strip())[3].rstrip("%")) for row in rows]  # the "CPU total %" column
    assert shares == sorted(shares, reverse=True) and shares[0] == 100.0  # sort_by_key="cpu_time_total"
    assert (prof_dir / "validate-perf.txt").read_text().startswith("VALIDATE Profiler Report")


def test_trainer_profiler_pytorch_takes_the_defaults_and_log_dir(tmp_path):
    t = trainer(tmp_path, profiler="PyTorch", max_steps=6)
    assert isinstance(t.profiler, PyTorchProfiler)
    assert t.profiler.sort_by_key == ("device_time_total" if torch.cuda.is_available() else "cpu_time_total")
    assert t.profiler.profiler_kwargs["activities"][0] == torch.profiler.ProfilerActivity.CPU
    t.fit(Net(), loader(8))
    traces = [p.name for p in tmp_path.iterdir() if p.name.endswith(".pt.trace.json")]
    assert traces == ["fit-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json"]  # into log_dir
    assert not list(tmp_path.glob("*.txt"))  # no filename: the report is printed only


def test_a_schedule_of_two_cycles_writes_two_traces_and_no_schedule_records_every_step(tmp_path):
    seen = []
    profiler = PyTorchProfiler(dirpath=tmp_path / "a", schedule={"wait": 0, "warmup": 1, "active": 2, "repeat": 2},
                               record_module_names=False)
    trainer(tmp_path, profiler=profiler, max_steps=8).fit(Net(), loader(8))
    traces = sorted((tmp_path / "a").iterdir())
    assert [p.name for p in traces] == [f"fit-[Strategy]SingleDeviceStrategy.training_step.{n}.pt.trace.json"
                                        for n in (1, 2)]
    for path, steps in zip(traces, [("ProfilerStep#1", "ProfilerStep#2"), ("ProfilerStep#4", "ProfilerStep#5")]):
        events = names(trace_events(path))
        assert events.count(STEP) == 2 and {n for n in events if n.startswith("ProfilerStep#")} == set(steps)
        assert not any(n.startswith("[pl][module]") for n in events)  # record_module_names=False

    everything = PyTorchProfiler(dirpath=tmp_path / "b", schedule=None, on_trace_ready=lambda p: seen.append(p))
    trainer(tmp_path, profiler=everything, max_steps=5).fit(Net(), loader(8))
    assert len(seen) == 1 and not (tmp_path / "b").exists()  # the user's on_trace_ready replaces the export
    assert [e.name for e in everything.function_events].count(STEP) == 5


def test_steps_of_another_kind_inside_a_running_cycle_are_recorded_in_it(tmp_path):
    """8 training and 2 validation batches an epoch, 2 epochs: the validation cycle begins in the first epoch's
    validation (wait 1 done: warm-up, then recording) and runs through the second epoch's training steps, which
    do not count, to the second epoch's validation."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (no layer labels: torch 2.13's profiler has crashed at shutdown with them in fits of this shape, see
        # the PyTorchProfiler docs; this test is about the schedule)
        trainer(tmp_path, profiler=PyTorchProfiler(dirpath=tmp_path / "p", record_module_names=False), max_epochs=2,
                num_sanity_val_steps=0).fit(Net(), loader(8), loader(2))
    assert not [w for w in caught if "Incorrect schedule" in str(w.message)]
    train = names(trace_events(tmp_path / "p" / "fit-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json"))
    assert train.count(STEP) == 3 and train.count(VAL_STEP) == 0
    val = names(trace_events(tmp_path / "p" / "fit-[Strategy]SingleDeviceStrategy.validation_step.2.pt.trace.json"))
    assert val.count(VAL_STEP) == 2 and val.count(STEP) == 8


def test_a_stage_too_short_for_the_schedule_says_so(tmp_path, capsys):
    t = trainer(tmp_path, profiler=PyTorchProfiler(dirpath=tmp_path, record_module_names=False), max_steps=1)
    t.fit(Net(), loader(8))
    report = capsys.readouterr().err
    assert "Nothing recorded: the stage ran 1 step(s)" in report and "schedule=None" in report


def test_register_record_function_labels_layers_outside_the_trainer():
    from fabric_lite.profilers import RegisterRecordFunction

    model = Net()
    with RegisterRecordFunction(model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        model.body(torch.randn(2, 4))
    assert [e.name for e in p.events()].count(LINEAR) == 1
    assert not model.body[0]._forward_hooks  # the hooks are gone after the block


# -- AdvancedProfiler -------------------------------------------------------------------------------

def test_advanced_profiler_reports_each_action_by_cumulative_time(tmp_path):
    profiler = AdvancedProfiler(dirpath=tmp_path / "prof", filename="adv", line_count_restriction=5,
                                dump_stats=True)
    t = trainer(tmp_path, profiler=profiler, max_steps=3)
    t.fit(Net(), loader(8))
    report = (tmp_path / "prof" / "fit-adv.txt").read_text()
    assert report.startswith("FIT Profiler Report")
    sections = dict(re.findall(r"Profile stats for: (\S+)\n(.*?)(?=Profile stats for: |\Z)", report, re.S))
    assert {"[Strategy]SingleDeviceStrategy.training_step", "[Strategy]SingleDeviceStrategy.backward",
            "[Strategy]SingleDeviceStrategy.optimizer_step", "train_dataloader_next",
            "run_training_epoch"} <= set(sections)
    step = sections["[Strategy]SingleDeviceStrategy.training_step"]
    assert "Ordered by: cumulative time" in step
    assert "test_profilers.py" in step and "(training_step)" in step  # the user's own function, by name
    assert re.search(r"List reduced from \d+ to 5 due to restriction <5>", step)
    dumped = pstats.Stats(str(tmp_path / "prof" / "fit-adv-[Strategy]SingleDeviceStrategy.training_step.prof"))
    own = [key for key in dumped.stats if key[2] == "training_step" and key[0].endswith("test_profilers.py")]
    assert own and dumped.stats[own[0]][1] == 3  # called once per step
    assert isinstance(trainer(tmp_path, profiler="advanced").profiler, AdvancedProfiler)


def test_advanced_profiler_counts_nested_actions_in_the_innermost():
    profiler = AdvancedProfiler()
    profiler.setup("fit")
    with profiler.profile("outer"):
        sum(range(10))
        with profiler.profile("inner"):
            sorted(range(10))
        sum(range(10))
    report = profiler.summary()
    outer, inner = report.split("Profile stats for: inner")
    assert "{built-in method builtins.sum}" in outer and "{built-in method builtins.sorted}" not in outer
    assert "{built-in method builtins.sorted}" in inner
    assert re.search(r"\n\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+ \{built-in method builtins.sum\}", outer)
    with pytest.raises(ValueError, match=r"AdvancedProfiler.stop\('nope'\): that action was not started"):
        profiler.stop("nope")


# -- choosing a profiler, and mistakes -----------------------------------------------------------------

def test_names_resolve_to_their_profilers():
    assert isinstance(resolve_profiler(None), PassThroughProfiler)
    assert isinstance(resolve_profiler("simple"), SimpleProfiler)
    assert isinstance(resolve_profiler("ADVANCED"), AdvancedProfiler)
    assert isinstance(resolve_profiler("pytorch"), PyTorchProfiler)
    mine = SimpleProfiler()
    assert resolve_profiler(mine) is mine and issubclass(PyTorchProfiler, Profiler)


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_the_xla_profiler_is_refused_without_torch_xla():
    for make in (lambda: Trainer(profiler="xla"), XLAProfiler):
        with pytest.raises(NotSupportedError, match=r"XLAProfiler: profiling XLA devices \(TPU\) .* it needs "
                                                    r"torch_xla, which is not installed here.*profiler='pytorch'"):
            make()


@pytest.mark.parametrize("kwargs,exc,fragment", [
    ({"sort_by_key": "speed"}, ValueError, "sort_by_key='speed'): pass one of ['cpu_time'"),
    ({"table_kwargs": {"sort_by": "count"}}, ValueError, "'sort_by' is an argument of PyTorchProfiler itself"),
    ({"table_kwargs": {"colour": 1}}, ValueError, "'colour' is not an argument of torch's EventList.table"),
    ({"row_limit": 0}, ValueError, "row_limit=0): pass how many rows"),
    ({"export_to_chrome": "yes"}, TypeError, "export_to_chrome='yes'): pass True or False"),
    ({"schedule": "often"}, TypeError, "PyTorchProfiler(schedule='often'): pass a dict"),
    ({"schedule": lambda step: 3}, TypeError, "answered 3"),
    ({"schedule": {"wait": 1, "active": 2}}, ValueError, "missing key(s) ['warmup']"),
    ({"activities": ["gpu"]}, ValueError, "PyTorchProfiler(activities=['gpu']): unknown activity 'gpu'"),
    ({"record_shapes": "yes"}, TypeError, "PyTorchProfiler(record_shapes='yes'): pass True or False"),
    ({"use_gpu": True}, TypeError, "unknown torch.profiler.profile argument(s) ['use_gpu']"),
    ({"group_by_input_shapes": True, "record_shapes": False}, ValueError, "needs the shapes recorded"),
])
def test_bad_pytorch_profiler_arguments_are_refused_where_written(kwargs, exc, fragment):
    with pytest.raises(exc) as err:
        PyTorchProfiler(**kwargs)
    assert fragment in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_emit_nvtx_needs_a_gpu():
    with pytest.raises(ValueError, match=r"emit_nvtx=True\): NVTX ranges .* need a CUDA GPU"):
        PyTorchProfiler(emit_nvtx=True)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "all"])
def test_bad_line_count_restriction_is_refused(value):
    with pytest.raises(ValueError, match=re.escape(f"AdvancedProfiler(line_count_restriction={value!r}): pass how")):
        AdvancedProfiler(line_count_restriction=value)


def test_both_doors_check_their_torch_profiler_settings_in_the_same_place():
    """ProfileKwargs (the raw door) and PyTorchProfiler (the Trainer) build their torch profiler through one
    function: the same mistake gets the same words, under each one's own name."""
    with pytest.raises(ValueError) as raw:
        ProfileKwargs(activities=["tpu"])
    with pytest.raises(ValueError) as trainer_door:
        PyTorchProfiler(activities=["tpu"])
    assert str(raw.value).replace("ProfileKwargs", "X") == str(trainer_door.value).replace("PyTorchProfiler", "X")


# -- two processes --------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_write_one_report_and_one_trace_per_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ranks = torchrun(WORKERS / "profilers.py", 2, "--root", tmp_path / "root", out_dir=out)
    expected = sorted([f"fit-adv-{r}.txt" for r in (0, 1)] + [f"fit-perf-{r}.txt" for r in (0, 1)] +
                      [f"fit-perf-{r}-[Strategy]DDPStrategy.training_step.1.pt.trace.json" for r in (0, 1)])
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank and result["world"] == 2 and result["strategy"] == "DDPStrategy"
        assert result["files"] == expected
        assert result["steps_in_trace"] == 3
        assert result["report"] == ["FIT Profiler Report", f"Profile stats for: records rank: {rank}"]


class ActionLog(Profiler):
    """A profiler as a Lightning user writes one: start and stop only, Lightning's setup signature."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.stages = []

    def setup(self, stage, local_rank=None, log_dir=None):
        super().setup(stage, local_rank, log_dir)
        self.stages.append((stage, local_rank, log_dir))

    def start(self, action_name):
        self.events.append(("start", action_name))

    def stop(self, action_name):
        self.events.append(("stop", action_name))


def test_a_users_own_profiler_sees_every_action_in_order(tmp_path):
    profiler = ActionLog()
    trainer(tmp_path, profiler=profiler, max_steps=2).fit(Net(), loader(8))
    assert profiler.stages == [("fit", None, str(tmp_path))]
    steps = [e for e in profiler.events if e[1] == "[Strategy]SingleDeviceStrategy.training_step"]
    assert steps == [("start", steps[0][1]), ("stop", steps[0][1])] * 2
    opened = []
    for kind, action in profiler.events:  # every action stops after it starts, innermost first
        if kind == "start":
            opened.append(action)
        else:
            assert opened.pop() == action
    assert opened == []


class ManualOrAutomatic(TrainModule):
    """Lightning's profiler example, small: training_step chosen in __init__, manual or automatic optimization."""

    def __init__(self, automatic_optimization=True):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.automatic_optimization = automatic_optimization
        self.training_step = self.automatic_step if automatic_optimization else self.manual_step

    def automatic_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def manual_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001, momentum=0.9)


@pytest.mark.parametrize("automatic", [True, False])
def test_lightnings_profiler_example_writes_a_training_and_a_validation_trace(tmp_path, automatic):
    t = Trainer(profiler=PyTorchProfiler(), max_epochs=1, limit_train_batches=15, limit_val_batches=15,
                default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    t.fit(ManualOrAutomatic(automatic), loader(20), loader(20))
    traces = sorted(p.name for p in Path(t.log_dir).glob("*.pt.trace.json"))
    assert traces == ["fit-[Strategy]SingleDeviceStrategy.training_step.1.pt.trace.json",
                      "fit-[Strategy]SingleDeviceStrategy.validation_step.2.pt.trace.json"]
    t.predict(dataloaders=loader(6))
    assert Path(t.log_dir, "predict-[Strategy]SingleDeviceStrategy.predict_step.1.pt.trace.json").is_file()


def test_export_to_flame_graph_writes_the_stacks_of_each_cycle(tmp_path):
    profiler = PyTorchProfiler(dirpath=tmp_path, export_to_flame_graph=True, schedule=None, export_to_chrome=False)
    assert profiler.profiler_kwargs["with_stack"] is True
    trainer(tmp_path, profiler=profiler, max_steps=2).fit(Net(), loader(8))
    stacks = list(tmp_path.glob("*.stack"))
    assert [p.name for p in stacks] == ["fit-[Strategy]SingleDeviceStrategy.training_step.1.stack"]
    assert not list(tmp_path.glob("*.json"))
    assert "training_step" in stacks[0].read_text()  # the user's function, in the stacks
