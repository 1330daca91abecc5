"""`fabric-lite launch` takes `accelerate launch` command lines: Accelerate's flags in both spellings,
script arguments untouched, one-line errors for typos, and torchrun_command for the Trainer's relaunch."""

import json
import sys
import textwrap

import pytest

from conftest import free_port, run_command
from fabric_lite.cli.launch_flags import launch_command_parser, resolve_accelerate_flags
from fabric_lite.launch.launch_checks import LaunchError
from fabric_lite.launch.launcher import torchrun_command

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "fabric_lite.cli"]

# A worker that needs no torch: it records its argv and the launch's variables.
ARGV_WORKER = textwrap.dedent('''
    import json, os, sys
    out = sys.argv[sys.argv.index("--out") + 1]
    keys = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "FABRIC_LITE_MIXED_PRECISION", "FABRIC_LITE_STRATEGY",
            "FABRIC_LITE_USE_CPU", "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "OMP_NUM_THREADS")
    with open(os.path.join(out, "rank%s.json" % os.environ.get("RANK", "0")), "w") as f:
        json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}, f)
''')


@pytest.fixture(autouse=True)
def _no_user_configs(tmp_path, monkeypatch):
    """Neither the developer's fabric_lite config nor their Accelerate config is read here."""
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(tmp_path / "no_fabric_config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no_hf_home"))
    for name in ("XDG_CACHE_HOME", "PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_PORT",
                 "PET_MASTER_ADDR", "PET_RDZV_BACKEND"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "argv_worker.py"
    path.write_text(ARGV_WORKER)
    return path


def parse(*argv):
    args = launch_command_parser().parse_args(list(argv))
    env, ignored = resolve_accelerate_flags(args)
    return args, env, ignored


TORCHRUN_FIELDS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend",
                   "max_restarts", "monitor_interval", "module", "no_python", "training_script",
                   "training_script_args", "cpu", "mixed_precision", "gradient_accumulation_steps", "strategy")


def fields(args):
    return {name: getattr(args, name) for name in TORCHRUN_FIELDS}


# -- parsing (no processes) ---------------------------------------------------------------------------

def test_accelerate_and_torchrun_spellings_give_the_same_launch():
    accelerate = ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip",
                  "10.0.0.7", "--main_process_port", "29600", "--mixed_precision", "bf16",
                  "--gradient_accumulation_steps", "2", "--use_cpu", "--rdzv_backend", "static", "--max_restarts",
                  "1", "--monitor_interval", "0.5", "train.py", "--lr", "1"]
    dashes = [a.replace("_", "-") if a.startswith("--") else a for a in accelerate]
    equals = []
    tokens = iter(accelerate[:-3])
    for flag in tokens:
        equals.append(flag if flag == "--use_cpu" else f"{flag}={next(tokens)}")
    equals += accelerate[-3:]
    torchrun = ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7",
                "--master-port", "29600", "--mixed-precision", "bf16", "--gradient-accumulation-steps", "2", "--cpu",
                "--rdzv-backend", "static", "--max-restarts", "1", "--monitor-interval", "0.5", "train.py", "--lr", "1"]
    expected = fields(parse(*torchrun)[0])
    assert expected["nproc_per_node"] == "2" and expected["training_script_args"] == ["--lr", "1"]
    for argv in (accelerate, dashes, equals):
        assert fields(parse(*argv)[0]) == expected, argv


def test_torchrun_defaults_are_unchanged_by_the_new_flags():
    from torch.distributed.run import get_args_parser

    ours = vars(launch_command_parser().parse_args(["train.py"]))
    theirs = vars(get_args_parser().parse_args(["train.py"]))
    theirs["master_port"] = None  # (fabric-lite picks a free port on one machine: test_launch.py)
    assert {k: ours[k] for k in theirs} == theirs


@pytest.mark.parametrize("argv, per_node, nnodes", [
    (["--num_processes", "2"], "2", "1:1"),                                     # one machine: all of them here
    (["--num_processes=6", "--num_machines=3"], "2", "3"),                      # the total over 3 machines
    (["--num-processes", "4", "--nnodes", "2"], "2", "2"),                      # torchrun's --nnodes counts too
    (["--num_processes", "4", "--num_machines", "2", "--nproc-per-node", "2"], "2", "2"),  # agreeing: fine
])
def test_num_processes_is_the_total_over_every_machine(argv, per_node, nnodes):
    args, _, _ = parse(*argv, "train.py")
    assert (args.nproc_per_node, args.nnodes, args.num_processes) == (per_node, nnodes, None)


@pytest.mark.parametrize("argv, fragment", [
    (["--num_processes", "3", "--num_machines", "2"], "--num_processes=3 is the total over 2 machine(s)"),
    (["--num_processes", "4", "--num_machines", "2", "--nproc-per-node", "3"], "means 2 per machine"),
    (["--num_processes", "4", "--nnodes", "1:2"], "elastic range"),
    (["--multi_gpu", "--cpu"], "--multi_gpu and --cpu ask for two different devices"),
    (["--use_deepspeed", "--use_fsdp"], "pass one of them"),
    (["--use_fsdp", "--strategy", "ddp"], "--use_fsdp asks for strategy fsdp, but --strategy ddp"),
    (["--use_megatron_lm"], "no Megatron-LM"),
])
def test_accelerate_flags_that_cannot_work_are_refused(argv, fragment):
    with pytest.raises(LaunchError) as info:
        parse(*argv, "train.py")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_accelerate_flags_map_to_strategies_and_worker_settings(tmp_path):
    assert parse("--use_fsdp", "t.py")[0].strategy == "fsdp"
    assert parse("--use_deepspeed", "t.py")[0].strategy == "deepspeed"
    assert parse("--use_deepspeed", "--zero_stage", "3", "--offload_param_device", "cpu", "t.py")[0].strategy == \
        "deepspeed_stage_3_offload"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                              "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": "auto"}))
    args = parse("--deepspeed_config_file", str(ds), "t.py")[0]
    assert (args.strategy, args.gradient_accumulation_steps) == ("deepspeed_stage_2_offload", 4)
    args, env, ignored = parse("--multi_gpu", "--num_processes", "2", "--num_cpu_threads_per_process", "3",
                               "--same_network", "--debug", "t.py")
    assert (args.nproc_per_node, args.cpu, args.debug, env, ignored) == ("2", False, True, {"OMP_NUM_THREADS": "3"}, [])
    # several machines over c10d: they meet at the main process (as with Accelerate)
    args = parse("--num_machines", "2", "--rdzv_backend", "c10d", "--main_process_ip", "10.0.0.1",
                 "--main_process_port", "29400", "t.py")[0]
    assert args.rdzv_endpoint == "10.0.0.1:29400"


def test_flags_with_no_meaning_here_are_accepted_and_named_once():
    args, _, ignored = parse("--ipex", "--tpu_use_cluster", "--dynamo_backend", "inductor", "--dynamo-backend=no",
                             "--fsdp_sharding_strategy", "FULL_SHARD", "-q", "--aws_access_key_id=x", "train.py", "--ipex")
    assert ignored == ["--quiet", "--ipex", "--dynamo_backend", "--tpu_use_cluster", "--fsdp_sharding_strategy",
                       "--aws_access_key_id"]
    assert args.training_script_args == ["--ipex"]  # the script's own --ipex is the script's
    assert parse("--dynamo_backend", "no", "train.py")[2] == []  # asks for nothing: no notice


@pytest.mark.parametrize("argv, script, script_args", [
    (["--nproc-per-node", "2", "train.py", "--run", "x"], "train.py", ["--run", "x"]),     # torchrun: ambiguous
    (["--nproc_per_node=2", "train.py", "--nproc-per-node", "5", "-h"], "train.py", ["--nproc-per-node", "5", "-h"]),
    (["-m", "pkg.train", "--node", "3"], "pkg.train", ["--node", "3"]),
    (["--node-rank", "0", "--", "train.py", "--", "--x"], "train.py", ["--", "--x"]),
    (["-r3", "--no_python", "run.sh", "--max", "2"], "run.sh", ["--max", "2"]),
])
def test_nothing_after_the_script_is_read_by_the_launcher(argv, script, script_args):
    args = launch_command_parser().parse_args(argv)
    assert (args.training_script, args.training_script_args) == (script, script_args)


def test_an_unknown_flag_is_one_line_with_the_nearest_flag():
    proc = run_command([*CLI, "launch", "--num_proceses", "2", "train.py"], timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["usage: fabric-lite launch [options] training_script [training_script_args ...]",
                     "fabric-lite launch: error: unrecognized argument --num_proceses (did you mean --num_processes?)"]


# -- real launches -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_num_processes_starts_that_many_workers_and_script_args_reach_them_untouched(worker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script_args = ["--run", "x", "--nproc-per-node", "5", "--num_processes=9", "--", "-m", "y"]
    proc = run_command([*CLI, "launch", "--num_processes=2", "--use_cpu", "--mixed_precision", "bf16",
                        "--main_process_port", str(free_port()), str(worker), *script_args, "--out", str(out)],
                       timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["argv"] == [*script_args, "--out", str(out)]
        assert result["env"]["WORLD_SIZE"] == "2" and result["env"]["FABRIC_LITE_MIXED_PRECISION"] == "bf16-mixed"
        assert result["env"]["FABRIC_LITE_USE_CPU"] == "1"
    assert not (out / "rank2.json").exists()


@pytest.mark.slow
def test_torchrun_command_protects_the_script_args(worker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # `--run x` alone would stop torchrun's parser: "ambiguous option: --run could match --run-path, --run_path"
    cmd = torchrun_command(2, 1, str(worker), ["--run", "x", "--nnodes", "4", "--out", str(out)])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and cmd[cmd.index(str(worker)) - 1] == "--"
    proc = run_command(cmd, timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["argv"] == ["--run", "x", "--nnodes", "4", "--out", str(out)]
        assert result["env"]["WORLD_SIZE"] == "2"
