"""Accelerate's names beyond the Accelerator itself: the state objects, DistributedType / LoggerType,
fabric_lite.logging, fabric_lite.utils' free functions, init_empty_weights, torch.compile through
dynamo_backend / TorchDynamoPlugin, save_model's default format, and what prepare() leaves alone."""

import json
import logging
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fabric_lite
import fabric_lite.state
from fabric_lite import Accelerator, DistributedType, LoggerType, PartialState, TorchDynamoPlugin
from fabric_lite.accelerator.wrappers import AcceleratedScheduler
from fabric_lite.logging import get_logger
from fabric_lite.state import AcceleratorState
from fabric_lite import utils


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts as a new script: no Accelerator and no PartialState yet."""
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loader(n=10, batch_size=4):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)),
                      batch_size=batch_size)


def _as_rank(monkeypatch, rank, local_rank=None, world=2):
    """Make logging and tqdm see this process as `rank` of `world` (they read fabric_lite.state.process_facts)."""
    facts = {"process_index": rank, "local_process_index": rank if local_rank is None else local_rank,
             "num_processes": world}
    monkeypatch.setattr(fabric_lite.state, "process_facts", lambda: facts)


# -- DistributedType, LoggerType ------------------------------------------------------------------
def test_distributed_type_is_a_string_enum_with_accelerates_members():
    import enum

    assert issubclass(DistributedType, enum.Enum) and issubclass(DistributedType, str)
    for name in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_XPU", "MULTI_HPU", "DEEPSPEED",
                 "FSDP", "XLA", "MEGATRON_LM"):
        member = DistributedType[name]
        assert member.value == name and member == name and str(member) == name and f"{member}" == name
    assert DistributedType("MULTI_GPU") is DistributedType.MULTI_GPU
    assert DistributedType.TPU is DistributedType.XLA  # the older name
    assert json.dumps({"kind": DistributedType.FSDP}) == '{"kind": "FSDP"}'
    acc = Accelerator()
    assert acc.distributed_type == "NO" and acc.distributed_type == DistributedType.NO
    assert acc.distributed_type is DistributedType.NO and acc.distributed_type != DistributedType.MULTI_CPU
    assert fabric_lite.utils.DistributedType is DistributedType is fabric_lite.accelerator.DistributedType


def test_logger_type_values_are_the_tracker_names(tmp_path):
    assert LoggerType.TENSORBOARD == "tensorboard" and LoggerType.WANDB.value == "wandb"
    assert LoggerType.COMETML == "comet_ml" and LoggerType.ALL == "all" and str(LoggerType.MLFLOW) == "mlflow"
    for name in ("AIM", "CLEARML", "DVCLIVE", "SWANLAB"):
        assert LoggerType[name] == name.lower()
    assert utils.LoggerType is LoggerType
    acc = Accelerator(log_with=LoggerType.TENSORBOARD, project_dir=tmp_path)
    assert acc.log_with == "tensorboard" and type(acc.log_with) is str
    assert Accelerator(log_with=[LoggerType.TENSORBOARD], project_dir=tmp_path).log_with == ["tensorboard"]
    assert Accelerator(log_with=LoggerType.ALL, project_dir=tmp_path).log_with == "all"
    pytest.importorskip("tensorboard")
    acc.init_trackers("run")
    assert [t.name for t in acc.trackers] == ["tensorboard"]
    acc.end_training()


# -- PartialState / AcceleratorState -------------------------------------------------------------
def test_partial_state_before_any_accelerator():
    state = PartialState()
    assert state.initialized and state.num_processes == 1 and state.process_index == 0
    assert state.local_process_index == 0 and state.device == torch.device("cpu")
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed and state.backend is None and state.debug is False
    assert state.distributed_type == DistributedType.NO == "NO"
    state.wait_for_everyone()
    with state.main_process_first():
        pass
    with state.local_main_process_first():
        pass
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    assert state.on_main_process(lambda: "ran")() == "ran"
    assert PartialState().strategy is state.strategy  # one shared state


def test_state_follows_the_accelerator(capsys):
    before = PartialState()
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    assert before.strategy is acc.strategy and PartialState().strategy is acc.strategy
    state = acc.state
    assert isinstance(state, AcceleratorState) and isinstance(state, PartialState)
    assert state.mixed_precision == "bf16" == acc.mixed_precision
    assert state.distributed_type == acc.distributed_type == "NO"
    assert (state.num_processes, state.process_index, state.device) == (acc.num_processes, acc.process_index,
                                                                         acc.device)
    assert state.dynamo_plugin is acc.dynamo_plugin and state.deepspeed_plugin is None
    assert AcceleratorState().mixed_precision == "bf16"  # the latest Accelerator's
    state.print("from the main process")
    assert "from the main process" in capsys.readouterr().out
    # an AcceleratorState bound to one Accelerator keeps answering for it
    Accelerator()
    assert state.mixed_precision == "bf16" and AcceleratorState().mixed_precision == "no"


def test_gradient_state_active_dataloader():
    acc = Accelerator()
    loader = acc.prepare(_loader(n=10, batch_size=4))
    gs = acc.gradient_state
    assert gs.active_dataloader is None and not gs.in_dataloader and gs.num_steps == 1
    seen = []
    for i, _ in enumerate(loader):
        assert gs.active_dataloader is loader and gs.in_dataloader
        seen.append(gs.end_of_dataloader)
        inner = acc.prepare(_loader(n=4, batch_size=4))
        for _ in inner:  # a nested loop: the innermost loader is the active one
            assert gs.active_dataloader is inner
        assert gs.active_dataloader is loader
    assert seen == [False, False, True]
    assert gs.active_dataloader is None and gs.remainder == -1
    assert Accelerator(gradient_accumulation_steps=3).gradient_state.num_steps == 3


# -- fabric_lite.logging ---------------------------------------------------------------------------
def test_get_logger_logs_on_the_main_process_only_by_default(caplog, monkeypatch):
    logger = get_logger("fabric_lite_test_names", log_level="INFO")
    assert isinstance(logger, logging.LoggerAdapter)
    with caplog.at_level(logging.INFO, logger="fabric_lite_test_names"):
        logger.info("main %d", 1)
        logger.info("everyone", main_process_only=False)
        logger.debug("too detailed")
    assert [r.getMessage() for r in caplog.records] == ["main 1", "everyone"]
    assert all(r.filename == "test_accelerate_names.py" for r in caplog.records)  # the caller's line
    caplog.clear()
    _as_rank(monkeypatch, 1)
    with caplog.at_level(logging.INFO, logger="fabric_lite_test_names"):
        logger.warning("main only")
        logger.warning("from rank 1", main_process_only=False)
        logger.info("in order", main_process_only=False, in_order=True)  # (one real process: no one to wait for)
    assert [r.getMessage() for r in caplog.records] == ["from rank 1", "in order"]


def test_get_logger_warning_once(caplog):
    logger = get_logger("fabric_lite_test_once")
    with caplog.at_level(logging.WARNING, logger="fabric_lite_test_once"):
        for _ in range(3):
            logger.warning_once("said once")
    assert [r.getMessage() for r in caplog.records] == ["said once"]


# -- fabric_lite.utils ---------------------------------------------------------------------------
def test_free_collectives_work_without_an_accelerator():
    assert utils.gather_object(["a"]) == ["a"] and utils.gather_object({"k": 1}) == [{"k": 1}]
    assert torch.equal(utils.gather(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert torch.equal(utils.reduce(torch.tensor([3.0])), torch.tensor([3.0]))  # "mean" by default
    assert torch.equal(utils.reduce(torch.tensor([3.0]), reduction="sum", scale=2.0), torch.tensor([6.0]))
    assert torch.equal(utils.broadcast(torch.tensor([5])), torch.tensor([5]))
    box = [1, "two"]
    assert utils.broadcast_object_list(box) is box and box == [1, "two"]
    assert torch.equal(utils.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
    utils.wait_for_everyone()
    assert PartialState().initialized
    batch = {"x": torch.ones(2), "meta": torch.zeros(1), "names": ["a"]}
    moved = utils.send_to_device(batch, "meta", skip_keys="meta")
    assert moved["x"].is_meta and not moved["meta"].is_meta and moved["names"] == ["a"]
    assert utils.send_to_device([torch.ones(1)], torch.device("cpu"))[0].device.type == "cpu"


def test_utils_names_and_tqdm(monkeypatch):
    for name in ("set_seed", "ProjectConfiguration", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
                 "InitProcessGroupKwargs", "GradScalerKwargs", "GradientAccumulationPlugin", "DeepSpeedPlugin",
                 "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "LoggerType", "DistributedType",
                 "is_tensorboard_available", "is_wandb_available", "is_deepspeed_available",
                 "is_safetensors_available", "extract_model_from_parallel", "release_memory", "init_empty_weights"):
        assert hasattr(utils, name) and name in utils.__all__, name
    assert utils.is_safetensors_available() and isinstance(utils.is_wandb_available(), bool)
    assert utils.release_memory(object(), object()) == [None, None]
    assert utils.tqdm(range(3), disable=False).disable is False
    assert list(utils.tqdm(range(3))) == [0, 1, 2]
    _as_rank(monkeypatch, 1)
    assert utils.tqdm(range(3)).disable is True  # not the local main process
    assert utils.tqdm(range(3), main_process_only=False).disable is False
    assert utils.tqdm(True, range(3)).disable is True  # the older positional form


# -- init_empty_weights ----------------------------------------------------------------------------
def test_init_empty_weights_puts_parameters_on_meta():
    register = nn.Module.register_parameter
    with fabric_lite.init_empty_weights():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    assert nn.Module.register_parameter is register  # put back
    assert all(p.is_meta for p in model.parameters()) and model[0].weight.requires_grad
    assert isinstance(model[0].weight, nn.Parameter)
    assert not any(b.is_meta for b in model.buffers())  # include_buffers=False, as Accelerate's default
    with utils.init_empty_weights(include_buffers=True):
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert utils.init_empty_weights is fabric_lite.init_empty_weights
    # the usual next step: real storage, then real weights
    reference = nn.Linear(8, 8)
    with fabric_lite.init_empty_weights():
        empty = nn.Linear(8, 8)
    empty = empty.to_empty(device="cpu")
    empty.load_state_dict(reference.state_dict())
    assert torch.equal(empty.weight, reference.weight)


def test_init_module_still_builds_on_the_device():
    acc = Accelerator()
    with acc.init_module():
        model = nn.Linear(4, 4)
    assert model.weight.device == acc.device and not model.weight.is_meta


def test_building_on_meta_with_buffers_keeps_a_parameter_registered_with_values_made_before():
    # (what the Trainer's init_module does around configure_model under FSDP: tensor parallelism there re-registers
    # weights that __init__ built; they must keep their values)
    layer = nn.Linear(4, 4)
    values = layer.weight.detach().clone()
    with fabric_lite.utils.init_on_device("meta", include_buffers=True):
        layer.weight = nn.Parameter(values * 2)  # made from real values
        new = nn.Linear(4, 4)
    assert torch.equal(layer.weight, values * 2) and new.weight.is_meta


# -- torch.compile -------------------------------------------------------------------------------
def _train(acc, steps=4):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, _loader(n=16, batch_size=4))
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_dynamo_backend_eager_compiles_and_trains_as_uncompiled(tmp_path):
    plain_acc = Accelerator()
    plain, plain_losses = _train(plain_acc)
    acc = Accelerator(dynamo_backend="eager")
    compiled, losses = _train(acc)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert acc.dynamo_backend == "eager" and acc.state.dynamo_plugin.backend == "eager"
    assert losses == pytest.approx(plain_losses, abs=1e-5)
    unwrapped = acc.unwrap_model(compiled)
    assert type(unwrapped) is nn.Sequential and not hasattr(unwrapped, "_orig_mod")
    for (name, p), (name_ref, p_ref) in zip(unwrapped.state_dict().items(), plain.state_dict().items()):
        assert name == name_ref and torch.allclose(p, p_ref, atol=1e-5)
    assert acc.unwrap_model(compiled, keep_torch_compile=True) is compiled
    acc.save_model(compiled, tmp_path)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(plain.state_dict())  # no _orig_mod.
    assert not isinstance(Accelerator(dynamo_backend="no").prepare(_model()), torch._dynamo.eval_frame.OptimizedModule)


def test_torch_dynamo_plugin():
    plugin = TorchDynamoPlugin(backend="EAGER", fullgraph=True)
    assert plugin.backend == "eager" and plugin.compile_kwargs() == {"backend": "eager", "fullgraph": True}
    assert TorchDynamoPlugin().backend == "no" and not TorchDynamoPlugin().enabled
    acc = Accelerator(dynamo_plugin=plugin)
    model = acc.prepare(_model())
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and acc.dynamo_backend == "eager"
    assert model(torch.randn(2, 4)).shape == (2, 2)
    with pytest.raises(ValueError, match="not both"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=plugin)
    with pytest.raises(TypeError, match="dynamo_plugin"):
        Accelerator(dynamo_plugin="eager")

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            for block in self.blocks:
                x = block(x).relu()
            return self.head(x)

    regional = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    torch.manual_seed(0)
    model = Blocks()
    expected = model(torch.ones(2, 4))
    prepared = regional.prepare(model)
    assert prepared is model and set(prepared.state_dict()) == set(Blocks().state_dict())  # compiled in place
    assert torch.allclose(prepared(torch.ones(2, 4)), expected)


# -- save_model ----------------------------------------------------------------------------------
def test_save_model_writes_safetensors_by_default(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(_model(seed=3))
    acc.save_model(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    fresh = _model(seed=4)
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")))
    for a, b in zip(fresh.parameters(), acc.unwrap_model(model).parameters()):
        assert torch.equal(a, b)
    acc.save_model(model, tmp_path / "sharded", max_shard_size=200)  # bytes: one shard per tensor or so
    names = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in names and len(names) > 2
    again = acc.prepare(_model(seed=5))
    acc.load_model_weights(again, tmp_path / "sharded")
    for a, b in zip(again.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


# -- what prepare() leaves alone -----------------------------------------------------------------
def test_duck_typed_scheduler_and_unknown_objects_are_returned_untouched():
    class WarmupScheduler:  # not a torch class: Accelerate prepares only PyTorch's
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.steps = 0

        def step(self):
            self.steps += 1
            for group in self.optimizer.param_groups:
                group["lr"] = 0.1 * min(1.0, self.steps / 2)

    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    duck = WarmupScheduler(opt)
    other = {"not": "preparable"}
    model, opt, sched, same, text = acc.prepare(model, opt, duck, other, "text")
    assert sched is duck and same is other and text == "text"
    assert acc.schedulers == []
    sched.step()
    assert sched.steps == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    torch_sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    assert isinstance(torch_sched, AcceleratedScheduler)
    plateau = acc.prepare(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert isinstance(plateau, AcceleratedScheduler)


# -- a script written for Accelerate, with its imports changed -----------------------------------
def test_an_accelerate_style_script(caplog, tmp_path):
    from fabric_lite.utils import gather_object, set_seed

    logger = get_logger("fabric_lite_script")
    state = PartialState()
    with state.main_process_first():
        data = _loader(n=8, batch_size=4)
    set_seed(0)
    accelerator = Accelerator(log_with=LoggerType.TENSORBOARD, project_dir=tmp_path)
    if accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU):
        where = accelerator.distributed_type.value
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    with caplog.at_level(logging.INFO, logger="fabric_lite_script"):
        for x, y in data:
            assert accelerator.gradient_state.active_dataloader is data
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            logger.info("loss %.3f", loss.item(), main_process_only=True)
    assert len(caplog.records) == 2 and where == "NO"
    results = gather_object([f"rank{accelerator.process_index}"])
    assert results == ["rank0"] and accelerator.state.process_index == state.process_index == 0
    accelerator.wait_for_everyone()
    accelerator.save_model(model, tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").is_file()
    accelerator.end_training()


# -- two real processes --------------------------------------------------------------------------
TWO_PROCESS_SCRIPT = textwrap.dedent('''
    import json, logging, sys
    from pathlib import Path

    import torch

    from fabric_lite import Accelerator, DistributedType, PartialState
    from fabric_lite.logging import get_logger
    from fabric_lite.utils import broadcast_object_list, gather_object, reduce, wait_for_everyone

    out = Path(sys.argv[sys.argv.index("--out") + 1])
    logger = get_logger("two", log_level="INFO")
    state = PartialState()  # before any Accelerator: starts the process group
    r = state.process_index
    logging.basicConfig(level=logging.INFO, format="%(message)s", filename=str(out / f"log{r}.txt"))
    res = {"facts": [state.num_processes, r, state.local_process_index, state.is_main_process,
                     state.is_last_process, state.distributed_type.value, state.backend]}
    with state.split_between_processes(list(range(5))) as part:
        res["split"] = part
    res["gather_object"] = gather_object([f"rank{r}"])
    res["reduce_mean"] = reduce(torch.tensor([float(r)])).tolist()
    res["broadcast"] = broadcast_object_list([f"from{r}"], from_process=1)
    logger.info(f"main-only {r}")
    logger.info(f"ordered {r}", main_process_only=False, in_order=True)
    wait_for_everyone()
    acc = Accelerator()
    res["same_strategy"] = PartialState().strategy is acc.strategy
    res["acc"] = [acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type == "MULTI_CPU",
                  acc.state.num_processes, acc.state.process_index]
    res["after"] = acc.gather_object([r])
    acc.end_training()
    (out / f"rank{r}.json").write_text(json.dumps(res))
''')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_partial_state_and_free_functions_on_two_processes(tmp_path):
    from conftest import torchrun

    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    r0, r1 = torchrun(script, 2, out_dir=out)
    assert r0["facts"] == [2, 0, 0, True, False, "MULTI_CPU", "gloo"]
    assert r1["facts"] == [2, 1, 1, False, True, "MULTI_CPU", "gloo"]
    assert r0["split"] == [0, 1, 2] and r1["split"] == [3, 4]
    for r in (r0, r1):
        assert r["gather_object"] == ["rank0", "rank1"] and r["reduce_mean"] == [0.5]
        assert r["broadcast"] == ["from1"] and r["same_strategy"] is True
        assert r["after"] == [0, 1]
    assert r0["acc"] == [True, True, 2, 0] and r1["acc"] == [True, True, 2, 1]
    assert (out / "log0.txt").read_text().split() == ["main-only", "0", "ordered", "0"]
    assert (out / "log1.txt").read_text().split() == ["ordered", "1"]
