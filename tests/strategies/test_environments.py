"""environments.py: who this process is (a pure function of a mapping) and launcher settings."""

from __future__ import annotations

import pytest

from fabric_lite.strategies.environments import (
    ENV_GRAD_ACCUM, ENV_MIXED_PRECISION, ENV_USE_CPU, LaunchSettings, ProcessInfo, detect_process,
    first_host, read_launch_environment, read_launch_settings,
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
    assert read_launch_environment().process == detect_process(TORCHRUN_ENV)
    assert read_launch_environment().process.global_rank == 5


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
    assert read_launch_environment().launch == LaunchSettings("fp16", 3, False)


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


# -- SLURM and MPI ------------------------------------------------------------------------------------

SRUN_2x2 = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "4"}


def test_srun_task_reads_ranks_nodes_and_master_from_slurm():
    p = detect_process(SRUN_2x2)
    assert (p.world_size, p.global_rank, p.local_rank, p.local_world_size, p.node_rank) == (4, 3, 1, 2, 1)
    assert p.num_nodes == 2 and p.is_distributed
    assert p.master_addr == "gpu07" and p.master_port == 15000 + 4242 % 20000
    assert p.source == "SLURM (srun)"


def test_every_srun_task_derives_the_same_rendezvous():
    others = [dict(SRUN_2x2, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 2), SLURM_NODEID=str(r // 2)) for r in range(4)]
    assert len({(detect_process(e).master_addr, detect_process(e).master_port) for e in others}) == 1


def test_master_addr_and_port_from_the_environment_win_under_slurm():
    p = detect_process(dict(SRUN_2x2, MASTER_ADDR="10.0.0.5", MASTER_PORT="1234"))
    assert (p.master_addr, p.master_port) == ("10.0.0.5", 1234)


def test_a_batch_script_under_sbatch_is_a_lone_process():
    # the batch step has the allocation's variables but no srun step: one process, not rank 0 of N
    env = {k: v for k, v in SRUN_2x2.items() if not k.startswith("SLURM_STEP")}
    env["SLURM_PROCID"] = "0"
    assert detect_process(env) == ProcessInfo()


def test_torchrun_inside_a_slurm_job_wins_over_slurm():
    env = dict(SRUN_2x2, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="x", MASTER_PORT="5")
    p = detect_process(env)
    assert (p.world_size, p.source) == (2, "torchrun")


def test_slurm_requeue_count_is_the_restart_count():
    assert detect_process(dict(SRUN_2x2, SLURM_RESTART_COUNT="2")).restart_count == 2


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node[01-03]", "node01"), ("a[5,7-9],b1", "a5"), ("x1,y[2-3]", "x1"), ("gpu[010]", "gpu010"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_per_node_spec_with_repeats():
    env = dict(SRUN_2x2, SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURM_NODEID="2",
               SLURM_PROCID="4", SLURM_LOCALID="0")
    assert detect_process(env).local_world_size == 1


def test_openmpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"}
    p = detect_process(env)
    assert (p.world_size, p.global_rank, p.local_rank, p.local_world_size, p.node_rank) == (4, 3, 1, 2, 1)
    assert (p.master_addr, p.master_port, p.source) == ("127.0.0.1", 29500, "OpenMPI (mpirun)")


def test_mpich_and_intel_mpi_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "4000"}
    p = detect_process(env)
    assert (p.world_size, p.global_rank, p.local_rank, p.master_port) == (2, 1, 1, 4000)
    assert p.source == "MPICH/Intel MPI (mpirun)"


@pytest.mark.parametrize("env, names", [
    ({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "4"}, ["SLURM_PROCID=4", "SLURM_STEP_NUM_TASKS=4"]),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK=2"]),
    ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "4"}, ["SLURM_PROCID"]),
])
def test_inconsistent_scheduler_variables_raise_naming_them(env, names):
    with pytest.raises(ValueError) as err:
        detect_process(env)
    for name in names:
        assert name in str(err.value)


def test_devices_that_disagree_with_slurm_name_both():
    from fabric_lite.strategies.connector import connect

    with pytest.raises(ValueError) as err:
        connect(accelerator="cpu", devices=4, strategy="auto", precision="32-true", process=detect_process(SRUN_2x2))
    assert "devices=4" in str(err.value) and "SLURM" in str(err.value)
