"""ProfileKwargs and the profiler context behind `accelerator.profile()` (Accelerate's names and behaviour)."""

import dataclasses
import json

import pytest
import torch

from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import KwargsHandler
from fabric_lite.accelerator.profiling import ProfileKwargs, profile_context, trace_file_name


def work(steps=1, prof=None):
    model = torch.nn.Linear(8, 4)
    for _ in range(steps):
        model(torch.randn(16, 8)).sum().backward()
        if prof is not None:
            prof.step()


def test_fields_and_defaults_are_accelerates():
    fields = {f.name: f.default for f in dataclasses.fields(ProfileKwargs)}
    assert fields == {"activities": None, "schedule_option": None, "on_trace_ready": None, "record_shapes": False,
                      "profile_memory": False, "with_stack": False, "with_flops": False, "with_modules": False,
                      "output_trace_dir": None}
    assert issubclass(ProfileKwargs, KwargsHandler)
    assert ProfileKwargs(with_flops=True, activities=["cpu"]).to_kwargs() == {"with_flops": True,
                                                                               "activities": ["cpu"]}
    assert trace_file_name(3) == "profile_3.json"


def test_build_passes_every_setting_to_torch():
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, profile_memory=True, with_stack=True,
                            with_flops=True, with_modules=True)
    prof = handler.build()
    assert isinstance(prof, torch.profiler.profile)
    assert prof.activities == {torch.profiler.ProfilerActivity.CPU}
    assert (prof.record_shapes, prof.profile_memory, prof.with_stack, prof.with_flops, prof.with_modules) == \
        (True, True, True, True, True)
    assert ProfileKwargs().build().record_shapes is False
    # activities: names (any case) or torch's members; None is torch's default (CPU, plus the GPU if any)
    assert ProfileKwargs(activities=["CPU", torch.profiler.ProfilerActivity.CPU]).profiler_activities() == \
        [torch.profiler.ProfilerActivity.CPU] * 2
    assert ProfileKwargs().profiler_activities() is None
    assert torch.profiler.ProfilerActivity.CPU in ProfileKwargs().build().activities


def test_flops_and_shapes_reach_torchs_profiler():
    with profile_context(ProfileKwargs(activities=["cpu"], with_flops=True, record_shapes=True)) as prof:
        work()
    addmm = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::addmm"]
    assert addmm and addmm[0].input_shapes[:3] == [[4], [16, 8], [8, 4]]
    assert addmm[0].flops == 2 * 16 * 8 * 4  # multiply-adds of a (16x8)@(8x4) product
    with profile_context(ProfileKwargs(activities=["cpu"])) as prof:
        work()
    assert all(e.flops == 0 for e in prof.key_averages())  # (off unless asked for)


def test_bad_settings_are_refused_where_they_are_written():
    with pytest.raises(ValueError, match=r"unknown activity 'gpu'; allowed: 'cpu', 'cuda'"):
        ProfileKwargs(activities=["cpu", "gpu"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['steps'\].*\['wait', 'warmup', 'active'\] are required"):
        ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2, "steps": 3})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['warmup'\]"):
        ProfileKwargs(schedule_option={"wait": 1, "active": 2})
    with pytest.raises(ValueError, match="active=0 records nothing"):
        ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 0})
    with pytest.raises(ValueError, match="wait=-1 must be an integer >= 0"):
        ProfileKwargs(schedule_option={"wait": -1, "warmup": 1, "active": 1})
    with pytest.raises(TypeError, match="record_shapes='yes'"):
        ProfileKwargs(record_shapes="yes")
    with pytest.raises(TypeError, match="on_trace_ready='traces/'"):
        ProfileKwargs(on_trace_ready="traces/")
    handler = ProfileKwargs()
    handler.activities = ["tpu"]  # (changed after it was made: build() checks again)
    with pytest.raises(ValueError, match="unknown activity 'tpu'"):
        handler.build()
    with pytest.raises(TypeError, match="pass a ProfileKwargs"):
        with profile_context({"with_flops": True}):
            pass


def test_a_schedule_records_its_active_steps_and_calls_on_trace_ready(tmp_path):
    ready = []
    handler = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
                            on_trace_ready=lambda p: ready.append(p.step_num), output_trace_dir=tmp_path / "traces")
    with profile_context(handler, process_index=2) as prof:
        work(steps=6, prof=prof)
    assert ready == [4]  # once, after steps 2 and 3 were recorded
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["profile_2.json"]
    events = json.loads((tmp_path / "traces" / "profile_2.json").read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(e.get("name") == "aten::addmm" for e in events)
    assert "aten::addmm" in {e.key for e in prof.key_averages()}


def test_the_trace_is_written_at_the_end_and_then_everyone_waits(tmp_path):
    seen = []
    trace_dir = tmp_path / "new" / "dir"
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(trace_dir))
    with profile_context(handler, process_index=0,
                         wait_for_everyone=lambda: seen.append(sorted(p.name for p in trace_dir.iterdir()))):
        assert trace_dir.is_dir()  # made before the work starts
        work()
        assert not any(trace_dir.iterdir())
    assert seen == [["profile_0.json"]]  # written (whole, under its name) before waiting for the others


def test_a_block_that_raises_writes_nothing_and_waits_for_no_one(tmp_path):
    waited = []
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=tmp_path)
    with pytest.raises(KeyError, match="inside"):
        with profile_context(handler, process_index=0, wait_for_everyone=lambda: waited.append(1)):
            work()
            raise KeyError("inside")
    assert list(tmp_path.iterdir()) == [] and waited == []


def test_an_unusable_trace_dir_fails_before_the_work(tmp_path):
    (tmp_path / "file").write_text("")
    ran = []
    with pytest.raises((FileExistsError, NotADirectoryError)):
        with profile_context(ProfileKwargs(activities=["cpu"], output_trace_dir=tmp_path / "file" / "traces")):
            ran.append(1)
    assert ran == []


def test_accelerator_profile_takes_the_handler_from_kwargs_handlers_or_the_argument(tmp_path):
    handler = ProfileKwargs(activities=["cpu"], with_flops=True, output_trace_dir=tmp_path / "from_handlers")
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    model = accelerator.prepare(torch.nn.Linear(8, 4))
    with accelerator.profile() as prof:
        model(torch.randn(16, 8))
    assert isinstance(prof, torch.profiler.profile)
    assert sum(e.flops for e in prof.key_averages()) == 2 * 16 * 8 * 4
    assert [p.name for p in (tmp_path / "from_handlers").iterdir()] == ["profile_0.json"]
    other = ProfileKwargs(activities=["cpu"], output_trace_dir=tmp_path / "from_argument")
    with accelerator.profile(other) as prof:
        model(torch.randn(16, 8))
    assert [p.name for p in (tmp_path / "from_argument").iterdir()] == ["profile_0.json"]
    assert all(e.flops == 0 for e in prof.key_averages())
    with Accelerator(cpu=True).profile() as prof:  # no handler anywhere: the defaults, no trace
        model(torch.randn(16, 8))
    assert "aten::addmm" in {e.key for e in prof.key_averages()}


@pytest.mark.slow
def test_two_processes_write_one_trace_each(tmp_path_factory):
    """The profiled part of tests/workers/batch_size_search.py (one launch shared with test_memory.py): a
    schedule over 5 DDP steps on 2 processes, through accelerator.profile() once it exists."""
    from test_memory import batch_size_search_run

    ranks, traces = batch_size_search_run(tmp_path_factory)
    assert sorted(p.name for p in traces.iterdir()) == ["profile_0.json", "profile_1.json"]
    for rank, result in enumerate(ranks):
        profile = result["profile"]
        assert profile["traces"] == ["profile_0.json", "profile_1.json"]  # every trace written before the context ended
        assert {"aten::addmm", "DistributedDataParallel.forward", "Optimizer.step#SGD.step"} <= set(profile["ops"])
        assert profile["flops"] > 0
        assert [[8, 4], [4, 16]] == profile["addmm_shapes"][0][1:3]  # record_shapes reached torch
        events = json.loads((traces / f"profile_{rank}.json").read_text())["traceEvents"]
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == \
            {"ProfilerStep#2", "ProfilerStep#3"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_default_activities_take_the_gpu_kernels_too(tmp_path):
    model = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    with profile_context(ProfileKwargs(output_trace_dir=tmp_path, with_flops=True), process_index=0) as prof:
        model(x).sum().backward()
        torch.cuda.synchronize()
    assert torch.profiler.ProfilerActivity.CUDA in prof.activities
    events = json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # GPU kernels in the Chrome trace
    averages = prof.key_averages()
    assert sum(e.device_time_total for e in averages) > 0
    assert sum(e.flops for e in averages) >= 2 * 64 * 256 * 256
