"""DataLoaderConfiguration, field by field, and stateful dataloaders: `state_dict()` mid-epoch and a fresh
loader's `load_state_dict()`, torchdata's StatefulDataLoader given to prepare, and runs SIGKILLed mid-epoch
after `save_state` that resume (1 and 2 processes, num_workers 0 and 2, dispatched batches) with exactly the
uninterrupted run's batches and weights."""

import json
import signal
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fabric_lite import Accelerator, DataLoaderConfiguration, set_seed
from fabric_lite.data import loader as loader_module
from fabric_lite.data.seedable import SeedableRandomSampler
from conftest import WORKERS, free_port, run_command


class Noisy(Dataset):
    """Sample i: (i, noise from torch's RNG: the worker's with num_workers > 0)."""

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return torch.tensor(i), torch.rand(())


def _ids(batches):
    return [(b[0].tolist(), [round(v, 6) for v in b[1].tolist()]) for b in batches]


# -- the fields ---------------------------------------------------------------------------------------------

def test_the_fields_and_defaults_are_accelerates():
    assert {f.name: f.default for f in fields(DataLoaderConfiguration)} == {
        "split_batches": False, "dispatch_batches": None, "even_batches": True, "use_seedable_sampler": False,
        "data_seed": None, "non_blocking": False, "use_stateful_dataloader": False}
    config = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=True, data_seed=np.int64(5),
                                     use_seedable_sampler=True, non_blocking=True)
    assert config.data_seed == 5 and type(config.data_seed) is int
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    assert accelerator.dataloader_config.use_stateful_dataloader is True
    assert accelerator.dataloader_config.dispatch_batches is True


@pytest.mark.parametrize("kwargs, error, words", [
    ({"use_stateful_dataloader": "yes"}, TypeError, "use_stateful_dataloader='yes'"),
    ({"split_batches": 1}, TypeError, "split_batches=1"),
    ({"even_batches": None}, TypeError, "even_batches=None"),
    ({"non_blocking": "False"}, TypeError, "non_blocking='False'"),
    ({"use_seedable_sampler": 0}, TypeError, "use_seedable_sampler=0"),
    ({"dispatch_batches": "auto"}, TypeError, "True, False or None"),
    ({"data_seed": 1.5}, TypeError, "data_seed=1.5"),
    ({"data_seed": True}, TypeError, "pass an integer seed"),
    ({"data_seed": 2 ** 64}, ValueError, "[-2**63, 2**64)"),
])
def test_bad_values_are_refused_naming_the_field_and_the_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        DataLoaderConfiguration(**kwargs)
    assert words in str(info.value) and "DataLoaderConfiguration(" in str(info.value)


def test_a_field_changed_after_construction_is_checked_at_prepare():
    accelerator = Accelerator(cpu=True)
    accelerator.dataloader_config.use_stateful_dataloader = "on"
    with pytest.raises(TypeError, match="use_stateful_dataloader='on'"):
        accelerator.prepare(DataLoader(range(4), batch_size=2))


def test_non_blocking_reaches_the_device_copy(monkeypatch):
    calls = []
    real = loader_module.move_to_device
    monkeypatch.setattr(loader_module, "move_to_device", lambda b, d, nb: calls.append(nb) or real(b, d, nb))
    for flag in (True, False):
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(non_blocking=flag))
        prepared = loader_module.shard_dataloader(
            DataLoader(range(4), batch_size=2), num_replicas=1, rank=0, device=torch.device("cpu"),
            gradient_state=accelerator.gradient_state, non_blocking=accelerator.dataloader_config.non_blocking)
        assert [b.tolist() for b in prepared] == [[0, 1], [2, 3]]
    assert calls == [True, True, False, False]


def test_dispatch_batches_on_one_process_reads_as_usual():
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    assert [b.tolist() for b in accelerator.prepare(DataLoader(range(5), batch_size=2))] == [[0, 1], [2, 3], [4]]


# -- use_seedable_sampler, data_seed -------------------------------------------------------------------------

def _orders(config, epochs=3, disturb=False):
    set_seed(11)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=5, shuffle=True))
    out = []
    for _ in range(epochs):
        if disturb:
            torch.rand(7)  # the global RNG used between epochs (dropout, another loader)
        out.append([i for (b,) in loader for i in b.tolist()])
    return out, loader


def test_a_seedable_sampler_orders_each_epoch_by_seed_and_epoch_only():
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=123)
    orders, loader = _orders(config)
    assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    for epoch, order in enumerate(orders):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(123 + epoch)).tolist()
        assert order == expected
    assert _orders(config, disturb=True)[0] == orders  # global RNG use does not change it
    assert _orders(DataLoaderConfiguration(use_seedable_sampler=True, data_seed=124))[0] != orders
    # data_seed None: torch.initial_seed(), which set_seed(11) set
    assert _orders(DataLoaderConfiguration(use_seedable_sampler=True))[0][0] == \
        torch.randperm(10, generator=torch.Generator().manual_seed(11)).tolist()
    # off (the default): the plain loader's order, drawn from the global RNG, which the disturbance changes
    plain, _ = _orders(DataLoaderConfiguration())
    assert plain != orders and _orders(DataLoaderConfiguration(), disturb=True)[0] != plain


def test_a_seedable_sampler_resumes_mid_epoch_with_its_seed(tmp_path):
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    list(loader)
    it = iter(loader)
    next(it)
    accelerator.save_state(str(tmp_path / "ckpt"))
    rest = [b.tolist() for (b,) in it] + [b.tolist() for (b,) in loader]
    other = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=9))
    resumed = other.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
    other.load_state(str(tmp_path / "ckpt"))  # the saved seed (5) wins over this run's
    assert [b.tolist() for (b,) in resumed] + [b.tolist() for (b,) in resumed] == rest


# -- use_stateful_dataloader: the StatefulDataLoader protocol ------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_mid_epoch_and_a_fresh_loaders_load_state_dict_continue_exactly(num_workers):
    # (the order drawn from a generator of the loader's: a plain loader without one draws each epoch's order from
    # the global RNG, which `load_state` restores and `load_state_dict` alone does not)
    def prepared():
        set_seed(4)
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        return accelerator.prepare(DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers,
                                              generator=torch.Generator().manual_seed(8)))

    reference = prepared()
    full = _ids(reference) + _ids(reference)
    loader = prepared()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    state = loader.state_dict()
    assert state["batches_seen"] == 2 and state["epoch"] == 0
    tail = list(it)
    assert _ids(head + tail) + _ids(loader) == full
    fresh = prepared()
    fresh.load_state_dict(state)
    assert fresh.state_dict()["batches_seen"] == 2  # before iterating: the loaded position
    # The batches (their order from the loader's generator) and, drawn by workers, their random values; drawn in
    # this process they come from the global RNG, which is not the loader's to keep (load_state restores it).
    per_epoch = len(full) // 2
    kept = (lambda b: b) if num_workers else (lambda b: [ids for ids, _ in b])
    assert kept(_ids(fresh)) == kept(full[2:per_epoch])  # the epoch's remaining batches
    assert kept(_ids(fresh)) == kept(full[per_epoch:])  # and the next epoch
    end = prepared()
    list(end)
    again = prepared()
    again.load_state_dict(end.state_dict())  # saved at an epoch's end: the next epoch, whole
    assert kept(_ids(again)) == kept(full[per_epoch:])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_torchdata_stateful_dataloader_given_to_prepare_works(num_workers, tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def prepared():
        set_seed(4)
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        user = stateful.StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers)
        return accelerator, accelerator.prepare(user)

    _, reference = prepared()
    full = _ids(reference) + _ids(reference)
    accelerator, loader = prepared()
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert _ids(head + list(it)) + _ids(loader) == full
    other, fresh = prepared()
    other.load_state(str(tmp_path / "ckpt"))
    assert _ids(fresh) + _ids(fresh) == full[3:]


def test_a_stateful_dataloader_with_a_state_loaded_before_prepare_is_refused():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    user = stateful.StatefulDataLoader(Noisy(), batch_size=4)
    user.load_state_dict(user.state_dict())
    with pytest.raises(ValueError, match="before prepare.*load_state_dict on the loader prepare\\(\\) returns"):
        Accelerator(cpu=True).prepare(user)


# -- killed mid-epoch, resumed in a fresh process -------------------------------------------------------------

def _launch(nproc, phase, root, out, extra=()):
    script = WORKERS / "stateful_resume.py"
    if nproc == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    return run_command(cmd + ["--phase", phase, "--root", str(root), "--out", str(out), *extra],
                       timeout=180, cwd=WORKERS)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_mid_epoch_after_save_state_a_fresh_run_continues_with_the_uninterrupted_batches(nproc, tmp_path):
    crashed, resumed = tmp_path / "crashed", tmp_path / "resumed"
    crashed.mkdir()
    resumed.mkdir()
    proc = _launch(nproc, "crash", tmp_path / "ckpts", crashed, ["--dispatch-checks"] if nproc > 1 else [])
    assert proc.returncode != 0 and "not killed" not in proc.stderr  # SIGKILLed (torchrun reports its children)
    assert proc.returncode == -signal.SIGKILL or "SIGKILL" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    proc = _launch(nproc, "resume", tmp_path / "ckpts", resumed)
    assert proc.returncode == 0, proc.stderr[-6000:]
    cases = None
    for rank in range(nproc):
        full = json.loads(Path(crashed, f"rank{rank}.json").read_text())
        after = json.loads(Path(resumed, f"rank{rank}.json").read_text())["resumed"]
        cases = sorted(full["full"])
        for case in cases:
            steps, rest = full["full"][case]["steps"], after[case]["steps"]
            assert 0 < len(rest) < len(steps), case
            assert rest == steps[-len(rest):], f"rank {rank}, {case}: other batches after the resume"
            assert after[case]["weights"] == full["full"][case]["weights"], f"rank {rank}, {case}"
        for name, runs in full.get("dispatch", {}).items():
            dispatched, own = runs["True"], runs["False"]
            assert dispatched["epochs"] == own["epochs"], f"rank {rank}, {name}: other batches when dispatched"
            assert (dispatched["len"], dispatched["remainder"]) == (own["len"], own["remainder"]), name
            if name.startswith("stream"):  # read by the main process alone
                assert (dispatched["reads"] > 0) == (rank == 0) and own["reads"] > 0, name
    expected = {"plain_w0", "plain_w2", "stateful_w0", "stateful_w2"}
    if nproc > 1:
        expected |= {"stateful_stream_dispatched", "stateful_dispatched_w2"}
    assert set(cases) == expected
