"""A prepared loader's order against a plain DataLoader's, epoch after epoch: one process (in this process),
several ranks simulated here, 2 real processes (tests/workers/data_order.py), and exact resume in a later epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SubsetRandomSampler, TensorDataset

from fabric_lite import Accelerator, set_seed
from fabric_lite.data.loader import shard_dataloader
from fabric_lite.engine import GradientState

EPOCHS = 3


def _indices(batch):
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


def _epochs(loader, count=EPOCHS):
    return [[_indices(batch) for batch in loader] for _ in range(count)]


def _data(n=23):
    return TensorDataset(torch.arange(n))


def _plain_and_prepared(make, seed=0):
    """`make()` builds a fresh loader; both runs start from the same global RNG state. Returns each run's
    epochs and the global RNG's next draw after them (a plain loop's draws must be the prepared loop's)."""
    set_seed(seed)
    plain = _epochs(make())
    plain_after = torch.rand(4)
    set_seed(seed)
    prepared = _epochs(Accelerator().prepare(make()))
    return plain, prepared, plain_after, torch.rand(4)


CASES = {
    "generator": lambda: DataLoader(_data(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(42)),
    "generator, n a multiple of b": lambda: DataLoader(_data(24), batch_size=4, shuffle=True,
                                                       generator=torch.Generator().manual_seed(42)),
    "generator, drop_last": lambda: DataLoader(_data(), batch_size=4, shuffle=True, drop_last=True,
                                               generator=torch.Generator().manual_seed(42)),
    "global RNG": lambda: DataLoader(_data(), batch_size=4, shuffle=True),
    "global RNG, n a multiple of b": lambda: DataLoader(_data(24), batch_size=3, shuffle=True),
    "no shuffle": lambda: DataLoader(_data(), batch_size=4),
    "sampler's own generator": lambda: DataLoader(
        _data(), batch_size=5, sampler=RandomSampler(_data(), generator=torch.Generator().manual_seed(9)),
        generator=torch.Generator().manual_seed(10)),
    "batches drawn by a sampler": lambda: DataLoader(
        _data(), sampler=BatchSampler(RandomSampler(_data(), generator=torch.Generator().manual_seed(4)), 4, False),
        batch_size=None),
    "a sampler of another kind": lambda: DataLoader(
        _data(), batch_size=4, sampler=SubsetRandomSampler(range(0, 23, 2), generator=torch.Generator().manual_seed(2))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_yields_the_plain_loaders_batches_every_epoch(case):
    plain, prepared, plain_after, prepared_after = _plain_and_prepared(CASES[case])
    assert prepared == plain
    assert plain[0] != plain[1] or case == "no shuffle"
    assert torch.equal(prepared_after, plain_after)  # the global RNG was drawn from as in the plain loop


def test_the_user_generator_object_is_drawn_from_as_in_a_plain_loop():
    g_plain, g_prepared = torch.Generator().manual_seed(42), torch.Generator().manual_seed(42)
    plain = DataLoader(_data(), batch_size=4, shuffle=True, generator=g_plain)
    prepared = Accelerator().prepare(DataLoader(_data(), batch_size=4, shuffle=True, generator=g_prepared))
    for _ in range(EPOCHS):
        assert _epochs(prepared, 1) == _epochs(plain, 1)
        assert torch.equal(g_prepared.get_state(), g_plain.get_state())


def test_an_iteration_left_early_draws_as_in_a_plain_loop():
    """`next(iter(loader))` (a peek) and a `break` part-way: the next iteration is a new epoch, drawn from where
    the generator was left, as in a plain loop."""
    g_plain, g_prepared = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    plain = DataLoader(_data(), batch_size=4, shuffle=True, generator=g_plain)
    prepared = Accelerator().prepare(DataLoader(_data(), batch_size=4, shuffle=True, generator=g_prepared))
    assert _indices(next(iter(prepared))) == _indices(next(iter(plain)))
    assert _epochs(prepared, 1) == _epochs(plain, 1)
    for ours, theirs in zip(prepared, plain):
        assert _indices(ours) == _indices(theirs)
        break
    assert _epochs(prepared, 2) == _epochs(plain, 2)
    assert torch.equal(g_prepared.get_state(), g_plain.get_state())


def test_reseeding_the_generator_after_prepare_takes_effect():
    g = torch.Generator()  # seeded later, as a script that seeds at the top of each run
    plain_g = torch.Generator()
    plain = DataLoader(_data(), batch_size=4, shuffle=True, generator=plain_g)
    prepared = Accelerator().prepare(DataLoader(_data(), batch_size=4, shuffle=True, generator=g))
    g.manual_seed(42)
    plain_g.manual_seed(42)
    assert _epochs(prepared) == _epochs(plain)
    g.manual_seed(42)  # the same seed again: the same epochs again
    plain_g.manual_seed(42)
    again = _epochs(prepared)
    assert again == _epochs(plain)
    g.manual_seed(43)
    assert _epochs(prepared, 1)[0] != again[0]


class _Noisy(Dataset):
    """Each sample carries a random number drawn where it is loaded (a worker): random augmentation."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor(i), torch.rand(())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_load_the_plain_loaders_batches(persistent):
    def make(g):
        return DataLoader(_Noisy(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=persistent,
                          generator=g)

    g_plain, g_prepared = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    plain, prepared = make(g_plain), Accelerator().prepare(make(g_prepared))
    for _ in range(2):
        ours = [(i.tolist(), noise.tolist()) for i, noise in prepared]
        assert ours == [(i.tolist(), noise.tolist()) for i, noise in plain]  # the workers' seeds too
    assert torch.equal(g_prepared.get_state(), g_plain.get_state())


# -- several ranks, simulated in this process (tests/workers/data_order.py runs 2 for real) --------------------

def _ranks(world, make):
    return [shard_dataloader(make(), num_replicas=world, rank=r, device=None, gradient_state=GradientState())
            for r in range(world)]


def _joined_epochs(loaders, count=EPOCHS):
    """Each epoch: each step's batches of every rank side by side, cut to the real samples in the last step."""
    out = []
    for _ in range(count):
        per_rank = [[_indices(batch) for batch in loader] for loader in loaders]
        assert len({len(batches) for batches in per_rank}) == 1
        steps = [[i for batches in per_rank for i in batches[k]] for k in range(len(per_rank[0]))]
        remainder = loaders[0].remainder
        if steps and remainder > 0:
            steps[-1] = steps[-1][:remainder]
        out.append(steps)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_joined_shards_are_the_plain_batch_of_world_times_b_every_epoch(world):
    def make(b):
        return lambda: DataLoader(_data(), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(42))

    assert _joined_epochs(_ranks(world, make(3))) == _epochs(make(3 * world)())


def test_batches_drawn_by_a_sampler_are_sharded_whole():
    """DataLoader(sampler=BatchSampler(...), batch_size=None) on 2 processes: step k is the user's batches 2k
    and 2k+1 (the plain loader's batch k of a BatchSampler twice as big); the last step, short of a batch, is
    evened with the epoch's first batch."""
    def make(b):
        sampler = BatchSampler(RandomSampler(_data(20), generator=torch.Generator().manual_seed(4)), b, False)
        return DataLoader(_data(20), sampler=sampler, batch_size=None)

    plain = _epochs(make(6))
    ranks = _ranks(2, lambda: make(3))  # batches of 3, 3, 3, 3, 3, 3, 2: 4 steps, the last padded
    for epoch in range(EPOCHS):
        per_rank = [[_indices(batch) for batch in loader] for loader in ranks]
        assert [len(batches) for batches in per_rank] == [len(loader) for loader in ranks] == [4, 4]
        steps = [per_rank[0][k] + per_rank[1][k] for k in range(4)]
        assert steps[:3] == plain[epoch][:3]
        assert per_rank[0][3] == plain[epoch][3]  # the short last batch
        assert per_rank[1][3] == per_rank[0][0]  # padding: the epoch's first batch
        assert sorted(i for step in steps[:3] + [per_rank[0][3]] for i in step) == list(range(20))


@pytest.mark.timeout(240)
def test_two_processes_read_the_plain_loaders_batches_every_epoch(launch):
    """2 real processes (gloo): for each case the steps' shards side by side are the plain loader's batches of
    2b, 3 epochs long (tests/workers/data_order.py)."""
    report = launch("data_order", 2, timeout=200)[0]

    def joined(epochs):
        out = []
        for epoch in epochs:
            steps = [[i for batch in step for i in batch] for step in epoch["steps"]]
            if steps and epoch["remainder"] > 0:
                steps[-1] = steps[-1][:epoch["remainder"]]
            out.append(steps)
        return out

    # with a generator; without one (each rank's global RNG seeded apart: rank 0's draw orders every rank);
    # reseeded at each epoch's start after prepare; batches drawn by a BatchSampler given as the sampler
    for case in ("generator", "global", "reseed", "batch_sampler"):
        assert joined(report[case]["prepared"]) == report[case]["plain"], case
    assert report["generator"]["state_after"]  # the user's generator ends where the plain loop leaves it
    assert report["reseed"]["plain"][0] == report["reseed"]["plain"][2] != report["reseed"]["plain"][1]
    assert report["batch_sampler"]["len"] == 4
    for case in ("resume_generator", "resume_global"):  # resumed in the second epoch, from the loader's state
        assert report[case]["resumed"] == report[case]["whole"], case


def test_single_samples_are_still_refused_on_several_processes():
    with pytest.raises(ValueError, match="batch_size=None"):
        _ranks(2, lambda: DataLoader(_data(), batch_size=None))


# -- exact resume in a later epoch -----------------------------------------------------------------------------

@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global RNG"])
@pytest.mark.parametrize("at", [(1, 2), (1, 0), (2, 5)], ids=["mid epoch 2", "epoch 2 start", "last batch of 3"])
def test_resume_in_a_later_epoch_equals_the_uninterrupted_run(tmp_path, seeded, at):
    epoch, batches = at

    def make():
        g = torch.Generator().manual_seed(3) if seeded else None
        return DataLoader(_data(), batch_size=4, shuffle=True, generator=g)

    set_seed(5)
    whole = _epochs(Accelerator().prepare(make()))
    after = torch.rand(3)

    set_seed(5)
    acc = Accelerator()
    loader = acc.prepare(make())
    _epochs(loader, epoch)
    if batches:
        it = iter(loader)
        for _ in range(batches):
            next(it)
    acc.save_state(tmp_path / "ckpt")
    torch.rand(7)  # what the interrupted run did after saving does not matter

    set_seed(99)
    acc2 = Accelerator()
    resumed_loader = acc2.prepare(make())
    acc2.load_state(tmp_path / "ckpt")
    resumed = _epochs(resumed_loader, EPOCHS - epoch)
    assert resumed[0] == whole[epoch][batches:]
    assert resumed[1:] == whole[epoch + 1:]
    assert torch.equal(torch.rand(3), after)  # and the global RNG goes on as in the uninterrupted run


def test_a_checkpoint_from_before_generator_states_replays_its_epoch():
    """A loader state saved by an older version (an epoch seed, no generator state): its epoch keeps the
    order that version drew (a generator seeded with base_seed + epoch, after one draw of the worker seed)."""
    loader = Accelerator().prepare(
        DataLoader(_data(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    loader.load_state_dict({"base_seed": 50, "epoch": 1, "batches_seen": 2, "draws_before_sampler": 1,
                            "samples_seen": 8, "total_batch_size": 4, "num_replicas": 1})
    old = torch.Generator().manual_seed(51)
    torch.empty((), dtype=torch.int64).random_(generator=old)
    order = torch.randperm(23, generator=old).tolist()
    assert [i for batch in _epochs(loader, 1)[0] for i in batch] == order[8:]
    assert loader.epoch == 2
    assert sorted(i for batch in _epochs(loader, 1)[0] for i in batch) == list(range(23))
