"""environments.py: who this process is (a pure function of a mapping) and launcher settings."""

from __future__ import annotations

import pytest

from fabric_lite.environments import (
    ENV_GRAD_ACCUM, ENV_MIXED_PRECISION, ENV_USE_CPU, LaunchSettings, ProcessInfo, detect_process,
    read_launch_settings,
)

_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
    ENV_MIXED_PRECISION, ENV_GRAD_ACCUM, ENV_USE_CPU,
)

TORCHRUN_ENV = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29512",
    "TORCHELASTIC_RUN_ID": "job-7",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


# -- detect_process --------------------------------------------------------------------------------

def test_lone_process_from_empty_mapping():
    info = detect_process({})
    assert info == ProcessInfo()
    assert (info.world_size, info.global_rank, info.local_rank, info.local_world_size, info.node_rank) == (1, 0, 0, 1, 0)
    assert info.num_nodes == 1
    assert info.is_distributed is False
    assert info.master_port is None
    assert info.restart_count == 0
    assert info.uses_agent_store is False
    assert info.source == "lone process"


def test_lone_process_ignores_rank_variables_without_world_size():
    # LOCAL_RANK alone (some schedulers set it) does not make a distributed job.
    info = detect_process({"LOCAL_RANK": "3", "RANK": "3"})
    assert info.world_size == 1 and info.global_rank == 0 and not info.is_distributed


def test_torchrun_variables_are_read():
    info = detect_process(TORCHRUN_ENV)
    assert info.world_size == 8
    assert info.global_rank == 5
    assert info.local_rank == 1
    assert info.local_world_size == 4
    assert info.node_rank == 1
    assert info.num_nodes == 2
    assert info.master_addr == "10.1.2.3"
    assert info.master_port == 29512
    assert info.restart_count == 2
    assert info.uses_agent_store is True
    assert info.is_distributed is True
    assert info.source == "torchrun"


def test_agent_store_false_and_missing_restart_count():
    env = dict(TORCHRUN_ENV, TORCHELASTIC_USE_AGENT_STORE="False")
    del env["TORCHELASTIC_RESTART_COUNT"]
    info = detect_process(env)
    assert info.uses_agent_store is False
    assert info.restart_count == 0
    assert info.source == "torchrun"  # TORCHELASTIC_RUN_ID alone marks an elastic launch


def test_plain_environment_variables_without_elastic_markers():
    info = detect_process({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "1234"})
    assert (info.world_size, info.global_rank, info.local_rank) == (2, 1, 1)
    # LOCAL_WORLD_SIZE defaults to WORLD_SIZE: one node.
    assert info.local_world_size == 2 and info.num_nodes == 1 and info.node_rank == 0
    assert info.master_addr == "127.0.0.1"
    assert info.master_port == 1234
    assert info.source == "environment variables"


def test_node_rank_falls_back_to_node_rank_then_rank_division():
    base = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert detect_process(base).node_rank == 1  # 6 // 4
    assert detect_process(dict(base, NODE_RANK="3")).node_rank == 3
    assert detect_process(dict(base, NODE_RANK="3", GROUP_RANK="0")).node_rank == 0  # GROUP_RANK wins


def test_empty_strings_count_as_unset():
    info = detect_process({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "", "MASTER_PORT": ""})
    assert info.local_rank == 0 and info.master_port is None and info.global_rank == 1
    assert detect_process({"WORLD_SIZE": ""}) == ProcessInfo()


def test_reads_os_environ_by_default(monkeypatch):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    assert detect_process() == detect_process(TORCHRUN_ENV)
    assert detect_process().global_rank == 5


@pytest.mark.parametrize("name", [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
])
def test_non_integer_value_raises_naming_the_variable(name):
    env = dict(TORCHRUN_ENV, **{name: "two"})
    with pytest.raises(ValueError) as err:
        detect_process(env)
    assert name in str(err.value)
    assert "'two'" in str(err.value)


@pytest.mark.parametrize("env, names", [
    ({"WORLD_SIZE": "2", "RANK": "2"}, ("RANK", "WORLD_SIZE")),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, ("RANK",)),
    ({"WORLD_SIZE": "0", "RANK": "0"}, ("WORLD_SIZE",)),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "-1"}, ("LOCAL_RANK",)),
])
def test_inconsistent_ranks_raise_naming_the_variables(env, names):
    with pytest.raises(ValueError) as err:
        detect_process(env)
    for name in names:
        assert name in str(err.value)


def test_process_info_is_frozen():
    info = detect_process(TORCHRUN_ENV)
    with pytest.raises(Exception):
        info.global_rank = 0  # type: ignore[misc]


# -- read_launch_settings --------------------------------------------------------------------------

def test_launch_settings_default_to_none():
    assert read_launch_settings({}) == LaunchSettings(None, None, False)


def test_launch_settings_are_read():
    s = read_launch_settings({ENV_MIXED_PRECISION: "bf16", ENV_GRAD_ACCUM: "4", ENV_USE_CPU: "true"})
    assert s.mixed_precision == "bf16"
    assert s.gradient_accumulation_steps == 4
    assert s.use_cpu is True


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("True", True), ("YES", True), ("0", False), ("false", False), ("", False),
])
def test_use_cpu_spellings(raw, expected):
    assert read_launch_settings({ENV_USE_CPU: raw}).use_cpu is expected


def test_empty_launch_settings_count_as_unset():
    s = read_launch_settings({ENV_MIXED_PRECISION: "", ENV_GRAD_ACCUM: ""})
    assert s.mixed_precision is None and s.gradient_accumulation_steps is None


def test_bad_gradient_accumulation_setting_names_the_variable():
    with pytest.raises(ValueError, match=ENV_GRAD_ACCUM):
        read_launch_settings({ENV_GRAD_ACCUM: "four"})


def test_launch_settings_read_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(ENV_MIXED_PRECISION, "fp16")
    monkeypatch.setenv(ENV_GRAD_ACCUM, "3")
    assert read_launch_settings() == LaunchSettings("fp16", 3, False)


def test_accelerator_takes_launch_settings_and_explicit_arguments_win(monkeypatch):
    from fabric_lite import Accelerator

    monkeypatch.setenv(ENV_MIXED_PRECISION, "bf16")
    monkeypatch.setenv(ENV_GRAD_ACCUM, "3")
    monkeypatch.setenv(ENV_USE_CPU, "1")
    acc = Accelerator()
    assert acc.mixed_precision == "bf16"
    assert acc.gradient_accumulation_steps == 3
    assert acc.device.type == "cpu"
    explicit = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    assert explicit.mixed_precision == "no"
    assert explicit.gradient_accumulation_steps == 2
