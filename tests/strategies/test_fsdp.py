"""FSDP2 (strategy="fsdp"): what the conformance suite does not already assert for every strategy.

- against DDP in the same processes: fp32 weights after accumulation and clipping, the clipped norms;
  bf16 and fp16 policies (master weights and optimizer state stay fp32); activation checkpointing;
  tied weights kept in one group; meta-device init (values of a whole build) and full weights scattered
  from rank 0;
- the portability matrix: a sharded checkpoint saved by 2 processes loads into FSDP on 1 and 3 processes,
  DDP, one device, and a plain nn.Module (after consolidation to .safetensors and .pt); a DDP checkpoint
  and a full FSDP checkpoint load into FSDP and DDP; every cell restores weights and optimizer state bit
  for bit and finishes the epoch with each sample seen exactly once;
- bad input: unknown block classes, shape mismatches, cpu_offload without a GPU, an optimizer that stepped.

Real processes (gloo on CPU) through tests/workers/fsdp_cases.py, each with a timeout. About 1.5 minutes
on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import WORKERS
from test_resume import Run, assert_bit_equal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_SAMPLES = 48


def _worker_model():
    """tests/workers/fsdp_model.py (the workers' folder is not on this process's path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_model", WORKERS / "fsdp_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _worker_model().make


def tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def max_diff(a, b):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((tensor(a[k]) - tensor(b[k])).abs().max().item() for k in a)


def assert_equal_state(got, expected, what):
    assert sorted(got) == sorted(expected), what
    for k in expected:
        assert got[k] == expected[k], f"{what}: {k} differs"


# -- training: FSDP against DDP -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_train")
    return Run("fsdp_cases.py", out, "--phase", "train", nproc=2, launcher="torchrun", timeout=300).ok()[0]


def test_fsdp_matches_ddp_with_accumulation_and_clipping(trained):
    r = trained["fp32"]
    assert set(r["sharded"]) == {"DTensor"}
    assert r["local_rows"][:2] == [8, 8]  # each of 2 processes holds half of the 16 rows
    # the same sums in another order (reduce-scatter vs all-reduce): measured 0 on 2 CPU cores
    assert max_diff(r["fsdp"], r["ddp"]) <= 1e-6
    assert len(r["fsdp_norms"]) == 3 and all(isinstance(n, float) for n in r["fsdp_norms"])
    assert r["fsdp_norms"] == pytest.approx(r["ddp_norms"], rel=1e-5)


def test_bf16_policy_keeps_fp32_master_weights_and_state(trained):
    r = trained["bf16"]
    assert r["master"] == ["torch.float32"] and r["state"] == ["torch.float32"]
    diff = max_diff(r["weights"], trained["fp32"]["fsdp"])
    assert 0 < diff < 0.05  # computed in bf16: close to fp32, not equal


def test_fp16_uses_a_sharded_scaler(trained):
    r = trained["fp16"]
    assert r["scaler"] == "ShardedGradScaler" and r["skipped"] is False
    assert max_diff(r["weights"], trained["fp32"]["fsdp"]) < 0.05


def test_activation_checkpointing_changes_memory_not_results(trained):
    r = trained["checkpointed"]
    assert r["recomputed"] == ["1", "2"]
    assert max_diff(r["weights"], trained["fp32"]["fsdp"]) <= 1e-6


def test_meta_device_init_and_weights_from_rank_zero(trained):
    r = trained["meta"]
    assert r["built_on_meta"] and r["materialized"]
    assert max_diff(r["initial"], r["reference"]) == 0  # the values of the model built whole
    assert max_diff(r["weights"], r["loaded_reference"]) == 0
    assert "differ in shape" in r["bad_weights"] and "0.weight: saved (8, 4), model (16, 4)" in r["bad_weights"]


def test_tied_weights_stay_in_one_group(trained):
    r = trained["tied"]
    assert r["kept_whole"] == ["body"] and r["still_tied"]
    assert max_diff(r["fsdp"], r["ddp"]) <= 1e-6


def test_optimizer_that_already_stepped_is_refused(trained):
    assert "already stepped on the unsharded model" in trained["stepped_optimizer"]


def test_every_process_starts_from_rank_zero_weights(trained):
    assert trained["rank0_weights"] == 0  # each rank built its model from its own seed


def test_partly_meta_model_keeps_its_real_weights(trained):
    assert trained["pretrained_kept"] == 0 and trained["head_initialized"]


def test_nested_no_sync_restores_what_it_found(trained):
    assert trained["nested_no_sync"] == {"no_grad_inside": True, "grad_after": True}


def test_errors_met_by_rank_zero_reach_every_rank(trained):
    assert "load_model_weights could not read /nonexistent/weights.safetensors" in trained["missing_weights"]
    assert "still on the meta device: prepare it first" in trained["meta_target"]


def test_sharded_optimizer_state_loads_into_frozen_and_partial_state(trained):
    cases = trained["optimizer_cases"]
    assert cases["frozen"] == {"equal": True} and cases["partial"] == {"equal": True}
    failed = cases["amsgrad"]  # another optimizer configuration: a clear error, and nothing made up stays
    assert failed["error"].startswith("CheckpointError") and "max_exp_avg_sq" in failed["error"]
    assert failed["unchanged"] is True


# -- portability: save on one setup, load on another ----------------------------------------------------

SAVES = {"fsdp_sharded": ("fsdp", "sharded"), "fsdp_full": ("fsdp", "full"), "ddp": ("ddp", "sharded")}
LOADS = [  # (saved by, loading strategy, processes)
    ("fsdp_sharded", "fsdp", 2), ("fsdp_sharded", "fsdp", 1), ("fsdp_sharded", "fsdp", 3),
    ("fsdp_sharded", "ddp", 2), ("fsdp_sharded", "single", 1),
    ("ddp", "fsdp", 2), ("ddp", "fsdp", 3), ("fsdp_full", "ddp", 2), ("fsdp_full", "fsdp", 3),
]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_matrix")
    saves = {name: Run("fsdp_cases.py", root / f"save_{name}", "--phase", "save", "--strategy", strategy, "--kind", kind,
                       "--ckpt", root / f"ckpt_{name}", nproc=2, launcher="torchrun", timeout=240)
             for name, (strategy, kind) in SAVES.items()}
    saved = {name: run.ok()[0] for name, run in saves.items()}
    loads = {}
    for source, strategy, nproc in LOADS:
        loads[(source, strategy, nproc)] = Run(
            "fsdp_cases.py", root / f"load_{source}_{strategy}_{nproc}", "--phase", "load", "--strategy", strategy,
            "--ckpt", root / f"ckpt_{source}", nproc=nproc, launcher="torchrun" if nproc > 1 else None, timeout=240)
    loads["mismatch"] = Run("fsdp_cases.py", root / "load_mismatch", "--phase", "load", "--strategy", "fsdp",
                            "--width", 8, "--ckpt", root / "ckpt_fsdp_sharded", nproc=2, launcher="torchrun",
                            timeout=240)
    return root, saved, {key: run.ok()[0] for key, run in loads.items()}


def test_sharded_checkpoint_layout(matrix):
    import json

    root, _, _ = matrix
    manifest = json.loads((root / "ckpt_fsdp_sharded" / "manifest.json").read_text())
    assert manifest["meta"]["engine"] == "dcp" and manifest["meta"]["world_size"] == 2
    assert {".metadata", "training_state.pt", "rng_0.pt", "rng_1.pt"} <= set(manifest["files"])
    assert any(f.startswith("__0_") for f in manifest["files"]) and any(f.startswith("__1_") for f in manifest["files"])
    assert not any(f.startswith("model_") for f in manifest["files"])  # no whole copy anywhere
    full = json.loads((root / "ckpt_fsdp_full" / "manifest.json").read_text())
    assert "engine" not in full["meta"] and "model_0.pt" in full["files"]


@pytest.mark.parametrize("source,strategy,nproc", LOADS, ids=[f"{s}->{t}x{n}" for s, t, n in LOADS])
def test_checkpoint_moves_between_strategies_and_world_sizes(matrix, source, strategy, nproc):
    _, saved, loads = matrix
    got, ref = loads[(source, strategy, nproc)], saved[source]
    assert "error" not in got, got.get("error")
    assert_equal_state(got["weights"], ref["weights"], "weights")
    assert_equal_state(got["optimizer"], ref["optimizer"], "optimizer state")
    # the rest of the epoch, from the saved position in global samples: nothing twice, nothing skipped
    assert sorted(ref["before"] + got["after"]) == list(range(N_SAMPLES))
    if nproc == 2:
        assert got["after"] == ref["after"]  # same world size: the very batches of the uninterrupted run
    else:
        assert any("will not repeat the uninterrupted run bit for bit" in w for w in got["warnings"])


def test_checkpoint_of_another_shape_is_refused_naming_the_first_keys(matrix):
    _, _, loads = matrix
    error = loads["mismatch"]["error"]
    assert error.startswith("CheckpointError") and "differ in shape" in error
    assert "0.weight: saved (16, 4), model (8, 4)" in error


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_consolidated_weights_load_into_a_plain_module(matrix, tmp_path, suffix):
    import subprocess
    import sys

    from conftest import ROOT

    root, saved, _ = matrix
    out = tmp_path / f"weights{suffix}"
    done = subprocess.run([sys.executable, "-m", "fabric_lite.cli", "consolidate", str(root / "ckpt_fsdp_sharded"),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)
    model = make(seed=3)
    model.load_state_dict(state, strict=True)
    got = {k: v.reshape(-1).tolist() for k, v in model.state_dict().items()}
    assert_equal_state(got, saved["fsdp_sharded"]["weights"], "consolidated weights")


# -- on S3: every rank writes its shards to the bucket; killed, load_state(), bit for bit -----------------

def test_raw_door_sharded_checkpoints_on_s3_sigkill_then_load_state_is_bit_exact(tmp_path, s3_bucket):
    import fsspec

    root = f"{s3_bucket}/project"
    code, output, _ = Run("resume_raw.py", tmp_path / "killed", "--root", root, "--kill-step", 5, "--kill-rank", 1,
                          "--strategy", "fsdp", nproc=2, launcher="torchrun", timeout=240).wait()
    assert code != 0 and "SIGKILLs itself" in output, output[-4000:]
    fs, path = fsspec.core.url_to_fs(f"{root}/checkpoints/checkpoint_0")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"} <= names and "model_0.pt" not in names

    resumed = Run("resume_raw.py", tmp_path / "resumed", "--root", root, "--resume", "--strategy", "fsdp", nproc=2,
                  launcher="torchrun", timeout=240).ok()
    for rank, r in enumerate(resumed):
        assert r["loaded"] == f"{root}/checkpoints/checkpoint_0"
        assert r["checkpoints"] == ["checkpoint_0", "checkpoint_1", "latest"]   # total_limit=2 on the bucket
        assert_bit_equal(r["resumed"], r["uninterrupted"], f"rank {rank}")


# -- explain -------------------------------------------------------------------------------------------

def test_explain_shows_the_sharding_dtypes_and_bytes_per_process(tmp_path):
    import sys

    from conftest import run_command

    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "explain", "--nproc-per-node", "4", "--strategy",
                        "fsdp", "examples/trainer_digits.py", "--precision", "bf16-mixed", "--root", str(tmp_path)],
                       timeout=180, env={"FABRIC_LITE_CONFIG_DIR": str(tmp_path / "no-config")})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    import re

    assert "FSDPStrategy" in out and re.search(r"world size +4\n", out)
    assert re.search(r"model +DigitClassifier \(9,610 parameters", out)
    assert "the whole model as one group" in out  # the example names no blocks
    assert "parameters float32 (sharded master copy), compute bfloat16, gradient reduce-scatter float32" in out
    assert "(1/4 of" in out and "bytes per process" in out


# -- bad input, in this process (no process group needed) ----------------------------------------------

def test_unknown_block_class_names_the_model_blocks():
    from fabric_lite.strategies.fsdp_blocks import resolve_wrap_policy

    with pytest.raises(ValueError, match=r"\['Nope'\].*block classes are: \['Block'\]"):
        resolve_wrap_policy({"Nope"}, make())
    assert resolve_wrap_policy({"Block"}, make())(make()[1])
    hf_style = make()
    hf_style._no_split_modules = ["Block", "OtherVariantBlock"]  # a Hugging Face model's blocks: the default
    assert resolve_wrap_policy(None, hf_style)(hf_style[1]) and not resolve_wrap_policy(None, make())(make()[1])


def test_cpu_offload_without_a_gpu_is_refused():
    from fabric_lite import Accelerator, FSDPStrategy

    with pytest.raises(ValueError, match="cpu_offload=True.*train on CUDA"):
        Accelerator(strategy=FSDPStrategy(cpu_offload=True), cpu=True)


def test_empty_init_needs_a_strategy_that_materializes():
    from fabric_lite import Accelerator

    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="empty_init=True.*strategy='fsdp'"):
        with acc.init_module(empty_init=True):
            pass
    with acc.init_module():
        assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_accelerate_plugin_names():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fabric_lite import FullyShardedDataParallelPlugin as Plugin

    s = Plugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
               reshard_after_forward="SHARD_GRAD_OP", state_dict_type="FULL_STATE_DICT",
               mixed_precision_policy="bf16", activation_checkpointing=True).to_strategy()
    assert s.auto_wrap_policy == ["Block"] and s.reshard_after_forward is False and s.state_dict_type == "full"
    assert s.user_mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert s.activation_checkpointing is True and not s.sharded_checkpoints
    big = Plugin(auto_wrap_policy="size_based_wrap", min_num_params=100).to_strategy().auto_wrap_policy
    assert big(nn.Linear(10, 10)) and not big(nn.Linear(2, 2))
    for bad, match in ((dict(fsdp_version=1), "fsdp_version=2"), (dict(auto_wrap_policy="size_based_wrap"), "min_num_params"),
                       (dict(state_dict_type="LOCAL_STATE_DICT"), "state_dict_type"),
                       (dict(mixed_precision_policy="int8"), "mixed_precision_policy")):
        with pytest.raises(ValueError, match=match):
            Plugin(**bad).to_strategy()
