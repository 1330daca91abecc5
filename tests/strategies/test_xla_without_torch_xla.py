"""XLA where torch_xla cannot run (the main environment): one sentence naming the versions and the fix, in the
doors, `fabric-lite launch --tpu` and `is_torch_xla_available`. The XLA strategy itself: tests/xla."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT

needs_no_torch_xla = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")


@pytest.fixture
def fake_torch_xla(tmp_path, monkeypatch):
    """A torch_xla 2.9.0 distribution's metadata (no code) on sys.path: what pip leaves next to another torch."""
    info = tmp_path / "torch_xla-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.9.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "2.9.0"


@needs_no_torch_xla
@pytest.mark.parametrize("make", ["accelerator", "trainer", "strategy"])
def test_asking_for_xla_without_torch_xla_names_torch_and_the_command(make):
    from fabric_lite import Accelerator, Trainer

    build = {"accelerator": lambda: Accelerator(accelerator="tpu"), "trainer": lambda: Trainer(accelerator="tpu"),
             "strategy": lambda: Accelerator(strategy="xla")}[make]
    with pytest.raises(ImportError) as info:
        build()
    message = str(info.value)
    assert "torch_xla, which is not installed" in message and torch.__version__ in message
    assert "pip install torch==2.9.0 torch_xla==2.9.0" in message and "make venv-xla" in message


@needs_no_torch_xla
def test_torch_xla_built_for_another_torch_is_refused_naming_both_versions(fake_torch_xla):
    from fabric_lite import Accelerator
    from fabric_lite.utils import is_torch_xla_available

    if torch.__version__.startswith("2.9."):
        pytest.skip("this torch is the one torch_xla 2.9 needs")
    with pytest.raises(ImportError) as info:
        Accelerator(accelerator="xla")
    message = str(info.value)
    assert f"torch_xla {fake_torch_xla} is installed next to torch {torch.__version__}" in message
    assert "pip install torch==2.9.0 torch_xla==2.9.0" in message
    assert is_torch_xla_available() is False


@needs_no_torch_xla
def test_is_torch_xla_available_is_false_without_it_and_cheap():
    from fabric_lite.utils import is_torch_xla_available

    assert is_torch_xla_available() is False and is_torch_xla_available(check_is_tpu=True) is False
    assert "torch_xla" not in sys.modules


def launch(*args, env=None):
    import os

    full = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "fabric_lite.cli", "launch", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


@needs_no_torch_xla
def test_fabric_lite_launch_tpu_without_torch_xla_says_what_to_install(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = launch("--tpu", str(script), env={"PJRT_DEVICE": "CPU"})
    assert proc.returncode == 2, proc.stderr
    assert "torch_xla, which is not installed" in proc.stderr and "pip install torch==2.9.0" in proc.stderr
    assert "must not run" not in proc.stderr


@pytest.mark.parametrize("flags, expected", [
    (["--tpu", "--cpu"], "--cpu and --tpu ask for two different devices"),
    (["--tpu", "--nnodes", "2"], "run the same command on every TPU host"),
    (["--strategy", "xla_spmd", "--nproc-per-node", "2"], "drives every XLA device from one process"),
    (["--tpu", "--strategy", "ddp"], "XLA devices train with --strategy xla"),
    (["--tpu", "--nproc-per-node", "0"], "must be a whole number >= 1"),
    (["--tpu", "--module"], "--module / --no-python with --tpu"),
])
def test_fabric_lite_launch_refuses_xla_launches_that_cannot_work(tmp_path, flags, expected):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = launch(*flags, str(script))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


def test_replicas_on_a_tpu_are_counted_by_torch_xla_not_by_the_flag(monkeypatch):
    from fabric_lite.launch.xla_launch import xla_replica_env

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert xla_replica_env(3, {"X": "1"}) == {"X": "1", "FABRIC_LITE_ACCELERATOR": "xla", "CPU_NUM_DEVICES": "3"}
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert "CPU_NUM_DEVICES" not in xla_replica_env(None, {})
    monkeypatch.delenv("PJRT_DEVICE")
    with pytest.raises(ValueError, match="PJRT_DEVICE is not set"):
        xla_replica_env(2, {})


def runtime(world, ordinal, local, devices_per_process, hosts=1):
    return SimpleNamespace(world_size=lambda: world, global_ordinal=lambda: ordinal, local_ordinal=lambda: local,
                           local_device_count=lambda: world // hosts, host_index=lambda: ordinal // (world // hosts),
                           addressable_device_count=lambda: devices_per_process,
                           global_runtime_device_count=lambda: world)


def test_the_pjrt_world_comes_from_torch_xla_runtime_not_the_environment():
    from fabric_lite.strategies.xla_env import detect_xla_process

    one = detect_xla_process(runtime(1, 0, 0, 1))
    assert (one.world_size, one.global_rank, one.is_distributed) == (1, 0, False)
    # replicas that are threads of one process (XLA's CPU device): each thread asks, and gets its own rank
    threads = detect_xla_process(runtime(2, 1, 1, 2))
    assert (threads.world_size, threads.global_rank, threads.local_rank, threads.local_world_size) == (2, 1, 1, 2)
    assert "2 replicas, 2 per process" in threads.source
    # two TPU hosts of 4 chips, one process per chip: the 7th replica is on host 1
    pod = detect_xla_process(runtime(8, 6, 2, 1, hosts=2))
    assert (pod.global_rank, pod.local_rank, pod.local_world_size, pod.node_rank, pod.num_nodes) == (6, 2, 4, 1, 2)
    spmd = detect_xla_process(runtime(4, 0, 0, 4), spmd=True)
    assert spmd.world_size == 1 and "SPMD over 4 device(s)" in spmd.source


def test_auto_picks_xla_only_where_pjrt_device_says_so(monkeypatch):
    from fabric_lite.strategies.connector import resolve_accelerator as resolve
    from fabric_lite.strategies.environments import read_launch_environment

    def resolve_accelerator(name):  # (the doors hand the connector the launch environment they read)
        return resolve(name, read_launch_environment().runtimes)

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert resolve_accelerator("auto") == "cpu"
    assert resolve_accelerator("tpu") == resolve_accelerator("xla") == "xla"
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert resolve_accelerator("auto") == "xla"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # what importing torch_xla sets where it finds no TPU: not a reason
    assert resolve_accelerator("auto") == "cpu"


def test_a_strategy_instance_without_aliases_works_in_the_trainer():
    from fabric_lite import Trainer
    from fabric_lite.strategies.single import SingleDeviceStrategy

    class Mine(SingleDeviceStrategy):
        traits = SingleDeviceStrategy.traits.but(names=())

    assert isinstance(Trainer(strategy=Mine(), enable_progress_bar=False).strategy, Mine)


@pytest.mark.parametrize("flag", [["--main-training-function", "main"]])  # (--num-processes: Accelerate's total)
def test_xla_launch_flags_are_refused_for_torchrun_launches(tmp_path, flag):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    proc = launch(*flag, str(script))
    assert proc.returncode == 2 and "applies to XLA launches (--tpu)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags", [["--tpu"], ["--strategy", "xla_spmd"]])
def test_explain_refuses_an_xla_launch_instead_of_planning_torchrun(tmp_path, flags):
    import os

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    proc = subprocess.run([sys.executable, "-m", "fabric_lite.cli", "explain", *flags, str(script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "an XLA launch" in proc.stderr and "must not run" not in proc.stderr, proc.stderr
