"""Accelerate's read-back members of an Accelerator: the handler attributes, the data-loader and precision settings,
`on_local_process`, `verify_device_map`, `lomo_backward`, and what scripts branch on (`multi_device`, `is_fsdp2`,
`should_save_model`, `fp8_backend`)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import (
    Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs,
    PartialState,
)
from fabric_lite.accelerator.run_settings import HANDLER_ATTRIBUTES, FP8BackendType


@pytest.fixture(autouse=True)
def _fresh_state():
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def test_each_handler_is_kept_under_accelerates_attribute_and_the_rest_read_none():
    ddp, scaler, init = DistributedDataParallelKwargs(bucket_cap_mb=5), GradScalerKwargs(init_scale=8.0), \
        InitProcessGroupKwargs()
    acc = Accelerator(kwargs_handlers=[scaler, ddp, init])
    assert acc.ddp_handler is ddp and acc.scaler_handler is scaler and acc.init_handler is init
    bare = Accelerator()
    for name in HANDLER_ATTRIBUTES:
        assert getattr(bare, name) is None, name
    assert bare.has_fp8_handler is False and bare.fp8_enabled is False
    assert bare.fp8_backend == FP8BackendType.NO == "NO"


def test_the_accelerator_is_built_from_one_run_config_and_keeps_it(monkeypatch):
    from fabric_lite.settings import resolve_run_config
    from fabric_lite.strategies.environments import ENV_MIXED_PRECISION

    monkeypatch.setenv(ENV_MIXED_PRECISION, "bf16")  # read once, by the door, into its RunConfig
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert (acc.run_config.precision, acc.run_config.accelerator) == ("bf16", "cpu")
    assert acc.run_config.launch.mixed_precision == "bf16" and acc.mixed_precision == "bf16"
    built = Accelerator.from_run_config(resolve_run_config({"cpu": True, "gradient_accumulation_steps": 3}))
    assert built.mixed_precision == "no" and built.gradient_accumulation_steps == 3  # (no environment read)
    assert built.device.type == "cpu" and built.explain_arguments is None


def test_two_handlers_of_one_kind_are_refused_by_name():
    with pytest.raises(ValueError, match="two GradScalerKwargs objects; pass one"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)])


def test_settings_read_back_from_where_they_live():
    config = DataLoaderConfiguration(split_batches=True, even_batches=False, non_blocking=True)
    acc = Accelerator(dataloader_config=config, gradient_accumulation_steps=3, rng_types=["torch", "generator"])
    assert acc.split_batches is True and acc.even_batches is False and acc.non_blocking is True
    assert acc.use_seedable_sampler is config.use_seedable_sampler
    assert acc.use_stateful_dataloader is False
    assert acc.gradient_accumulation_steps == 3 and acc.rng_types == ["torch", "generator"]
    assert Accelerator(rng_types="torch").rng_types == ["torch"] and Accelerator().rng_types == ["generator"]
    acc.gradient_accumulation_steps = 4
    assert acc.gradient_accumulation_plugin.num_steps == 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        acc.gradient_accumulation_steps = 0


def test_one_process_answers_what_scripts_branch_on():
    acc = Accelerator(cpu=True)
    assert acc.multi_device is False and acc.is_fsdp2 is False and acc.is_composable_parallelism_enabled is False
    assert acc.should_save_model is True and acc.mixed_precision == "no" and acc.native_amp is False
    with acc.maybe_context_parallel(buffers=[torch.zeros(2)], buffer_seq_dims=[0]):
        pass


def test_on_local_process_runs_only_on_that_local_index():
    acc = Accelerator(cpu=True)
    ran = []

    @acc.on_local_process(local_process_index=0)
    def first(x):
        ran.append(("first", x))
        return x

    def second(x):
        ran.append(("second", x))

    assert first(3) == 3
    assert acc.on_local_process(second, local_process_index=1)(4) is None
    assert ran == [("first", 3)]
    with pytest.raises(TypeError, match="needs local_process_index"):
        acc.on_local_process(second)
    # as process 1 on its machine: the decorator for index 1 runs and the one for 0 does not
    class SecondOnItsMachine(PartialState):
        local_process_index = 1

    state = SecondOnItsMachine()
    assert state.on_local_process(second, local_process_index=1)(5) is None and ran[-1] == ("second", 5)
    assert state.on_local_process(local_process_index=0)(first)(6) is None and ran[-1] == ("second", 5)


def test_verify_device_map_sees_a_model_spread_over_devices():
    acc = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert acc.verify_device_map(model) is False
    model[1].hf_device_map = {"0": "cpu"}
    assert acc.verify_device_map(model) is False
    model[1].hf_device_map = {"0": 0, "1": "cpu"}
    assert acc.verify_device_map(model) is True


class FusedSGD(torch.optim.Optimizer):
    """An optimizer with LOMO's protocol: `fused_backward(loss, lr)` runs backward and updates each parameter."""

    def __init__(self, params):
        super().__init__(params, {})

    def fused_backward(self, loss, lr):
        loss.backward()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p -= lr * p.grad
                    p.grad = None


def test_lomo_backward_updates_through_the_fused_optimizer_and_says_what_is_missing():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=8)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    acc = Accelerator(cpu=True)
    model, optimizer, data = acc.prepare(model, FusedSGD(model.parameters()), data)
    assert acc.has_lomo_optimizer is True
    x, y = next(iter(data))
    acc.lomo_backward(nn.functional.mse_loss(model(x), y), 0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="needs the learning rate"):
        acc.lomo_backward(model(x).sum(), None)
    plain = Accelerator(cpu=True)
    other = nn.Linear(3, 1)
    plain.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    assert plain.has_lomo_optimizer is False
    with pytest.raises(ValueError, match=r"no LOMO optimizer among the prepared ones \(\['SGD'\]\)"):
        plain.lomo_backward(other(x).sum(), 0.1)


def test_members_accelerate_keeps_for_its_engines_read_as_here():
    acc = Accelerator(cpu=True)
    assert acc.deepspeed_engine_wrapped is None and acc.delayed_fp8_autocast is False
    assert acc.flag_tensor.tolist() == [0] and acc.check_trigger() is False
    acc.set_trigger()
    assert acc.flag_tensor.tolist() == [1] and acc.check_trigger() is True and acc.flag_tensor.tolist() == [0]
