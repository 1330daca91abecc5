"""The Strategy contract (fabric_lite/strategies/base.py): what a new strategy must implement, and the
hooks the doors call for it (device feed, step marker, optimizer state with its module, joint set-up,
precision adaptation, registry)."""

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.strategies import SingleDeviceStrategy, Strategy, available_strategies, create_strategy
from fabric_lite.strategies.checkpoint_format import CheckpointFormat
from fabric_lite.strategies.engine_step import EngineStep
from fabric_lite.strategies.registry import strategy_class, strategy_for_checkpoint_engine
from fabric_lite.strategies.runtime import Runtime, RuntimeSlot


def test_the_base_is_abstract_and_names_what_is_missing():
    class Half(Strategy):
        def setup_environment(self):
            pass

    with pytest.raises(TypeError) as err:
        Half()
    for member in ("no_backward_sync", "setup_module", "teardown", "unwrap_module"):
        assert member in str(err.value)


def test_every_registered_strategy_implements_the_contract():
    for name in available_strategies():
        if name == "auto":
            continue
        cls = strategy_class(name)
        assert issubclass(cls, Strategy), name
        assert not cls.__abstractmethods__, (name, cls.__abstractmethods__)
    assert strategy_for_checkpoint_engine("deepspeed").__name__ == "DeepSpeedStrategy"
    assert strategy_for_checkpoint_engine("no-such-engine") is None


def test_unknown_strategy_lists_the_registry():
    with pytest.raises(ValueError, match=r"Unknown strategy 'dpp'.*'ddp'.*'deepspeed_stage_3'.*'single'"):
        create_strategy("dpp")


def test_launch_takes_its_strategy_choices_from_the_registry():
    from fabric_lite.launch.config_file import STRATEGIES

    assert list(STRATEGIES) == available_strategies()
    proc = subprocess.run([sys.executable, "-m", "fabric_lite.cli", "launch", "--strategy", "single_device", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


class Recording(SingleDeviceStrategy):
    """One device, with every optional hook overridden to record that the doors called it."""

    def __init__(self):
        super().__init__()
        self.fed = 0
        self.marks = 0
        self.optimizer_modules = []
        self.adapted = None
        self.checkpoint_format = self.format_type(self)

    def adapt_precision(self, precision):
        self.adapted = precision.name
        return precision

    class runtime_type(Runtime):  # the runtime's hooks: its device feed and its step marker
        def __init__(self, strategy):
            super().__init__(strategy)
            self.step_marker = self.mark

        def device_feed(self, non_blocking=False):
            def feed(batch):
                self.strategy.fed += 1
                return batch

            return feed

        def mark(self):
            self.strategy.marks += 1

    runtime = RuntimeSlot(runtime_type)

    class format_type(CheckpointFormat):  # the state dict reads: the optimizer's, with the model it trains
        def optimizer_state_dict(self, module, optimizer):
            self.strategy.optimizer_modules.append(module)
            return super().optimizer_state_dict(module, optimizer)


def loader():
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def test_accelerator_calls_the_hooks(tmp_path):
    strategy = Recording()
    acc = Accelerator(strategy=strategy, cpu=True, gradient_accumulation_steps=3)
    assert strategy.adapted == "32-true"
    opt_first = torch.optim.SGD([p for p in nn.Linear(1, 1).parameters()], lr=0.1)  # prepared before its model
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_first, model, opt, prepared = acc.prepare(opt_first, model, opt, loader())
    for x, y in prepared:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert strategy.fed == 3  # every batch went through the strategy's feed
    assert strategy.marks == 1  # one window of three micro-steps: one real optimizer step, one marker
    # the loader is still the prepared one: position, epoch and sizes
    assert prepared.state_dict()["epoch"] == 1 and prepared.total_batch_size == 4
    acc.save_state(str(tmp_path / "ckpt"))
    assert strategy.optimizer_modules == [None, model]  # each optimizer's state with the model it trains


def test_trainer_calls_the_hooks(tmp_path):
    class Module(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = Recording()
    trainer = Trainer(strategy=strategy, accelerator="cpu", max_epochs=2, accumulate_grad_batches=2,
                      enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(Module(), loader())
    assert strategy.fed == 6
    assert strategy.marks == trainer.global_step == 4  # windows of 2 and 1 batch, twice
    assert strategy.optimizer_modules and all(m is trainer.model for m in strategy.optimizer_modules)


class Joint(Recording):
    """A strategy that must see models and optimizers together (an engine that owns the step, as DeepSpeed's)."""

    def __init__(self):
        super().__init__()
        self.engine_step = EngineStep()

    def setup(self, modules, optimizers):
        self.joint = (len(modules), len(optimizers))
        return super().setup(modules, optimizers)

    def setup_module(self, module):
        if not getattr(self, "joint", None):
            raise RuntimeError("setup_module outside setup()")
        return super().setup_module(module)


def test_joint_setup_gets_several_models_and_optimizers():
    strategy = Joint()
    acc = Accelerator(strategy=strategy, cpu=True)
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, opt_a, b, opt_b = acc.prepare(a, opt_a, b, opt_b)
    assert strategy.joint == (2, 2)
    assert [o.module for o in acc.optimizers] == [a, b]


def test_the_doors_do_not_branch_on_strategy_types():
    """Capabilities, not isinstance checks or engine names, in the doors and the checkpoint layer."""
    import inspect

    from fabric_lite.accelerator import accelerator
    from fabric_lite.checkpoint import state
    from fabric_lite.trainer import loops, trainer

    for module in (accelerator, trainer, loops, state):
        source = inspect.getsource(module)
        assert '"deepspeed"' not in source and "DeepSpeedStrategy" not in source, module.__name__
        assert "DDPStrategy" not in source, module.__name__


def test_listing_strategies_imports_no_torch():
    """The launcher and the config file read the registry before any strategy (or torch) is needed."""
    code = ("import sys; import fabric_lite.strategies.registry as r, fabric_lite.launch.config_file; "
            "assert 'deepspeed_stage_3' in r.available_strategies(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_launch_refuses_a_one_process_strategy_on_several():
    from fabric_lite.cli.launch_flags import launch_command_parser
    from fabric_lite.launch.launch_checks import LaunchError, check_launch

    args = launch_command_parser().parse_args(["--nproc-per-node", "2", "--strategy", "single", "train.py"])
    with pytest.raises(LaunchError, match=r"--strategy single trains in one process.*--strategy ddp"):
        check_launch(args)
    check_launch(launch_command_parser().parse_args(["--strategy", "single", "train.py"]))  # one process: fine


def test_topology_names_the_data_parallel_group():
    strategy = SingleDeviceStrategy()
    assert (strategy.dp_size, strategy.dp_rank) == (strategy.world_size, strategy.global_rank) == (1, 0)
    assert strategy.device_mesh.names == ("dp",) and strategy.device_mesh.size("dp") == 1
    with pytest.raises(KeyError, match="no dimension 'tp'"):
        strategy.device_mesh.size("tp")


@pytest.mark.parametrize("cls, flags", [
    ("SingleDeviceStrategy", ("state_dict", True, True, False)),
    ("FSDPStrategy", ("dcp", False, True, True)),
    ("XLAStrategy", ("state_dict", True, False, False)),
])
def test_the_checkpoint_format_holds_the_state_dicts_and_its_strategy_weakly(cls, flags):
    """The full state dict reads and writes are the checkpoint format's, not the strategy's; the format holds its
    strategy weakly, so a dropped strategy is freed at once (no cycle), as with its runtime."""
    import fabric_lite.strategies as strategies

    strategy = getattr(strategies, cls)()
    fmt = strategy.checkpoint_format
    assert (fmt.kind, fmt.partial_gradients, fmt.background, fmt.weights_on_rank_zero) == flags
    assert fmt.strategy is strategy
    for name in ("module_state_dict", "load_module_state_dict", "optimizer_state_dict", "load_optimizer_state_dict",
                 "to_host"):
        assert not hasattr(strategy, name) and callable(getattr(fmt, name))
    if cls == "SingleDeviceStrategy":
        model = nn.Linear(2, 1)
        state = fmt.module_state_dict(model)
        assert state.keys() == model.state_dict().keys()
        fmt.load_module_state_dict(model, {k: torch.zeros_like(v) for k, v in state.items()})
        assert not model.weight.any() and fmt.to_host(state) is state
    assert not any(r is strategy for r in gc.get_referents(vars(fmt)))  # only a weak reference
    if strategy.process_group is not None:
        return  # (its process group holds it: freed by the garbage collector)
    gc.disable()
    try:
        gone = weakref.ref(strategy)
        del strategy
        assert gone() is None
        with pytest.raises(RuntimeError, match="is gone"):
            fmt.strategy
    finally:
        gc.enable()


def test_collaborators_each_say_one_thing():
    from fabric_lite.strategies.ddp import DDPStrategy
    from fabric_lite.strategies.fsdp import FSDPStrategy

    single, ddp = SingleDeviceStrategy(), DDPStrategy(process_group_backend="gloo")
    assert single.process_group is None and single.engine_step is None and single.checkpoint_format.engine is None
    assert ddp.process_group.backend == ddp.backend == "gloo" and ddp.timeout == ddp.process_group.timeout
    assert FSDPStrategy().checkpoint_format.kind == "dcp" and FSDPStrategy(state_dict_type="full").checkpoint_format.engine is None
    step = EngineStep()
    with step.micro_step():
        assert not step.boundary
        with step.closing_step():
            assert step.boundary
        assert not step.boundary
    assert step.boundary
