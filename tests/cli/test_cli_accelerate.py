"""Accelerate's config file (`accelerate config`'s default_config.yaml) read by `fabric-lite launch`, and
both spellings of every flag of `fabric-lite config` / `test` / `env`."""

import importlib.util
import json
import sys

import pytest

from conftest import free_port, run_command
from test_launch_flags import ARGV_WORKER
from fabric_lite.launch.config_file import (
    AccelerateConfig, ConfigError, accelerate_config_path, find_config, parse_config,
)
from fabric_lite.cli.launch_command import parse_with_config
from fabric_lite.cli.launch_flags import launch_command_parser, resolve_accelerate_flags

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "fabric_lite.cli"]

# What `accelerate config` writes for 2 machines x 2 GPUs (machine 1 of 2), with torch dynamo on.
ACCELERATE_MULTI_GPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
dynamo_config:
  dynamo_backend: INDUCTOR
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 1
main_process_ip: 10.0.0.7
main_process_port: 29555
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# One machine, 2 CPU processes (what `accelerate config` writes for "multi-CPU").
ACCELERATE_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: true
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
ipex_config:
  ipex: false
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
mpirun_config: {}
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """(fabric_lite's config dir, HF_HOME), both empty and private to the test."""
    fabric, hf = tmp_path / "fabric_config", tmp_path / "hf_home"
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(fabric))
    monkeypatch.setenv("HF_HOME", str(hf))
    for name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK",
                 "PET_MASTER_PORT", "PET_MASTER_ADDR", "PET_RDZV_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    return fabric, hf


def cli(*args, timeout=60):
    return run_command([*CLI, *map(str, args)], timeout=timeout)


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) <= 2, proc.stderr  # (argparse's: usage + error)
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


# -- the file (no processes) -------------------------------------------------------------------------

def test_accelerate_default_location_follows_hf_home_and_xdg_cache(tmp_path):
    assert accelerate_config_path({"HF_HOME": "/hf", "XDG_CACHE_HOME": "/c"}).as_posix() == \
        "/hf/accelerate/default_config.yaml"
    assert accelerate_config_path({"XDG_CACHE_HOME": "/c"}).as_posix() == \
        "/c/huggingface/accelerate/default_config.yaml"
    assert accelerate_config_path({"HOME": "/h"}).as_posix() == "/h/.cache/huggingface/accelerate/default_config.yaml"
    legacy = tmp_path / "accelerate" / "default_config.json"  # older Accelerate wrote JSON
    legacy.parent.mkdir()
    legacy.write_text("{}")
    assert accelerate_config_path({"HF_HOME": str(tmp_path)}) == legacy
    # a fabric_lite config wins over Accelerate's; Accelerate's is used where there is none
    fabric, hf = tmp_path / "fabric", tmp_path / "hf"
    (hf / "accelerate").mkdir(parents=True)
    (hf / "accelerate" / "default_config.yaml").write_text(ACCELERATE_MULTI_CPU)
    env = {"FABRIC_LITE_CONFIG_DIR": str(fabric), "HF_HOME": str(hf)}
    assert find_config(None, env) == hf / "accelerate" / "default_config.yaml"
    fabric.mkdir()
    (fabric / "default_config.yaml").write_text("nproc_per_node: 1\n")
    assert find_config(None, env) == fabric / "default_config.yaml"


def test_an_accelerate_file_maps_to_launch_settings():
    config = parse_config(ACCELERATE_MULTI_GPU, "acc.yaml")
    assert isinstance(config, AccelerateConfig)
    assert (config.nproc_per_node, config.num_processes, config.nnodes, config.node_rank) == (2, 4, 2, 1)
    assert (config.master_addr, config.master_port, config.mixed_precision, config.use_cpu) == \
        ("10.0.0.7", 29555, "bf16", False)
    assert (config.strategy, config.compute_environment, config.tpu, config.gpu_ids) == \
        ("auto", "multi_node", False, None)
    assert config.ignored == ("dynamo_config (dynamo_backend)",)  # keys left at their off values are not listed
    cpu = parse_config(ACCELERATE_MULTI_CPU)
    assert (cpu.nproc_per_node, cpu.use_cpu, cpu.master_port, cpu.ignored) == (2, True, None, ("debug",))

    deepspeed = parse_config("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
                             "  offload_optimizer_device: cpu\n  offload_param_device: none\n"
                             "  gradient_accumulation_steps: 4\n  gradient_clipping: 1.0\n  zero3_init_flag: false\n")
    assert (deepspeed.strategy, deepspeed.gradient_accumulation_steps) == ("deepspeed_stage_3_offload", 4)
    assert deepspeed.ignored == ("deepspeed_config.gradient_clipping",)
    fsdp = parse_config("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                        "  fsdp_offload_params: false\n")
    assert (fsdp.strategy, fsdp.ignored) == ("fsdp", ("fsdp_config (fsdp_sharding_strategy)",))
    xla = parse_config("distributed_type: XLA\nnum_processes: 8\nmain_training_function: main\n")
    assert (xla.tpu, xla.num_processes, xla.nproc_per_node, xla.main_training_function) == (True, 8, 1, "main")
    # `num_processes` alone (no fabric_lite key) is Accelerate's too
    assert parse_config("num_processes: 2\nmixed_precision: fp16\n").nproc_per_node == 2


@pytest.mark.parametrize("text, fragment", [
    ("distributed_type: MULTI_GPU\nnum_processes: 3\nnum_machines: 2\n", "num_processes=3 is the total over "
                                                                         "num_machines=2"),
    ("compute_environment: AMAZON_SAGEMAKER\n", "SageMaker"),
    ("distributed_type: MEGATRON_LM\n", "no Megatron-LM"),
    ("distributed_type: MULTI_GPU\nmachine_rank: 1\n", "machine_rank=1 must be < num_machines=1"),
    ("distributed_type: WARP_DRIVE\n", "distributed_type='WARP_DRIVE'"),
    # a fabric_lite file stays fabric_lite's: a misspelt or Accelerate-named key is refused, with a hint
    ("nproc_per_node: 2\nnum_processes: 2\n", "unknown key 'num_processes' (did you mean nproc_per_node"),
    ("nproc_per_nod: 2\n", "unknown key 'nproc_per_nod' (did you mean nproc_per_node?)"),
])
def test_config_files_that_cannot_work_are_refused_in_one_line(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.yaml")
    assert fragment in str(info.value) and str(info.value).startswith("my.yaml: ") and "\n" not in str(info.value)


# The keys and values of Accelerate's examples/config_yaml_templates/fp8.yaml (TransformerEngine, one GPU).
ACCELERATE_FP8_TEMPLATE = """\
distributed_type: "NO"
mixed_precision: "fp8"
fp8_config:
  backend: TE
  amax_history_len: 1024
  fp8_format: E4M3
  interval: 1
  margin: 0
  override_linear_precision: [false, false, false]
  use_autocast_during_eval: false
"""


def test_accelerates_fp8_template_is_read_and_the_launch_stops_at_the_accelerators_hardware_check(
        homes, tmp_path, capsys):
    from fabric_lite.cli.launch_command import launch_command
    from fabric_lite.strategies.fp8 import machine_problem

    config = parse_config(ACCELERATE_FP8_TEMPLATE)
    assert isinstance(config, AccelerateConfig)
    assert (config.mixed_precision, config.fp8_backend, config.nproc_per_node) == ("fp8", "TE", 1)
    assert config.ignored == ("fp8_config (backend, amax_history_len, fp8_format, interval, margin)",)
    assert parse_config("mixed_precision: FP8\nfp8_config:\n  backend: msamp\n").fp8_backend == "MSAMP"
    path = tmp_path / "fp8.yaml"
    path.write_text(ACCELERATE_FP8_TEMPLATE)
    worker = tmp_path / "worker.py"
    marker = tmp_path / "started"
    worker.write_text(f"open({str(marker)!r}, 'w').close()\n")
    problem = machine_problem()
    if problem is None:
        pytest.skip("this machine has a GPU that computes in fp8: the launch goes on (see test_fp8.py's GPU test)")
    for argv, extra in (
            (["--config_file", str(path)], ["The config's fp8_config asks for TransformerEngine (backend: TE)",
                                             "kwargs_handlers=[TERecipeKwargs(...)]",
                                             f"(defaults from config file {path})"]),
            (["--mixed_precision", "fp8"], []),
            (["--mixed-precision=FP8", "--nproc-per-node", "2"], [])):
        assert launch_command([*argv, str(worker)], env=dict(FABRIC_LITE_CONFIG_DIR=str(homes[0]),
                                                              HF_HOME=str(homes[1]))) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err, err
        # the Accelerator's own words: Accelerator(mixed_precision='fp8') says `problem` after its prefix
        assert err.startswith(f"fabric-lite launch: error: --mixed-precision fp8: {problem}"), err
        for fragment in extra:
            assert fragment in err, err
        if "backend: TE" in " ".join(extra):
            assert ("transformer_engine (not installed here: pip install 'transformer_engine[pytorch]'" in err) != \
                (importlib.util.find_spec("transformer_engine") is not None), err
    assert not marker.exists()  # refused before any worker started
    # --cpu: the check of a run on the CPU (what the worker's strategy would say), still before starting
    assert launch_command(["--mixed_precision", "fp8", "--cpu", str(worker)], env=dict(
        FABRIC_LITE_CONFIG_DIR=str(homes[0]), HF_HOME=str(homes[1]))) == 2
    assert "the run would train on 'cpu'" in capsys.readouterr().err and not marker.exists()


@pytest.mark.parametrize("text, fragment", [
    ("main_process_port: 70000\n", "main_process_port=70000 must lie in 1..65535"),
    ("main_process_port: abc\n", "main_process_port='abc' is not a whole number"),
    ("main_process_ip: 5\n", "main_process_ip=5 must be a host name or an IP address"),
    ("num_machines: 2\nmachine_rank: 2\nnum_processes: 2\n", "machine_rank=2 must be < num_machines=2"),
], ids=["port_range", "port_word", "ip_number", "rank_past_machines"])
def test_an_accelerate_file_is_refused_naming_the_keys_as_written(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(f"distributed_type: MULTI_GPU\n{text}", "acc.yaml")
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    for mapped in ("master_port", "master_addr", "node_rank", "nnodes"):
        assert mapped not in message, message


def test_config_file_flag_reads_accelerate_and_flags_win(homes, tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(ACCELERATE_MULTI_GPU)

    def launch(*flags):
        parser = launch_command_parser()
        flags, args, config_path, config = parse_with_config(parser, [*flags, "train.py"], dict(
            FABRIC_LITE_CONFIG_DIR=str(homes[0]), HF_HOME=str(homes[1])))
        resolve_accelerate_flags(args, config)
        assert config_path == path and isinstance(config, AccelerateConfig)
        return args

    args = launch("--config_file", str(path))
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port) == \
        ("2", "2", 1, "10.0.0.7", 29555)
    assert (args.mixed_precision, args.cpu, args.rdzv_backend) == ("bf16", False, "static")
    # the total of 4 over the machines given on the command line, as Accelerate divides it
    args = launch("--config-file=" + str(path), "--num_machines", "1", "--machine_rank", "0")
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("4", "1", 0)
    args = launch("--config_file", str(path), "--nproc-per-node", "1", "--mixed-precision", "no")
    assert (args.nproc_per_node, args.mixed_precision) == ("1", "no")  # per machine, given: wins over the total


# -- the commands ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_launch_uses_accelerates_default_config_and_names_what_it_ignores(homes, tmp_path):
    _, hf = homes
    (hf / "accelerate").mkdir(parents=True)
    (hf / "accelerate" / "default_config.yaml").write_text(ACCELERATE_MULTI_CPU)
    worker = tmp_path / "worker.py"
    worker.write_text(ARGV_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    proc = cli("launch", "--main_process_port", free_port(), "--ipex", worker, "--run", "x", "--out", out, timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notices = [line for line in proc.stderr.splitlines() if line.startswith("fabric-lite launch:")]
    assert notices == [
        f"fabric-lite launch: using Accelerate config file {hf / 'accelerate' / 'default_config.yaml'}; "
        f"ignored, no meaning here: debug",
        "fabric-lite launch: ignoring Accelerate flags that have no meaning here: --ipex"]
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["argv"] == ["--run", "x", "--out", str(out)]
        assert result["env"]["WORLD_SIZE"] == "2" and result["env"]["FABRIC_LITE_MIXED_PRECISION"] == "bf16-mixed"
        assert result["env"]["FABRIC_LITE_USE_CPU"] == "1"
    # `fabric-lite env` shows the file in force, and how it reads it
    proc = cli("env")
    assert proc.returncode == 0, proc.stderr
    assert f"config      {hf / 'accelerate' / 'default_config.yaml'} (Accelerate's format: 2 process(es) per " \
           f"machine on 1 machine(s)" in proc.stdout
    assert "distributed_type: MULTI_CPU" in proc.stdout


def test_config_takes_both_spellings_and_suggests_the_nearest_flag(homes, tmp_path):
    target = tmp_path / "c.yaml"
    proc = cli("config", "--config_file", target, "--num_processes", 2, "--mixed_precision=bf16",
               "--gradient_accumulation_steps", 3, "--use_cpu", "--num_machines", 2, "--machine_rank", 1,
               "--main_process_ip", "10.0.0.1", "--main-process-port=29400", "--compute_environment", "multi_node")
    assert proc.returncode == 0, proc.stderr
    config = parse_config(target.read_text())
    assert (config.nproc_per_node, config.mixed_precision, config.gradient_accumulation_steps, config.use_cpu) == \
        (2, "bf16", 3, True)
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (2, 1, "10.0.0.1", 29400)
    proc = cli("config", "--config_file", target, "--no_cpu", "--nproc_per_node", 1)
    assert proc.returncode == 0 and parse_config(target.read_text()).use_cpu is False, proc.stderr
    one_line_error(cli("config", "--mixed_precison", "bf16"),
                   "fabric-lite config: error: unrecognized argument --mixed_precison (did you mean --mixed_precision?)")


@pytest.mark.parametrize("flag", ["--num_processes", "--num-processes", "--nproc_per_node", "--nproc-per-node"])
def test_test_takes_both_spellings(homes, flag):
    one_line_error(cli("test", f"{flag}=0"), "fabric-lite test: error: --nproc-per-node=0 must be >= 1")


def test_env_and_consolidate_take_both_spellings(homes, tmp_path):
    one_line_error(cli("env", "--config_fil", "x"), "did you mean --config_file?")
    proc = cli("consolidate", tmp_path / "missing", tmp_path / "out.pt", "--model_index", 0)
    assert proc.returncode == 2 and "unrecognized" not in proc.stderr, proc.stderr
