"""fabric_lite.utils' own implementations of Accelerate's documented utilities: tree operations, send_to_device,
the environment helpers, write_basic_config, the availability checks, model sizes, save / load,
merge_fsdp_weights (and `fabric-lite merge-weights`), and the collectives and RNG synchronization on processes
started by debug_launcher."""

import collections
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT
from fabric_lite import Accelerator, PartialState
from fabric_lite import utils


@pytest.fixture(autouse=True)
def _fresh_state():
    PartialState._reset_state()
    yield
    PartialState._reset_state()


Pair = collections.namedtuple("Pair", "a b")


def test_tree_operations():
    t = torch.arange(6.0).view(3, 2)
    data = {"x": [t, Pair(t, "keep")], "n": 3}
    doubled = utils.recursively_apply(lambda x, k: x * k, data, 2)
    assert isinstance(doubled["x"][1], Pair) and doubled["x"][1].b == "keep" and doubled["n"] == 3
    assert torch.equal(doubled["x"][0], t * 2) and torch.equal(doubled["x"][1].a, t * 2)
    with pytest.raises(TypeError, match="Unsupported type str"):
        utils.recursively_apply(lambda x: x, ["text"], error_on_other_type=True)
    assert utils.is_namedtuple(Pair(1, 2)) and not utils.is_namedtuple((1, 2))
    assert utils.honor_type(Pair(0, 0), iter([5, 6])) == Pair(5, 6) and utils.honor_type((0,), iter([1])) == (1,)
    assert utils.listify({"a": torch.tensor([1.5, 2.0], dtype=torch.bfloat16), "b": [torch.tensor(3)]}) == \
        {"a": [1.5, 2.0], "b": [3]}
    batches = [{"x": torch.ones(2, 2), "y": (torch.zeros(2),)}, {"x": torch.ones(1, 2) * 2, "y": (torch.ones(1),)}]
    joined = utils.concatenate(batches)
    assert joined["x"].tolist() == [[1, 1], [1, 1], [2, 2]] and joined["y"][0].tolist() == [0, 0, 1]
    assert utils.slice_tensors({"x": t}, slice(1, 3))["x"].tolist() == [[2, 3], [4, 5]]
    half = {"a": t.half(), "b": t.bfloat16(), "i": torch.ones(2, dtype=torch.int64)}
    full = utils.convert_to_fp32(half)
    assert full["a"].dtype == full["b"].dtype == torch.float32 and full["i"].dtype == torch.int64

    def forward(x):
        """the forward"""
        return {"out": x.half()}

    wrapped = utils.convert_outputs_to_fp32(forward)
    assert wrapped(t)["out"].dtype == torch.float32 and wrapped.__wrapped__ is forward
    assert wrapped.__doc__ == "the forward"
    assert utils.find_batch_size({"ids": [torch.ones(7, 3)], "mask": torch.ones(2)}) == 7
    with pytest.raises(ValueError, match="empty"):
        utils.find_batch_size([])
    with pytest.raises(TypeError, match="tensors"):
        utils.find_batch_size({"a": "text"})


def test_send_to_device_skips_keys_at_every_level():
    class Moves:
        def __init__(self):
            self.moved_to = None

        def to(self, device, non_blocking=False):
            self.moved_to = (device, non_blocking)
            return self

    meta = torch.device("meta")
    batch = {"ids": torch.ones(2), "labels": torch.ones(2), "nested": {"labels": torch.ones(1), "x": torch.ones(1)},
             "pair": Pair(torch.ones(1), 1), "obj": Moves()}
    out = utils.send_to_device(batch, "meta", non_blocking=True, skip_keys="labels")
    assert out["ids"].device == meta and out["nested"]["x"].device == meta and out["pair"].a.device == meta
    assert out["labels"].device.type == "cpu" and out["nested"]["labels"].device.type == "cpu"
    assert isinstance(out["pair"], Pair) and out["obj"].moved_to == (meta, True)
    both = utils.send_to_device(batch, meta, skip_keys=["labels", "ids"])
    assert both["ids"].device.type == "cpu" and both["nested"]["x"].device == meta


def test_environment_helpers(monkeypatch):
    monkeypatch.setenv("KEEP_ME", "old")
    monkeypatch.delenv("NEW_ONE", raising=False)
    with utils.patch_environment(keep_me=1, new_one=True):
        assert os.environ["KEEP_ME"] == "1" and os.environ["NEW_ONE"] == "True"
    assert os.environ["KEEP_ME"] == "old" and "NEW_ONE" not in os.environ
    with utils.clear_environment():
        assert dict(os.environ) == {}
        os.environ["INSIDE"] = "x"
    assert "INSIDE" not in os.environ and os.environ["KEEP_ME"] == "old"

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")

    @utils.purge_accelerate_environment
    def sets_launch_variables():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCELERATE_USE_CPU"] = "true"
        os.environ["UNRELATED"] = "stays"
        return "ran"

    assert sets_launch_variables() == "ran"
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no" and "ACCELERATE_USE_CPU" not in os.environ
    assert os.environ.pop("UNRELATED") == "stays"
    assert utils.str_to_bool("Yes") == 1 and utils.str_to_bool("off") == 0


def test_write_basic_config_writes_what_launch_reads(tmp_path, capsys):
    from fabric_lite.launch.config_file import load_config

    path = tmp_path / "cfg" / "default_config.yaml"
    assert utils.write_basic_config(mixed_precision="bf16", save_location=str(path)) == path
    config = load_config(path)
    gpus = torch.cuda.device_count()
    assert config.mixed_precision == "bf16" and config.nproc_per_node == (gpus or 1) and config.use_cpu == (gpus == 0)
    assert utils.write_basic_config("no", save_location=path) is False  # an existing file is kept
    assert "already exists" in capsys.readouterr().out and load_config(path).mixed_precision == "bf16"
    with pytest.raises(ValueError, match="fp8"):
        utils.write_basic_config("fp8", save_location=tmp_path / "other.yaml")
    with pytest.raises(ValueError, match="'no', 'fp16' or 'bf16'"):
        utils.write_basic_config("fp64", save_location=tmp_path / "other.yaml")
    launched = subprocess.run([sys.executable, "-m", "fabric_lite.cli", "launch", "--config_file", str(path),
                               "-m", "platform"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert launched.returncode == 0, launched.stderr[-2000:]


def test_availability_checks_answer_without_importing():
    code = ("import sys, importlib.util, torch\nfrom fabric_lite import utils\nbefore = set(sys.modules)\n"
            "checks = [n for n in utils.__all__ if n.startswith('is_') and n.endswith('_available')]\n"
            "answers = {n: getattr(utils, n)() for n in checks}\n"
            "print(len(checks), answers['is_safetensors_available'], answers['is_wandb_available'],"
            " importlib.util.find_spec('wandb') is not None, answers['is_npu_available'], answers['is_xpu_available'],"
            " answers['is_bf16_available'], answers['is_torch_xla_available'])\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
            "('safetensors', 'wandb', 'tensorboard', 'mlflow', 'deepspeed', 'transformers', 'datasets', 'rich')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    counts, imported = out.splitlines()
    count, safetensors, wandb, wandb_found, npu, xpu, bf16, xla = counts.split()
    assert int(count) >= 40 and safetensors == "True" and wandb == wandb_found and npu == "False"
    assert xpu == str(torch.xpu.is_available()) and bf16 == str(utils.is_bf16_available())
    assert imported == "[]", f"availability checks imported {imported}"
    assert utils.is_torch_version(">=", "2.0") and not utils.is_torch_version("<", "2.0")
    assert utils.is_torch_version("==", torch.__version__.split("+")[0])
    with pytest.raises(ValueError, match="operation"):
        utils.is_torch_version("=>", "2.0")


def test_constants_and_enums():
    assert (utils.MODEL_NAME, utils.OPTIMIZER_NAME, utils.RNG_STATE_NAME, utils.SCALER_NAME,
            utils.SCHEDULER_NAME) == ("pytorch_model", "optimizer", "random_states", "scaler.pt", "scheduler")
    assert (utils.WEIGHTS_NAME, utils.SAFE_WEIGHTS_NAME, utils.WEIGHTS_INDEX_NAME, utils.SAFE_WEIGHTS_INDEX_NAME) == \
        ("pytorch_model.bin", "model.safetensors", "pytorch_model.bin.index.json", "model.safetensors.index.json")
    assert utils.ComputeEnvironment.LOCAL_MACHINE == "LOCAL_MACHINE" and str(utils.RNGType.GENERATOR) == "generator"
    assert utils.RNGType("cuda") is utils.RNGType.CUDA and utils.SageMakerDistributedType.DATA_PARALLEL.value == \
        "DATA_PARALLEL"
    assert utils.PrecisionType.BF16 == "bf16" and {"no", "fp16", "bf16"} <= set(utils.PrecisionType.list())


def test_model_sizes_and_offload_questions():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    sizes = utils.compute_module_sizes(model)
    assert sizes["0"] == (32 + 8) * 4 and sizes["1.0"] == (64 + 8) * 4
    assert sizes["1.1"] == (8 + 8 + 8 + 8) * 4 + 8  # weight, bias, running mean / var (fp32), num_batches (int64)
    assert sizes[""] == sizes["0"] + sizes["1"]
    assert utils.compute_module_sizes(model, dtype=torch.float16)["0"] == (32 + 8) * 2
    assert utils.calculate_maximum_sizes(model) == (sizes[""], (sizes["1.0"], ["1.0"]))
    assert utils.get_max_layer_size([("1", model[1])], sizes, ["Sequential"]) == (sizes["1"], ["1"])
    order = utils.get_module_children_bottom_up(model, return_fqns=True)
    assert [name for name, _ in order] == ["0", "1.0", "1.1", "1", ""] and order[-1][1] is model
    assert utils.has_offloaded_params(model) is False


def test_save_load_and_load_checkpoint_in_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    # no Accelerator: torch's own wrappers are peeled (torch.compile's only when asked)
    compiled = torch.compile(nn.DataParallel(model))
    assert utils.extract_model_from_parallel(compiled) is compiled
    assert utils.extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    utils.save(model.state_dict(), tmp_path / "w.pt")
    utils.save(model.state_dict(), tmp_path / "w.safetensors", safe_serialization=True)
    for name in ("w.pt", "w.safetensors"):
        loaded = utils.load_state_dict(tmp_path / name)
        assert loaded.keys() == model.state_dict().keys()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert torch.equal(utils.load(tmp_path / "w.pt")["0.weight"], model[0].weight)
    acc = Accelerator()
    prepared = acc.prepare(model)
    acc.save_model(prepared, tmp_path / "saved", max_shard_size="100B")  # sharded, with an index
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    utils.load_checkpoint_in_model(fresh, tmp_path / "saved", dtype=torch.float16, strict=True)
    assert fresh[0].weight.dtype == torch.float16
    assert torch.allclose(fresh[1].weight.float(), model[1].weight, atol=1e-3)
    assert utils.extract_model_from_parallel(prepared) is model
    with pytest.raises(NotImplementedError, match="big-model inference"):
        utils.load_checkpoint_in_model(fresh, tmp_path / "saved", device_map={"": "cpu"})


def test_merge_fsdp_weights_and_the_merge_weights_command(tmp_path):
    from fabric_lite.cli.main import main

    torch.manual_seed(1)
    acc = Accelerator()
    model = nn.Linear(5, 3)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state(tmp_path / "ckpt")
    written = utils.merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "merged")
    assert written == str(tmp_path / "merged" / "model.safetensors")
    from safetensors.torch import load_file

    merged = load_file(written)
    assert torch.equal(merged["weight"], model.weight) and torch.equal(merged["bias"], model.bias)
    # Accelerate's name of model 0's directory inside a checkpoint means the same here
    assert main(["merge-weights", str(tmp_path / "ckpt" / "pytorch_model_fsdp_0"), str(tmp_path / "bin"),
                 "--unsafe_serialization", "--remove_checkpoint_dir"]) == 0
    assert torch.equal(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)["weight"], model.weight)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="not a fabric_lite checkpoint"):
        utils.merge_fsdp_weights(tmp_path / "bin", tmp_path / "again")


def test_fsdp_ram_efficient_loading_switches(monkeypatch):
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    utils.enable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True"
    utils.disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"


def test_grad_scaler_and_autocast_helpers():
    scaler = utils.get_grad_scaler(init_scale=16.0, growth_interval=7)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 16.0
    assert scaler.get_growth_interval() == 7
    acc = Accelerator(mixed_precision="bf16", cpu=True)  # (held: the state answers from a live Accelerator)
    assert acc.mixed_precision == "bf16"
    with utils.get_mixed_precision_context_manager(native_amp=True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with utils.get_mixed_precision_context_manager(native_amp=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_get_active_deepspeed_plugin_says_when_there_is_none():
    acc = Accelerator()
    with pytest.raises(ValueError, match="does not use DeepSpeed"):
        utils.get_active_deepspeed_plugin(acc.state)

    class State:
        deepspeed_plugin = "the plugin"

    assert utils.get_active_deepspeed_plugin(State()) == "the plugin"


def _collectives_worker(seed_offset):
    """On each process of debug_launcher: the free collectives, and RNG synchronization."""
    from fabric_lite import utils as u
    from fabric_lite.state import PartialState

    state = PartialState()
    rank = state.process_index
    mine = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank  # rank 0: [0], rank 1: [10, 11]
    padded = u.pad_across_processes(mine, pad_index=-1)
    out = {"rank": rank, "world": state.num_processes, "device": str(state.device),
           "gathered": u.gather(padded).tolist(), "objects": u.gather_object([f"r{rank}"]),
           "mean": u.reduce(torch.tensor([float(rank)])).item(),
           "sum": u.reduce(torch.tensor([float(rank)]), reduction="sum").item(),
           "broadcast": u.broadcast(torch.tensor([rank + 5]), from_process=1).item(),
           "listed": u.broadcast_object_list([rank, "x"], from_process=0)}
    torch.manual_seed(seed_offset + rank)
    generator = torch.Generator().manual_seed(100 + rank)
    u.synchronize_rng_states(["torch", "generator"], generator=generator)
    out["torch_draw"] = torch.rand(3).tolist()
    out["generator_draw"] = torch.rand(3, generator=generator).tolist()
    u.synchronize_rng_state(u.RNGType.TORCH)
    u.wait_for_everyone()
    return out


def test_debug_launcher_runs_the_collectives_on_cpu_processes():
    from fabric_lite import debug_launcher

    results = debug_launcher(_collectives_worker, args=(7,), num_processes=2)
    assert [r["rank"] for r in results] == [0, 1] and all(r["world"] == 2 and r["device"] == "cpu" for r in results)
    for r in results:
        assert r["gathered"] == [0.0, -1.0, 10.0, 11.0] and r["objects"] == ["r0", "r1"]
        assert r["mean"] == 0.5 and r["sum"] == 1.0 and r["broadcast"] == 6 and r["listed"] == [0, "x"]
    assert results[0]["torch_draw"] == results[1]["torch_draw"]  # rank 1 took rank 0's state
    assert results[0]["generator_draw"] == results[1]["generator_draw"]
    torch.manual_seed(7)
    assert results[0]["torch_draw"] == torch.rand(3).tolist()
    with pytest.raises(ValueError, match="needs the generator"):
        utils.synchronize_rng_state("generator")
    with pytest.raises(ValueError, match="rng_type='npu'"):
        utils.synchronize_rng_state("npu")


def test_import_fabric_lite_utils_stays_light():
    code = ("import sys, torch\nbefore = set(sys.modules)\nimport fabric_lite\n"
            "print(sorted(set(sys.modules) - before))\nbefore = set(sys.modules)\nimport fabric_lite.utils\nprint(sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    top, utils = out.splitlines()
    assert eval(top) == ["fabric_lite"]
    assert eval(utils) == ["fabric_lite.utils", "fabric_lite.utils.constants", "fabric_lite.utils.imports"]
