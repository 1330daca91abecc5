"""N-D parallelism through the raw door: Accelerate's ParallelismConfig, FSDP2 over the data-parallel dimensions and
tensor parallelism the script applies on accelerator.torch_device_mesh["tp"] (real processes, gloo on CPU)."""

import itertools

import pytest
import torch

from fabric_lite import Accelerator, ParallelismConfig
from fabric_lite.strategies.base import Mesh
from fabric_lite.strategies.mesh_shape import MeshShape
from fabric_lite.utils import NotSupportedError


# -- the layout, as plain values -------------------------------------------------------------------------------
def test_a_mesh_shape_numbers_ranks_row_major_with_tensor_parallel_neighbours():
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert (shape.total, shape.dp) == (8, 4)
    assert [shape.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    mesh = shape.mesh(5)
    assert (mesh.names, mesh.sizes, mesh.coords) == (("dp", "tp"), (4, 2), (2, 1))
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.fsdp_dimensions == ("dp_replicate", "dp_shard") and MeshShape(dp_shard=4).fsdp_dimensions == ("dp_shard",)
    assert Mesh(("a", "b", "c"), (2, 3, 2), (0, 0, 0)).groups("b")[:2] == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("sizes, words", [
    (dict(tp_size=0), "tp_size=0 must be an integer >= 1"),
    (dict(dp_shard_size=2.0), "dp_shard_size=2.0 must be an integer"),
    (dict(dp_replicate_size=2, tp_size=2), "dp_replicate_size=2 with tp_size=2 and dp_shard_size=1"),
])
def test_sizes_that_cannot_lay_out_a_mesh_are_refused_naming_them(sizes, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        ParallelismConfig(**sizes)


def test_context_parallelism_is_refused_and_the_sizes_must_multiply_to_the_world():
    with pytest.raises(NotSupportedError, match="context parallelism"):
        ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match=r"multiply to 4 processes .*dp_shard_size=2 x tp_size=2.*this run has 1"):
        Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match="without strategy='ddp'"):
        Accelerator(strategy="ddp", parallelism_config=ParallelismConfig(dp_shard_size=2))


def test_accelerates_members_without_a_layout():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=3, tp_size=2)
    assert (config.total_size, config.data_parallel_size, config.non_data_parallel_size) == (12, 6, 2)
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"] and config.non_dp_dim_names == ["tp"]
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard"] and config.active_mesh_dims == ["dp_replicate", "dp_shard", "tp"]
    acc = Accelerator()
    assert acc.parallelism_config is None and acc.torch_device_mesh is None
    with pytest.raises(RuntimeError, match="parallelism_config"):
        acc.data_parallel_rank
    one = Accelerator(parallelism_config=ParallelismConfig())  # one process in all: nothing to lay out
    assert (one.data_parallel_rank, one.data_parallel_shard_rank, one.tensor_parallel_rank) == (0, 0, 0)


def test_a_tensor_parallel_model_without_a_tensor_parallel_dimension_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    acc = Accelerator(strategy="fsdp")  # one process: FSDP's own one-member process group
    try:
        model = parallelize_module(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1,)), ColwiseParallel())
        with pytest.raises(ValueError, match="already distributed tensors .*ParallelismConfig"):
            acc.prepare(model)
    finally:
        acc.end_training()


# -- training on 4 processes equals one process ---------------------------------------------------------------
def _flat(value):
    return list(itertools.chain.from_iterable(value)) if value and isinstance(value[0], list) else value


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import torchrun, WORKERS

    out = tmp_path_factory.mktemp("nd_reference")
    return torchrun(WORKERS / "nd_parallel.py", 1, out_dir=out)[0]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sizes", ["1,2,2", "2,2,1", "1,1,2"], ids=["fsdp_x_tp_2x2", "hsdp_2x2", "tp_2"])
def test_n_d_layouts_train_as_one_process_does(launch, reference, sizes):
    nproc = 1
    for size in sizes.split(","):
        nproc *= int(size)
    results = launch("nd_parallel", nproc, "--sizes", sizes)
    for r in results:
        # accumulation over 2 micro-batches and clipping at 0.5, three optimizer steps, AdamW
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert r["norms"] == pytest.approx(reference["norms"], abs=1e-5)
        assert r["gathered"] == list(range(10))  # gather_for_metrics: each sample once, over the dp ranks
        assert r["mesh"] == ["dp_replicate", "dp_shard", "tp"]
    weights = results[0]["weights"]
    for name, value in reference["weights"].items():
        assert _flat(weights[name]) == pytest.approx(_flat(value), abs=1e-5), name
    replicate, shard, tp = (int(s) for s in sizes.split(","))
    assert [r["ranks"] for r in results] == [
        [rank // (shard * tp), (rank // tp) % shard, rank % tp] for rank in range(nproc)]
    # the ranks of one tensor-parallel group read the same batches; the data-parallel ranks split them
    by_dp = {}
    for rank, r in enumerate(results):
        by_dp.setdefault(rank // tp, []).append(r["seen"])
    assert all(all(s == seen[0] for s in seen) for seen in by_dp.values())
    assert sorted(itertools.chain.from_iterable(seen[0] for seen in by_dp.values())) == sorted(reference["seen"])


# -- the Trainer door: Lightning's ModelParallelStrategy --------------------------------------------------------
def test_model_parallel_strategy_is_registered_and_refuses_sizes_it_cannot_lay_out():
    from fabric_lite.strategies import ModelParallelStrategy, create_strategy
    from fabric_lite import TrainModule

    assert isinstance(create_strategy("model_parallel"), ModelParallelStrategy)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\): give an integer >= 1, or 'auto'"):
        ModelParallelStrategy(tensor_parallel_size=0)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"2 x 2 = 4 processes, but this run has 1"):
        strategy.resolve_shape()
    assert TrainModule().device_mesh is None  # (no Trainer: no mesh)


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    from conftest import torchrun, WORKERS

    return torchrun(WORKERS / "nd_trainer.py", 1, out_dir=tmp_path_factory.mktemp("nd_trainer_reference"))[0]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("flags", [["--dp", 2, "--tp", 2], ["--dp", 2, "--tp", 2, "--user-fsdp"]],
                         ids=["tp_in_configure_model", "tp_and_fully_shard_in_configure_model"])
def test_model_parallel_strategy_trains_as_one_process_does(launch, trainer_reference, flags):
    results = launch("nd_trainer", 4, *flags)
    for rank, r in enumerate(results):
        assert r["mesh"] == ["data_parallel", "tensor_parallel"] and r["global_step"] == 3
        # the last step's loss logged with sync_dist=True: averaged over the 2 data-parallel ranks = the global batch's
        assert r["logged"] == pytest.approx(trainer_reference["logged"], abs=1e-5)
        assert r["seen"] == results[rank ^ 1]["seen"]  # ranks 0,1 (and 2,3) form a tensor-parallel group
    assert sorted(results[0]["seen"] + results[2]["seen"]) == sorted(trainer_reference["seen"])
    for name, value in trainer_reference["weights"].items():  # accumulation 2, clipping at 0.5, AdamW
        assert results[0]["weights"][name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_accelerates_launch_flags_lay_the_processes_out(tmp_path, reference):
    from conftest import torchrun, WORKERS

    flags = ["--cpu", "--oversubscribe", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
             "--parallelism_config_tp_size", "2"]
    results = torchrun(WORKERS / "nd_parallel.py", 4, "--sizes", "launch", out_dir=tmp_path, launcher="fabric-lite",
                       launcher_args=flags, timeout=300)
    assert [r["ranks"] for r in results] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert results[0]["losses"] == pytest.approx(reference["losses"], abs=1e-5)


def test_launch_sizes_that_do_not_fit_the_processes_are_refused_before_any_starts(tmp_path):
    from conftest import ROOT, run_command, WORKERS
    import sys

    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--cpu", "--nproc-per-node", "2",
                        "--parallelism_config_tp_size", "4", str(WORKERS / "nd_parallel.py"), "--out", str(tmp_path)],
                       timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "multiply to 4 processes (dp_replicate 1 x dp_shard 1 x tp 4), but this launch starts 2" in proc.stderr
    assert not list(tmp_path.iterdir())  # no worker ran


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weights_distributed_on_a_mesh_of_the_scripts_own_are_refused_naming_the_weight_and_the_mesh(launch):
    for r in launch("nd_parallel", 2, "--sizes", "1,1,2", "--own-mesh"):
        assert "weight '0.weight' is distributed on a device mesh of its own" in r["error"]
        assert "accelerator.torch_device_mesh['tp']" in r["error"]


def test_an_accelerate_config_files_parallelism_section_is_read(tmp_path):
    from fabric_lite.launch.config_file import load_config

    path = tmp_path / "default_config.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 4\nuse_cpu: true\n"
                    "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
                    "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
                    "  parallelism_config_cp_size: 1\n")
    config = load_config(path)
    assert dict(config.parallelism) == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1}
    assert "parallelism_config" not in " ".join(config.ignored)


def test_the_launch_environment_carries_accelerates_parallelism_variables():
    from fabric_lite.settings import resolve_run_config
    from fabric_lite.strategies.environments import LaunchEnvironment, read_launch_settings

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
           "PARALLELISM_CONFIG_TP_SIZE": "2"}
    launch = read_launch_settings(env)
    assert launch.parallelism == (1, 2, 2, 1)
    assert read_launch_settings({"PARALLELISM_CONFIG_TP_SIZE": "2"}).parallelism is None  # (not switched on)
    config = resolve_run_config({}, launch_env=LaunchEnvironment(launch=launch))
    assert (config.mesh_shape.dp_shard, config.mesh_shape.tp) == (2, 2)
    assert config.strategy.mesh_shape == config.mesh_shape
    with pytest.raises(ValueError, match="context parallelism"):
        resolve_run_config({}, launch_env=LaunchEnvironment(launch=read_launch_settings(
            {**env, "PARALLELISM_CONFIG_CP_SIZE": "2"})))


def test_explain_counts_the_data_parallel_processes_in_the_effective_batch():
    from fabric_lite.explain.plan import Plan, effective_value
    from fabric_lite.explain.shares import Share

    plan = Plan()
    effective_value(plan, Share(world=8, batch=4), 8, 2, "", MeshShape(dp_shard=2, tp=4))
    assert plan.value("effective global batch").startswith(
        "16 = 4 per process x 2 data-parallel process(es) (of 8; tp=4) x 2 accumulation")
    plan = Plan()
    effective_value(plan, Share(world=8, batch=4), 8, 2, "")
    assert plan.value("effective global batch").startswith("64 = 4 per process x 8 process(es) x 2 accumulation")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_of_a_2x2_layout_resumes_on_other_layouts_with_the_same_weights(launch, tmp_path):
    import json

    ckpt = tmp_path / "ckpt"
    saved = launch("nd_parallel", 4, "--sizes", "1,2,2", "--save", ckpt)[0]["weights"]
    assert json.loads((ckpt / "manifest.json").read_text())["meta"]["layout"] == {"dp": 2, "tp": 2}
    for sizes, nproc in (("1,1,1", 1), ("1,1,2", 2)):  # one process; tensor parallel alone
        loaded = launch("nd_parallel", nproc, "--sizes", sizes, "--load", ckpt)[0]["loaded"]
        for name, value in saved.items():
            assert _flat(loaded[name]) == pytest.approx(_flat(value), abs=1e-6), (sizes, name)
    # `fabric-lite consolidate`: one plain state dict, which a plain module loads
    import sys
    from conftest import ROOT, run_command

    out = tmp_path / "weights.pt"
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "consolidate", str(ckpt), str(out)], timeout=120,
                       cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    plain.load_state_dict(torch.load(out, weights_only=True))
    for name, value in plain.state_dict().items():
        assert value.reshape(-1).tolist() == pytest.approx(_flat(saved[name]), abs=1e-6), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_transformers_model_loaded_tensor_parallel_trains_as_the_whole_model_does(launch):
    pytest.importorskip("transformers.distributed")  # (transformers >= 5: DistributedConfig)
    for r in launch("nd_transformers", 2):
        # its weights arrive as DTensors on the tp dimension; FSDP then shards them over dp_shard (2-D), while the
        # weights transformers replicates stay 1-D: clipping takes one norm over both meshes
        assert "Shard(dim=0)" in r["placements"]
        assert r["losses"] == pytest.approx(r["reference"], abs=1e-5)


def test_a_llama_style_model_on_a_1x1_mesh_trains_as_plain_torch(tmp_path):
    """ModelParallelStrategy(1, 1) on one process: the tensor-parallel plan and FSDP2 applied over meshes of one rank
    (what one GPU runs of a script written for many) train as the plain model does."""
    from conftest import torchrun, WORKERS

    result = torchrun(WORKERS / "llama_1x1.py", 1, out_dir=tmp_path)[0]
    assert result["kinds"] == ["DTensor"]
    assert result["diff"] < 1e-6, result["diff"]


def test_the_raw_door_shows_model_parallel_strategys_own_mesh():
    """Accelerator(strategy=ModelParallelStrategy(...)) on one process: torch_device_mesh is the strategy's
    (data_parallel x tensor_parallel), as a parallelism config's would be."""
    from fabric_lite.strategies import ModelParallelStrategy

    acc = Accelerator(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), cpu=True)
    try:
        assert acc.torch_device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        assert acc.parallelism_config is None
    finally:
        acc.end_training()
