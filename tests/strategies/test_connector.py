"""Bad requests are refused with one clear error that names the value, the allowed values and the fix."""

import pytest
import torch

from fabric_lite.strategies.connector import connect
from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.strategies import DDPStrategy, SingleDeviceStrategy, available_strategies, create_strategy


def test_auto_is_single_alone_and_ddp_under_a_launcher():
    assert isinstance(connect("auto", "cpu"), SingleDeviceStrategy)
    launched = ProcessInfo(world_size=2, global_rank=1, local_rank=1, local_world_size=2, master_port=1234)
    strategy = connect("auto", "cpu", process=launched)
    assert isinstance(strategy, DDPStrategy)
    assert strategy.backend == "gloo" and strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_registry_names():
    assert {"auto", "single", "ddp"} <= set(available_strategies())
    assert isinstance(create_strategy("DDP"), DDPStrategy)


def test_unknown_strategy_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"Unknown strategy 'dpp'.*'ddp'.*DDPStrategy"):
        connect("dpp", "cpu")


def test_unknown_precision_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"Unknown precision 'fp17'.*'bf16-mixed'"):
        connect("auto", "cpu", precision="fp17")


def test_unknown_accelerator():
    with pytest.raises(ValueError, match=r"Unknown accelerator 'tpu9'.*'cpu'"):
        connect("auto", "tpu9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_one_says_what_to_do():
    with pytest.raises(ValueError, match=r"accelerator='cuda'.*no CUDA device.*accelerator='cpu'"):
        connect("auto", "cuda")
    with pytest.raises(ValueError, match=r"no CUDA device"):
        connect("auto", "gpu", precision="bf16-true")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_devices_beyond_what_is_there():
    with pytest.raises(ValueError, match=r"devices=4 needs 4 processes.*fabric-lite launch --nproc-per-node 4"):
        connect("auto", "cpu", devices=4)
    launched = ProcessInfo(world_size=2, global_rank=0, local_rank=0, local_world_size=2, master_port=1)
    with pytest.raises(ValueError, match=r"devices=3 disagrees with the launcher, which started 2"):
        connect("auto", "cpu", devices=3, process=launched)
    with pytest.raises(ValueError, match=r"devices=0 is not valid"):
        connect("auto", "cpu", devices=0)


def test_strategy_must_be_a_name_or_instance():
    with pytest.raises(TypeError, match="strategy must be a name or a Strategy instance"):
        connect(42, "cpu")


def test_single_strategy_refuses_to_run_as_independent_copies():
    launched = ProcessInfo(world_size=2, global_rank=1, local_rank=1, local_world_size=2, master_port=1)
    strategy = connect("single", "cpu", process=launched)
    with pytest.raises(RuntimeError, match=r"strategy='single'.*rank 1 of 2.*strategy='ddp'"):
        strategy.setup_environment()


def test_ddp_without_rendezvous_address_is_refused():
    strategy = connect("ddp", "cpu", process=ProcessInfo(world_size=2, global_rank=0, local_world_size=2))
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT"):
        strategy.setup_environment()
