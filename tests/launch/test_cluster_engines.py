"""SkyPilot's and Kubeflow Trainer's launch variables: `detect_node_layout`, the defaults of `fabric-lite launch`,
the Trainer's re-launch (`torchrun_command`) and `fabric-lite env`; one real launch under each engine."""

import doctest
import json
import os
import re
import sys

import pytest

from conftest import WORKERS, free_port, run_command
from fabric_lite.launch.config_file import LaunchConfigFile, save_config
from fabric_lite.cli.launch_command import launch_command, parse_with_config
from fabric_lite.cli.launch_flags import launch_command_parser, resolve_accelerate_flags
from fabric_lite.launch.launch_checks import check_launch
from fabric_lite.launch.launcher import torchrun_command
from fabric_lite.strategies import environments
from fabric_lite.strategies.environments import SKYPILOT_MASTER_PORT, NodeLayout, detect_node_layout

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "fabric_lite.cli"]

SKYPILOT = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.4\n10.0.0.5", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
KUBEFLOW = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob", "PET_MASTER_PORT": "29400"}
CLUSTER_VARS = (*SKYPILOT, *KUBEFLOW, "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "MASTER_PORT", "MASTER_ADDR")


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    """Whatever the shell around pytest exports, a test starts outside any cluster engine."""
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


def set_env(monkeypatch, values):
    for key, value in values.items():
        monkeypatch.setenv(key, value)


# -- detect_node_layout --------------------------------------------------------------------------------------------

def test_skypilot_layout():
    assert detect_node_layout(SKYPILOT) == NodeLayout(nnodes=2, node_rank=1, nproc_per_node=8, master_addr="10.0.0.4",
                                                      master_port=SKYPILOT_MASTER_PORT, source="SkyPilot")
    assert SKYPILOT_MASTER_PORT == 8008  # SkyPilot's own torchrun recipe; the same on every node


def test_skypilot_layout_details():
    # no GPUs: processes per node not said; MASTER_PORT gives the port; blank lines and a missing count are fine
    layout = detect_node_layout({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "\n10.0.0.9\n10.0.0.8\n\n",
                                 "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": "23456"})
    assert (layout.nnodes, layout.node_rank, layout.nproc_per_node, layout.master_addr, layout.master_port) == \
        (2, 0, None, "10.0.0.9", 23456)


def test_kubeflow_layout():
    assert detect_node_layout(KUBEFLOW) == NodeLayout(
        nnodes=2, node_rank=1, nproc_per_node=4, master_addr="trainjob-node-0-0.trainjob", master_port=29400,
        source="Kubeflow TrainJob (PET_* variables)")
    # what torchrun would assume where a variable is missing; "auto" processes per node: not said here
    layout = detect_node_layout({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"})
    assert (layout.nnodes, layout.node_rank, layout.nproc_per_node, layout.master_addr, layout.master_port) == \
        (1, 0, None, "127.0.0.1", None)


def test_no_layout_without_an_engine():
    assert detect_node_layout({}) is None
    assert detect_node_layout({"PET_MASTER_PORT": "12345", "MASTER_PORT": "1"}) is None  # no node count: not a job
    assert detect_node_layout({"SKYPILOT_NUM_NODES": "2"}) is None
    assert detect_node_layout({**SKYPILOT, **KUBEFLOW}).source == "SkyPilot"  # the first that applies


def test_layout_is_exported_and_its_examples_hold():
    assert {"NodeLayout", "detect_node_layout"} <= set(environments.__all__)
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(detect_node_layout, globs={"detect_node_layout": detect_node_layout}):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted >= 3 and runner.failures == 0


@pytest.mark.parametrize("env, fragment", [
    ({**SKYPILOT, "SKYPILOT_NODE_RANK": "one"}, "SKYPILOT_NODE_RANK='one'"),
    ({**SKYPILOT, "SKYPILOT_NODE_RANK": "2"}, "SKYPILOT_NODE_RANK=2"),
    ({**SKYPILOT, "SKYPILOT_NODE_RANK": "-1"}, "SKYPILOT_NODE_RANK=-1"),
    ({**SKYPILOT, "SKYPILOT_NODE_IPS": "\n \n"}, "SKYPILOT_NODE_IPS='\\n \\n'"),
    ({**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES='3'"),
    ({**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "many"}, "SKYPILOT_NUM_GPUS_PER_NODE='many'"),
    ({**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "-2"}, "SKYPILOT_NUM_GPUS_PER_NODE=-2"),
    ({**SKYPILOT, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"SKYPILOT_NODE_RANK": "0"}, "SKYPILOT_NODE_IPS"),
    ({"SKYPILOT_NODE_IPS": "10.0.0.4"}, "SKYPILOT_NODE_RANK"),
    ({**KUBEFLOW, "PET_NNODES": "two"}, "PET_NNODES='two'"),
    ({**KUBEFLOW, "PET_NNODES": "0", "PET_NODE_RANK": "0"}, "PET_NNODES=0"),
    ({**KUBEFLOW, "PET_NNODES": "1:4"}, "PET_NNODES='1:4'"),
    ({**KUBEFLOW, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2"),
    ({**KUBEFLOW, "PET_NODE_RANK": "x"}, "PET_NODE_RANK='x'"),
    ({**KUBEFLOW, "PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE='0'"),
    ({**KUBEFLOW, "PET_MASTER_PORT": "port"}, "PET_MASTER_PORT='port'"),
])
def test_bad_values_are_refused_naming_the_variable(env, fragment):
    with pytest.raises(ValueError) as info:
        detect_node_layout(env)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert re.search(r"\b(set|unset|start)\b", message), message  # and says what to do


# -- fabric-lite launch: defaults from the engine (parsing only, no processes) -------------------------------------

def launch_args(*argv, config=None):
    """What `fabric-lite launch ARGV` would start, as `launch_command` reads it (flags, the engine, the config)."""
    if config is not None:
        argv = ("--config-file", str(config), *argv)
    _, args, _, found = parse_with_config(launch_command_parser(), list(argv), os.environ)
    resolve_accelerate_flags(args, found)
    return args


def layout_of(args):
    return (str(args.nnodes), args.node_rank, str(args.nproc_per_node), args.master_addr, args.master_port)


def test_launch_takes_skypilots_layout(monkeypatch):
    set_env(monkeypatch, SKYPILOT)
    args = launch_args("train.py")
    assert layout_of(args) == ("2", 1, "8", "10.0.0.4", 8008)
    check_launch(args)  # a launch that can run
    # flags on the command line win, torchrun's spellings and Accelerate's
    args = launch_args("--nproc-per-node", "2", "--main_process_port", "23456", "train.py")
    assert layout_of(args) == ("2", 1, "2", "10.0.0.4", 23456)
    args = launch_args("--num_processes", "4", "train.py")  # Accelerate's total, over SkyPilot's 2 nodes
    assert layout_of(args) == ("2", 1, "2", "10.0.0.4", 8008)


def test_launch_on_skypilot_cpu_nodes_keeps_torchruns_process_count(monkeypatch):
    set_env(monkeypatch, {**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": "29999"})
    assert layout_of(launch_args("--cpu", "train.py")) == ("2", 1, "1", "10.0.0.4", 29999)


def test_skypilots_layout_wins_over_the_config_file(monkeypatch, tmp_path):
    config = save_config(LaunchConfigFile(nproc_per_node=3, mixed_precision="bf16"), tmp_path / "config.yaml")
    set_env(monkeypatch, SKYPILOT)
    args = launch_args("train.py", config=config)
    assert layout_of(args) == ("2", 1, "8", "10.0.0.4", 8008) and args.mixed_precision == "bf16"
    set_env(monkeypatch, {"SKYPILOT_NUM_GPUS_PER_NODE": "0"})  # the node says no count: the config's
    assert layout_of(launch_args("train.py", config=config)) == ("2", 1, "3", "10.0.0.4", 8008)


def test_launch_takes_kubeflows_pet_variables_through_torchruns_parser(monkeypatch, tmp_path):
    set_env(monkeypatch, KUBEFLOW)
    assert layout_of(launch_args("train.py")) == ("2", 1, "4", "trainjob-node-0-0.trainjob", 29400)
    # a config file (one machine on 127.0.0.1) does not override them; flags do
    config = save_config(LaunchConfigFile(nproc_per_node=3, master_port=23000), tmp_path / "config.yaml")
    assert layout_of(launch_args("train.py", config=config)) == ("2", 1, "4", "trainjob-node-0-0.trainjob", 29400)
    args = launch_args("--nnodes", "3", "--node-rank", "2", "--master-port", "23456", "train.py", config=config)
    assert layout_of(args) == ("3", 2, "4", "trainjob-node-0-0.trainjob", 23456)


def test_launch_refuses_bad_engine_variables_in_one_line(capsys):
    code = launch_command(["--cpu", "train.py"], env={**SKYPILOT, "SKYPILOT_NUM_NODES": "5"})
    err = capsys.readouterr().err
    assert code == 2 and "SKYPILOT_NUM_NODES='5'" in err and len(err.strip().splitlines()) == 1


# -- the Trainer's re-launch: torchrun_command ----------------------------------------------------------------------

def torchrun_flags(cmd):
    head = cmd[3:cmd.index("--")]
    return dict(zip(head[::2], head[1::2]))


def test_torchrun_command_under_skypilot():
    cmd = torchrun_command(3, 2, "train.py", ["--lr", "1"], env=SKYPILOT)
    assert torchrun_flags(cmd) == {"--nproc-per-node": "3", "--nnodes": "2", "--node-rank": "1",
                                   "--master-addr": "10.0.0.4", "--master-port": "8008"}
    assert cmd[cmd.index("--"):] == ["--", "train.py", "--lr", "1"]


def test_torchrun_command_under_kubeflow():
    cmd = torchrun_command(2, 2, "train.py", env=KUBEFLOW)
    assert torchrun_flags(cmd) == {"--nproc-per-node": "2", "--nnodes": "2", "--node-rank": "1",
                                   "--master-addr": "trainjob-node-0-0.trainjob", "--master-port": "29400"}
    # no port said on several nodes: torchrun's usual one, the same on every node (never a free one)
    no_port = {k: v for k, v in KUBEFLOW.items() if k != "PET_MASTER_PORT"}
    assert torchrun_flags(torchrun_command(2, 2, "train.py", env=no_port))["--master-port"] == "29500"


def test_torchrun_command_without_an_engine_is_one_machine():
    flags = torchrun_flags(torchrun_command(2, 1, "train.py", env={}))
    assert flags["--master-addr"] == "127.0.0.1" and "--node-rank" not in flags and int(flags["--master-port"]) > 0


def test_torchrun_command_refuses_a_node_count_the_engine_disagrees_with():
    with pytest.raises(ValueError, match=r"num_nodes=1, but SkyPilot runs this job on 2 node\(s\).*num_nodes=2"):
        torchrun_command(8, 1, "train.py", env=SKYPILOT)


# -- fabric-lite env --------------------------------------------------------------------------------------------------

def test_env_names_the_processes_and_the_cluster(monkeypatch, capsys):
    from fabric_lite.cli.main import main

    set_env(monkeypatch, SKYPILOT)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "processes   lone process" in out
    assert "cluster     SkyPilot: node 1 of 2, head 10.0.0.4:8008, 8 process(es) per node" in out
    set_env(monkeypatch, {"SKYPILOT_NUM_GPUS_PER_NODE": "0"})
    assert main(["env"]) == 0
    assert "head 10.0.0.4:8008, processes per node not said" in capsys.readouterr().out
    for name in SKYPILOT:
        monkeypatch.delenv(name)
    assert main(["env"]) == 0
    assert "cluster " not in capsys.readouterr().out


# -- real launches on this machine, one node --------------------------------------------------------------------------

def reports(out, world):
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    assert not (out / f"rank{world}.json").exists()
    return results


def test_launch_under_skypilot_variables(tmp_path):
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    env = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": str(port)}
    proc = run_command([*CLI, "launch", "--cpu", "--nproc-per-node", "2", str(WORKERS / "cli_env.py"),
                        "--out", str(out)], env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank, result in enumerate(reports(out, 2)):
        assert result["world"] == 2 and result["env"]["RANK"] == str(rank) and result["env"]["GROUP_RANK"] == "0"
        assert result["env"]["MASTER_PORT"] == str(port)  # SkyPilot's head port, as every node would compute it


def test_launch_under_kubeflow_pet_variables(tmp_path):
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(port)}
    proc = run_command([*CLI, "launch", "--cpu", str(WORKERS / "cli_env.py"), "--out", str(out)], env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank, result in enumerate(reports(out, 2)):
        assert result["world"] == 2 and result["env"]["RANK"] == str(rank) and result["env"]["GROUP_RANK"] == "0"
        assert result["env"]["MASTER_PORT"] == str(port)


def test_trainer_devices_2_relaunches_under_skypilot_variables(tmp_path):
    port = free_port()
    env = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MASTER_PORT": str(port)}
    proc = run_command([sys.executable, str(WORKERS / "trainer_relaunch.py")], env=env, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(re.findall(rf"RANK (\d) OF 2 STEPS 4 PORT {port}", proc.stdout)) == ["0", "1"]
