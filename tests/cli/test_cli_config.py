"""`fabric-lite config` / `launch` with a config file / `env` / `test`, bad input, and a 2-node job."""

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import WORKERS, free_port, run_command
from fabric_lite.launch.config_file import (
    ConfigError, LaunchConfigFile, default_config_path, dump_config, parse_config, questionnaire,
)

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "fabric_lite.cli"]


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """Every command in a test sees this directory as the user's config dir, never the real one."""
    path = tmp_path / "config"
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(path))
    for name in ("XDG_CONFIG_HOME", "PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return path


def cli(*args, timeout=60, env=None):
    return run_command([*CLI, *map(str, args)], timeout=timeout, env=env)


def assert_one_line_error(proc, *fragments, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def read_results(out, n):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


# -- the file: path, format, validation (no processes) ----------------------------------------------

def test_config_path_is_a_pure_function_of_the_environment():
    assert default_config_path({"FABRIC_LITE_CONFIG_DIR": "/a", "XDG_CONFIG_HOME": "/x"}).as_posix() == \
        "/a/default_config.yaml"
    assert default_config_path({"XDG_CONFIG_HOME": "/x", "HOME": "/h"}).as_posix() == \
        "/x/fabric_lite/default_config.yaml"
    assert default_config_path({"HOME": "/h"}).as_posix() == "/h/.config/fabric_lite/default_config.yaml"
    assert default_config_path({"FABRIC_LITE_CONFIG_DIR": ""}, home="/z").as_posix() == \
        "/z/.config/fabric_lite/default_config.yaml"


def test_config_round_trips_and_reads_yaml_no_as_no():
    config = LaunchConfigFile(nproc_per_node=2, mixed_precision="no", use_cpu=True)
    assert parse_config(dump_config(config)) == config
    # a hand-written file with a bare `no` (YAML false) and torchrun's spellings
    assert parse_config("mixed_precision: no\nnproc_per_node: auto\n").mixed_precision == "no"
    assert parse_config("mixed_precision: bf16-mixed").mixed_precision == "bf16"
    # fp8 is a setting like the others (the launch checks the machine's GPUs, not the file)
    assert parse_config("mixed_precision: FP8").mixed_precision == "fp8"
    fp8 = LaunchConfigFile(nproc_per_node=8, mixed_precision="fp8")
    assert parse_config(dump_config(fp8)) == fp8
    assert parse_config("") == LaunchConfigFile()


@pytest.mark.parametrize("text, fragment", [
    ("nproc_per_node: [2", "is not valid YAML (line"),
    ("nproc_per_node: 2\nnum_gpus: 1", "unknown key 'num_gpus'"),
    ("- 1\n- 2", "must hold a mapping"),
    ("nproc_per_node: -1", "nproc_per_node=-1"),
    ("nnodes: 2\nnode_rank: 2\ncompute_environment: multi_node", "node_rank=2 must be < nnodes=2"),
    ("nnodes: 2", "compute_environment=this_machine runs on one machine"),
    ("mixed_precision: fp4", "mixed_precision='fp4' is not allowed; choose one of: no, fp16, bf16, fp8"),
    ("master_port: 70000", "master_port=70000"),
    ("use_cpu: maybe", "use_cpu='maybe'"),
    ("gradient_accumulation_steps: 1.5", "gradient_accumulation_steps=1.5"),
])
def test_config_refusals_are_one_line(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.yaml")
    message = str(info.value)
    assert fragment in message and message.startswith("my.yaml") and "\n" not in message


def test_questionnaire_reasks_until_the_answer_is_valid():
    answers = iter(["", "-2", "abc", "3", "ddp", "fp17", "fp16", "", "y"])
    prompts, said = [], []

    def ask(prompt):
        prompts.append(prompt)
        return next(answers)

    config = questionnaire(ask, said.append)
    assert config == LaunchConfigFile(nproc_per_node=3, strategy="ddp", mixed_precision="fp16", use_cpu=True)
    assert sum("How many processes" in p for p in prompts) == 3
    assert any("nproc_per_node=-2 must be >= 1" in s for s in said)
    assert any("'fp17' is not allowed" in s for s in said)


# -- fabric-lite config --------------------------------------------------------------------------------

def drive_terminal(steps, *args):
    proc = run_command([sys.executable, str(WORKERS / "cli_pty.py"), json.dumps(steps), *map(str, args)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stuck_at"] is None, (result["stuck_at"], result["transcript"])
    return result


def test_config_questionnaire_in_a_terminal(config_dir):
    steps = [  # [text to wait for, answer]; an invalid answer is followed by the same question again
        ["compute environment", "2"], ["compute environment", "1"],
        ["How many machines", "2"],
        ["rank of this machine", "5"], ["rank of this machine", "1"],
        ["IP address", "10.1.2.3"], ["Which port", "29555"],
        ["How many processes on each machine", "-3"], ["How many processes on each machine", "2"],
        ["Which strategy", "ddp"], ["Mixed precision", "bf16"],
        ["gradient accumulation", "4"], ["CPU only", "yes"],
    ]
    result = drive_terminal(steps)
    assert result["returncode"] == 0, result["transcript"]
    assert "Configuration saved at" in result["transcript"]
    transcript = result["transcript"]
    assert transcript.count("How many processes on each machine") == 2
    assert "nproc_per_node=-3 must be >= 1. Please try again." in transcript
    assert "node_rank=5 must be < nnodes=2" in transcript and "'2' is not one of the choices" in transcript
    config = parse_config((config_dir / "default_config.yaml").read_text())
    assert config == LaunchConfigFile(compute_environment="multi_node", nnodes=2, node_rank=1,
                                      master_addr="10.1.2.3", master_port=29555, nproc_per_node=2,
                                      strategy="ddp", mixed_precision="bf16", gradient_accumulation_steps=4,
                                      use_cpu=True)


def test_config_questionnaire_defaults_and_end_of_input(config_dir, tmp_path):
    other = tmp_path / "elsewhere.yaml"
    enter = [["compute environment", ""], ["How many processes on this machine", ""], ["strategy", ""],
             ["Mixed precision", ""], ["accumulation", ""], ["CPU only", ""]]
    result = drive_terminal(enter, "--config-file", other)
    assert result["returncode"] == 0, result["transcript"]
    assert parse_config(other.read_text()) == LaunchConfigFile(nproc_per_node=torch.cuda.device_count() or 1)
    # Ctrl-D half-way: a clear message, an error code, nothing written
    result = drive_terminal([["compute environment", "0"], ["How many processes", None]])
    assert result["returncode"] == 2 and "nothing written" in result["transcript"]
    assert "Traceback" not in result["transcript"]
    assert not (config_dir / "default_config.yaml").exists()


def test_config_non_interactive(config_dir, tmp_path):
    proc = cli("config", "--default")
    assert proc.returncode == 0, proc.stderr
    assert parse_config((config_dir / "default_config.yaml").read_text()) == \
        LaunchConfigFile(nproc_per_node=torch.cuda.device_count() or 1)
    proc = cli("config", "--nproc-per-node", 2, "--mixed-precision", "bf16", "--gradient-accumulation-steps", 3,
               "--cpu", "--strategy", "ddp")
    assert proc.returncode == 0, proc.stderr
    assert parse_config((config_dir / "default_config.yaml").read_text()) == LaunchConfigFile(
        nproc_per_node=2, mixed_precision="bf16", gradient_accumulation_steps=3, use_cpu=True, strategy="ddp")
    # several machines: the compute environment follows from --nnodes
    target = tmp_path / "multi.yaml"
    proc = cli("config", "--config-file", target, "--nnodes", 2, "--node-rank", 1, "--master-addr", "10.0.0.1",
               "--master-port", 29400)
    assert proc.returncode == 0, proc.stderr
    assert parse_config(target.read_text()) == LaunchConfigFile(
        compute_environment="multi_node", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    # bad values: one line, nothing written
    for args, fragment in ((("--nproc-per-node", -2), "nproc_per_node=-2"),
                           (("--nnodes", 2, "--node-rank", 2), "node_rank=2 must be < nnodes=2"),
                           (("--master-port", "http"), "master_port='http'")):
        proc = cli("config", "--config-file", tmp_path / "bad.yaml", *args)
        assert_one_line_error(proc, "fabric-lite config: error:", fragment)
        assert not (tmp_path / "bad.yaml").exists()


# -- fabric-lite env -------------------------------------------------------------------------------------

def test_env_shows_the_config_in_force(config_dir):
    proc = cli("env")
    assert proc.returncode == 0 and "no config file" in proc.stdout, proc.stdout
    assert cli("config", "--nproc-per-node", 3, "--mixed-precision", "fp16").returncode == 0
    proc = cli("env")
    assert proc.returncode == 0, proc.stderr
    assert str(config_dir / "default_config.yaml") in proc.stdout
    assert "nproc_per_node: 3" in proc.stdout and "mixed_precision: fp16" in proc.stdout
    (config_dir / "default_config.yaml").write_text("nproc_per_node: [")
    proc = cli("env")
    assert proc.returncode == 0 and "INVALID" in proc.stdout and "Traceback" not in proc.stderr


# -- fabric-lite launch with a config file ---------------------------------------------------------------

@pytest.mark.slow
def test_launch_takes_defaults_from_the_config_and_flags_win(config_dir, tmp_path):
    worker = WORKERS / "cli_env.py"
    # no config file: the launch behaves as before, and says nothing about config files
    out = tmp_path / "plain"
    out.mkdir()
    proc = cli("launch", worker, "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "config" not in proc.stderr
    (plain,) = read_results(out, 1)
    assert plain["env"]["WORLD_SIZE"] == "1" and plain["env"]["FABRIC_LITE_MIXED_PRECISION"] is None

    assert cli("config", "--nproc-per-node", 2, "--mixed-precision", "bf16", "--gradient-accumulation-steps", 3,
               "--cpu", "--strategy", "ddp").returncode == 0
    out = tmp_path / "from_config"
    out.mkdir()
    proc = cli("launch", worker, "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the happy path adds exactly one line: which config file it used
    assert proc.stderr.strip().splitlines() == [f"fabric-lite launch: using config file {config_dir / 'default_config.yaml'}"]
    for r in read_results(out, 2):
        assert r["env"]["WORLD_SIZE"] == "2" and r["env"]["FABRIC_LITE_MIXED_PRECISION"] == "bf16-mixed"
        assert r["env"]["FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS"] == "3" and r["env"]["FABRIC_LITE_USE_CPU"] == "1"
        assert r["env"]["FABRIC_LITE_STRATEGY"] == "ddp"
        assert (r["world"], r["mixed_precision"], r["accum"], r["device"]) == (2, "bf16", 3, "cpu")

    out = tmp_path / "overridden"
    out.mkdir()
    proc = cli("launch", "--nproc-per-node", 1, "--mixed-precision", "fp16", "--gradient-accumulation-steps", 2,
               "--no-cpu", worker, "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = read_results(out, 1)
    assert r["env"]["WORLD_SIZE"] == "1" and r["env"]["FABRIC_LITE_MIXED_PRECISION"] == "16-mixed"
    assert r["env"]["FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS"] == "2" and r["env"]["FABRIC_LITE_USE_CPU"] is None
    assert (r["mixed_precision"], r["accum"]) == ("fp16", 2)

    # --config-file names another file, which wins over the default one
    other = tmp_path / "other.yaml"
    other.write_text("nproc_per_node: 1\nmixed_precision: no\n")
    out = tmp_path / "other"
    out.mkdir()
    proc = cli("launch", "--config-file", other, worker, "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"using config file {other}" in proc.stderr
    (r,) = read_results(out, 1)
    assert r["world"] == 1 and r["mixed_precision"] == "no" and r["accum"] == 1


BAD_CONFIGS = {
    "malformed_yaml": ("nproc_per_node: 2\n  mixed_precision: [bf16\n", "is not valid YAML"),
    "unknown_key": ("nproc_per_node: 2\nnum_processes: 2\n", "unknown key 'num_processes'"),
    "negative_count": ("nproc_per_node: -2\n", "nproc_per_node=-2"),
    "rank_past_nodes": ("compute_environment: multi_node\nnnodes: 2\nnode_rank: 3\n", "node_rank=3 must be < nnodes=2"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_launch_refuses_a_bad_config_file_in_one_line(config_dir, case):
    text, fragment = BAD_CONFIGS[case]
    config_dir.mkdir()
    (config_dir / "default_config.yaml").write_text(text)
    proc = cli("launch", "never_started.py")
    assert_one_line_error(proc, "fabric-lite launch: error:", str(config_dir / "default_config.yaml"), fragment)
    proc = cli("test")
    assert_one_line_error(proc, "fabric-lite test: error:", fragment)


@pytest.mark.parametrize("flags, fragment", [
    (("--nproc-per-node", "-2"), "--nproc-per-node=-2 must be a whole number >= 1"),
    (("--nproc-per-node", "many"), "--nproc-per-node='many'"),
    (("--nnodes", "2", "--node-rank", "2"), "--node-rank=2 must lie in 0..1"),
    (("--nnodes", "0"), "--nnodes='0' must be >= 1"),
    (("--gradient-accumulation-steps", "0"), "must be >= 1"),
    (("--config-file", "/no/such/config.yaml"), "/no/such/config.yaml does not exist"),
], ids=["negative_nproc", "word_nproc", "node_rank_past_nnodes", "zero_nodes", "zero_accumulation", "missing_config"])
def test_launch_refuses_bad_flags_in_one_line(config_dir, flags, fragment):
    proc = cli("launch", *flags, "never_started.py")
    assert_one_line_error(proc, "fabric-lite launch: error:", fragment)


@pytest.mark.parametrize("bind_to", ["127.0.0.1", "0.0.0.0"])
def test_launch_refuses_a_master_port_in_use(config_dir, bind_to):
    with socket.socket() as held:
        held.bind((bind_to, 0))
        held.listen()
        port = held.getsockname()[1]
        proc = cli("launch", "--nnodes", 1, "--master-port", port, "never_started.py")
        assert_one_line_error(proc, f"--master-port={port} is already in use")
        # the same port from a config file: the same refusal, naming the file
        config_dir.mkdir(exist_ok=True)
        (config_dir / "default_config.yaml").write_text(f"master_port: {port}\n")
        proc = cli("launch", "never_started.py")
        assert_one_line_error(proc, f"--master-port={port} is already in use", "config file")


# -- fabric-lite test --------------------------------------------------------------------------------------

CHECK_NAMES = ("gather", "reduce", "broadcast", "pad_across_processes", "gather_for_metrics", "wait_for_everyone",
               "ddp training parity", "checkpoint round-trip")


@pytest.mark.slow
def test_selftest_passes_on_two_processes_and_on_the_configured_setup(config_dir):
    start = time.monotonic()
    proc = cli("test", timeout=120)  # no config file: 2 processes on CPU/gloo
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 process(es), DDPStrategy, device cpu, backend gloo" in proc.stdout
    for name in CHECK_NAMES:
        assert f"ok    {name}: " in proc.stdout, name
    assert proc.stdout.strip().splitlines()[-1] == "All checks passed."
    assert "2 x batch 4 == 1 x batch 8" in proc.stdout
    print(f"fabric-lite test took {elapsed:.1f}s")
    # with a config file: its process count and precision
    assert cli("config", "--nproc-per-node", 1, "--mixed-precision", "bf16", "--cpu").returncode == 0
    proc = cli("test", timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "1 process(es)" in proc.stdout and "mixed precision bf16" in proc.stdout
    assert "All checks passed." in proc.stdout


@pytest.mark.slow
def test_selftest_reports_a_broken_collective_and_exits_nonzero(config_dir, tmp_path):
    proc = cli("launch", "--nproc-per-node", 2, WORKERS / "cli_selftest_broken.py", "--workdir", tmp_path,
               timeout=120)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL  reduce: rank 0: AssertionError: sum gave" in proc.stdout
    assert "ok    gather: " in proc.stdout and "ok    checkpoint round-trip" in proc.stdout
    assert "Traceback" not in proc.stderr  # a verdict, not a crash


# -- a real 2-node job on this machine ------------------------------------------------------------------

@pytest.mark.slow
def test_two_node_job_equals_two_processes_on_one_node(config_dir, tmp_path):
    worker = WORKERS / "cli_train.py"
    port = free_port()
    nodes = tmp_path / "nodes"
    nodes.mkdir()

    def node(rank):
        return cli("launch", "--nnodes", 2, "--node-rank", rank, "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
                   "--master-port", port, worker, "--out", nodes, timeout=180)

    with ThreadPoolExecutor(2) as pool:  # both machines start at once, as on a cluster
        procs = list(pool.map(node, [0, 1]))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    single = tmp_path / "single"
    single.mkdir()
    proc = cli("launch", "--nproc-per-node", 2, worker, "--out", single, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]

    two_nodes, one_node = read_results(nodes, 2), read_results(single, 2)
    assert [(r["rank"], r["world"], r["node_rank"], r["local_rank"]) for r in two_nodes] == [(0, 2, 0, 0), (1, 2, 1, 0)]
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in one_node] == [(0, 0, 0), (1, 0, 1)]
    assert all(r["strategy"] == "DDPStrategy" for r in two_nodes + one_node)
    assert two_nodes[0]["seen"] == one_node[0]["seen"]  # the same samples in the same global steps
    w_nodes, w_single = torch.tensor(two_nodes[0]["weights"]), torch.tensor(one_node[0]["weights"])
    assert torch.allclose(w_nodes, w_single, atol=1e-6, rtol=0), (w_nodes - w_single).abs().max()
    assert two_nodes[0]["weights"] == two_nodes[1]["weights"]


def test_torchrun_users_are_told_their_config_file_is_not_read(tmp_path):
    config_dir = tmp_path / "cfg"
    assert run_command([sys.executable, "-m", "fabric_lite.cli", "config", "--default"],
                       env={"FABRIC_LITE_CONFIG_DIR": str(config_dir)}, timeout=60).returncode == 0
    script = tmp_path / "s.py"
    script.write_text("from fabric_lite import Accelerator\nAccelerator()\n")
    env = {"FABRIC_LITE_CONFIG_DIR": str(config_dir)}
    torchrun = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-port", str(free_port()), str(script)], env=env, timeout=120)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert torchrun.stderr.count("is not read: the processes were started by torchrun") == 1
    ours = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], env=env, timeout=120)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "is not read" not in ours.stderr
