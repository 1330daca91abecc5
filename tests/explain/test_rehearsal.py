"""`fabric-lite explain --rehearse`: one real training step of the script as rank 0 of the planned world (64 and 512
ranks here) on torch's fake process group, in one CPU process; the bytes it reports agree with a real 4-process run;
mesh mistakes are refused naming the sizes."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import WORKERS, run_command, torchrun

pytestmark = pytest.mark.timeout(300)

SCRIPT = WORKERS / "rehearse_script.py"
HIDDEN = 1024
PARAMETERS = 256 * HIDDEN + HIDDEN + HIDDEN * 256 + 256  # the script's two Linear layers
ND = ("--use_parallelism_config", "--parallelism_config_dp_shard_size")


def rehearse(*args, timeout=180):
    return run_command([sys.executable, "-m", "fabric_lite.cli", "explain", "--rehearse", *map(str, args)],
                       timeout=timeout)


def report(out: str) -> dict:
    """The rehearsal's figures: bytes by kind, and {(kind, group): (calls, bytes, ranks)}."""
    assert "Rehearsal: one training step as rank 0 of" in out, out
    text = out[out.index("Rehearsal:"):]
    values = {label: int(n.replace(",", "")) for label, n in
              re.findall(r"^    (parameters|gradients|optimizer state|total)\s+([\d,]+) B", text, re.MULTILINE)}
    collectives = {}
    for kind, calls, size, group, ranks in re.findall(
            r"^    (\w+)\s+(\d+) call\(s\)\s+([\d,]+) B .* over (\w+) \((\d+) ranks\)", text, re.MULTILINE):
        collectives[(kind, group)] = (int(calls), int(size.replace(",", "")), int(ranks))
    world = int(re.search(r"as rank 0 of (\d+)", text).group(1))
    return {"world": world, "bytes": values, "collectives": collectives, "text": text}


def test_fsdp_by_tensor_parallel_at_64_ranks(tmp_path):
    proc = rehearse("--num_processes", 64, *ND, 8, "--parallelism_config_tp_size", 8, SCRIPT, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = report(proc.stdout)
    assert r["world"] == 64
    assert "mesh dp=8 x tp=8 (dp_replicate=1 x dp_shard=8 x tp=8)" in r["text"]
    # every weight is split 8 ways by tensor parallelism and 8 ways by FSDP: rank 0 holds 1/64 (plus FSDP's padding
    # of the one bias replicated over tp: at most a row per weight)
    held = r["bytes"]["parameters"]
    assert PARAMETERS * 4 / 64 <= held <= PARAMETERS * 4 / 64 * 1.01, held
    assert r["bytes"]["gradients"] == held
    assert held * 2 <= r["bytes"]["optimizer state"] <= held * 2 + 64  # AdamW's two moments (+ step counts)
    c = r["collectives"]
    # the whole model is one FSDP group: gathered for each forward and backward of the 2 micro-batches, its
    # gradients reduce-scattered once (accumulation syncs at the second), over the 8 ranks of dp_shard
    assert c[("all_gather", "dp_shard")][:1] == (4,) and c[("all_gather", "dp_shard")][2] == 8
    assert c[("reduce_scatter", "dp_shard")][:1] == (1,)
    # each rank's all-gather buffer holds its tensor-parallel slice of the whole model: 1/8 of it
    assert c[("all_gather", "dp_shard")][1] // 4 >= PARAMETERS * 4 / 8
    # the row-parallel layer's output is summed over tp in each forward, and clipping's norm over both dimensions
    assert c[("all_reduce", "tp")][0] == 3 and c[("all_reduce", "tp")][2] == 8
    assert c[("all_reduce", "dp_shard")][0] == 1
    assert not (tmp_path / "rank0.json").exists()  # the script stopped at its first optimizer step


def test_ddp_at_512_ranks(tmp_path):
    proc = rehearse("--num_processes", 512, SCRIPT, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = report(proc.stdout)
    assert r["world"] == 512 and "strategy          ddp; mesh dp=512" in r["text"]
    assert r["bytes"]["parameters"] == r["bytes"]["gradients"] == PARAMETERS * 4  # DDP: every rank holds it all
    # one bucket's all-reduce over the world, at the step that syncs (the first micro-batch does not)
    calls, size, ranks = r["collectives"][("all_reduce", "world")]
    assert ranks == 512 and size >= PARAMETERS * 4


def test_the_trainer_with_model_parallel_strategy_at_8_nodes_of_8(tmp_path):
    proc = rehearse("--nproc-per-node", 8, "--nnodes", 8, WORKERS / "rehearse_trainer.py", "--out", tmp_path,
                    "--nodes", 8, "--devices", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = report(proc.stdout)
    assert r["world"] == 64 and "mesh dp=8 x tp=8" in r["text"]
    assert "8 data-parallel process(es) (of 64)" in proc.stdout  # the plan's effective batch
    assert PARAMETERS * 4 / 64 <= r["bytes"]["parameters"] <= PARAMETERS * 4 / 64 * 1.01
    assert r["bytes"]["gradients"] == r["bytes"]["parameters"]
    assert r["collectives"][("reduce_scatter", "data_parallel")][2] == 8
    assert r["collectives"][("all_reduce", "tensor_parallel")][2] == 8
    assert "not run: the Trainer's sanity check (2 validation batch(es))" in r["text"]
    assert not (tmp_path / "trained.marker").exists()


@pytest.mark.slow
def test_the_rehearsed_bytes_are_those_a_real_4_process_run_allocates(tmp_path):
    """FSDP x TP on 2 x 2: rank 0 of the rehearsal holds what every rank of a real gloo run allocates (the real run
    counts distinct storages; the rehearsal sums local shards) -- within 5 %, measured equal."""
    flags = ("--num_processes", 4, *ND, 2, "--parallelism_config_tp_size", 2)
    proc = rehearse(*flags, SCRIPT, "--out", tmp_path / "rehearsal")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rehearsed = report(proc.stdout)["bytes"]
    real = torchrun(SCRIPT, 4, out_dir=tmp_path, launcher="fabric-lite", timeout=240,
                    launcher_args=("--oversubscribe", *map(str, flags[2:])))
    for rank, measured in enumerate(real):
        for label, key in (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"),
                           ("optimizer state", "optimizer_state_bytes")):
            assert abs(rehearsed[label] - measured[key]) <= 0.05 * measured[key], (rank, label, rehearsed, measured)


def test_sizes_that_do_not_fill_the_world_are_refused_before_the_script_runs(tmp_path):
    proc = rehearse("--num_processes", 64, *ND, 8, "--parallelism_config_tp_size", 6, SCRIPT, "--out", tmp_path)
    assert proc.returncode == 2
    assert "multiply to 48 processes (dp_replicate 1 x dp_shard 8 x tp 6), but this launch starts 64" in proc.stderr
    assert proc.stdout.strip() == ""  # (no plan: the script did not start)


def test_hsdp_with_tensor_parallelism_and_no_shard_dimension_is_refused_before_the_script_runs(tmp_path):
    proc = rehearse("--num_processes", 64, "--use_parallelism_config", "--parallelism_config_dp_replicate_size", 8,
                    "--parallelism_config_tp_size", 8, SCRIPT, "--out", tmp_path)
    assert proc.returncode == 2
    assert "dp_replicate_size=8 with tp_size=8 and dp_shard_size=1" in proc.stderr
    assert proc.stdout.strip() == ""


def test_a_tensor_parallel_size_that_does_not_divide_a_weight_is_refused_naming_it(tmp_path):
    proc = rehearse("--num_processes", 64, *ND, 8, "--parallelism_config_tp_size", 8, SCRIPT, "--out", tmp_path,
                    "--hidden", 1020)
    assert proc.returncode == 1
    assert ("Sequential's weight '0.weight' (shape (1020, 256)) is split along its dimension 0 over 8 ranks of mesh "
            "dimension 'tp', but 1020 does not divide by 8") in proc.stderr
    # the suggestion divides both the weight and the world: 1020 = 6 x 170, but 64 ranks do not split 6 ways
    assert "the largest below 8: 4" in proc.stderr
    assert "Rehearsal" not in proc.stdout


def test_a_script_that_takes_no_step_says_so(tmp_path):
    proc = rehearse("--num_processes", 8, SCRIPT, "--out", tmp_path, "--no-step")
    assert proc.returncode == 1
    assert "there was no step to rehearse" in proc.stderr


def test_a_llama_style_model_at_64_ranks(tmp_path):
    """The attention's and feed-forward's row-parallel projections sum their outputs over tp in each forward (2 per
    block); backward sums the inputs' gradients of the 5 column-parallel ones; clipping adds one norm."""
    layers = 2
    proc = rehearse("--num_processes", 64, *ND, 8, "--parallelism_config_tp_size", 8, WORKERS / "rehearse_llama.py",
                    "--out", tmp_path, "--dim", 128, "--layers", layers, "--heads", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = report(proc.stdout)["collectives"]
    assert c[("all_reduce", "tp")][0] == layers * (2 + 5) + 1
    assert c[("reduce_scatter", "dp_shard")][0] == 1


def test_a_ddp_communication_hook_is_refused_in_one_sentence(tmp_path):
    script = tmp_path / "hooked.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from fabric_lite import Accelerator\n"
        "from fabric_lite.utils import DDPCommunicationHookType, DistributedDataParallelKwargs\n"
        "acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])\n"
        "model = torch.nn.Linear(8, 8)\n"
        "model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "
        "DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))\n")
    proc = rehearse("--num_processes", 8, script)
    assert proc.returncode == 1
    assert "the model has a DDP communication hook of its own (comm_hook=...)" in proc.stderr
