"""The runtime collaborator (strategies/runtime.py), without torch_xla: its kinds, the runtime a Trainer's
arguments give (the re-launcher), the slot on a strategy, and a runtime's random stream in seed.py."""

import gc
import random
import weakref

import pytest
import torch

from fabric_lite import rng_state, seed
from fabric_lite.strategies import SingleDeviceStrategy, XLASPMDStrategy, XLAStrategy
from fabric_lite.strategies.connector import runtime_class
from fabric_lite.strategies.runtime import PROCESS_PER_DEVICE, REPLICAS, SPMD, Runtime, RuntimeSlot
from fabric_lite.trainer.relaunch import relaunch_if_needed


@pytest.mark.parametrize("accelerator, strategy, kind", [
    ("auto", "auto", PROCESS_PER_DEVICE), ("cpu", "ddp", PROCESS_PER_DEVICE), ("tpu", "auto", REPLICAS),
    ("tpu", "ddp", REPLICAS), ("cpu", "xla", REPLICAS), ("auto", "xla_spmd", SPMD), ("xla", "xla_spmd", SPMD),
])
def test_the_runtime_of_a_trainers_arguments(monkeypatch, accelerator, strategy, kind):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert runtime_class(accelerator, strategy).kind == kind


def test_pjrt_device_naming_a_tpu_makes_auto_replicas(monkeypatch):
    from fabric_lite.strategies.environments import read_launch_environment

    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # (the Trainer hands on the launch environment it read)
    assert runtime_class("auto", "auto", read_launch_environment().runtimes).kind == REPLICAS
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # (importing torch_xla sets it where it finds no TPU)
    assert runtime_class("auto", "auto", read_launch_environment().runtimes) is Runtime


def test_the_slot_gives_the_class_to_the_class_and_one_runtime_to_each_instance():
    assert XLAStrategy.runtime.device_type == "xla" and XLASPMDStrategy.runtime.kind == SPMD
    strategy = SingleDeviceStrategy()
    runtime = strategy.runtime
    assert runtime is strategy.runtime and runtime.strategy is strategy and type(runtime) is Runtime
    assert runtime.step_marker is None and runtime.device_feed() is None and not runtime.drives_all_devices
    assert SingleDeviceStrategy().runtime is not runtime
    assert XLASPMDStrategy().runtime.drives_all_devices and not XLAStrategy().runtime.drives_all_devices


@pytest.mark.parametrize("cls", [SingleDeviceStrategy, XLAStrategy])
def test_a_dropped_strategy_is_freed_at_once_though_its_runtime_was_used(cls):
    """The runtime holds its strategy weakly: no cycle keeps a finished run's strategy, and the parameters it
    recorded, alive until the garbage collector runs (on XLA their pending work would join the next run's graph,
    and an exact resume would differ in the last bits)."""
    gc.disable()
    try:
        strategy = cls()
        runtime = strategy.runtime
        assert runtime.strategy is strategy
        gone = weakref.ref(strategy)
        del strategy
        assert gone() is None and runtime.strategy is None
    finally:
        gc.enable()


def test_a_runtime_of_its_own_is_a_subclass_named_by_the_slot():
    class Counting(Runtime):
        def __init__(self, strategy):
            super().__init__(strategy)
            self.step_marker = self.mark
            self.marks = 0

        def mark(self):
            self.marks += 1

    class Strategy(SingleDeviceStrategy):
        runtime = RuntimeSlot(Counting)

    strategy = Strategy()
    strategy.runtime.step_marker()
    assert strategy.runtime.marks == 1 and Strategy.runtime is Counting


def test_one_spmd_process_is_never_relaunched(monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("relaunched"))
    relaunch_if_needed(4, 1, runtime_class("auto", "xla_spmd"))


def test_a_runtime_stream_added_later_gets_the_seed_set_before(monkeypatch):
    monkeypatch.setattr(rng_state, "_RUNTIME_RNGS", {})
    monkeypatch.setattr(rng_state, "_seed_pending", None)
    stream = {"state": 0}
    seed.set_seed(11)
    seed.add_runtime_rng("dev", lambda: stream["state"], lambda s: stream.update(state=s))
    assert stream["state"] == 11  # applied when the runtime started
    seed.set_seed(12)
    assert stream["state"] == 12
    state = seed.capture_rng_state()
    assert state["dev"] == 12
    stream["state"] = 99
    random.random(), torch.rand(1)
    seed.restore_rng_state(state)
    assert stream["state"] == 12
