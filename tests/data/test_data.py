"""data.py: sharding (simulated ranks through the pure ShardedBatchSampler / IterableDatasetShard),
epoch reshuffling, resumable position, device transfer, and `Accelerator.prepare(loader)` on one process."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from fabric_lite import Accelerator, set_seed, skip_first_batches
from fabric_lite.data.loader import IterableDatasetShard, ShardedBatchSampler

def _order(n: int, seed: int = 0) -> list:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _shard(order, W, b, *, even_batches=True, drop_last=False, split_batches=False):
    """Every simulated rank's batches, and each rank's reported len()."""
    per_rank, lengths = [], []
    for r in range(W):
        inner = BatchSampler(order, b, drop_last=drop_last)
        s = ShardedBatchSampler(inner, num_replicas=W, rank=r, batch_size=b, split_batches=split_batches,
                                even_batches=even_batches, drop_last=drop_last)
        per_rank.append([list(batch) for batch in s])
        lengths.append(len(s))
    return per_rank, lengths


def _global_steps(per_rank):
    """Global step k = concatenation of every rank's k-th batch (ranks must have equal counts)."""
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks have different numbers of batches: {[len(b) for b in per_rank]}"
    return [[i for r in range(len(per_rank)) for i in per_rank[r][k]] for k in range(counts.pop())]


SIZES = [1, 5, 11, 12, 13, 18, 24]
GRID = [(W, b, n) for W in (2, 3) for b in (2, 3) for n in SIZES]


# -- ShardedBatchSampler with simulated ranks ------------------------------------------------------

@pytest.mark.parametrize("W, b, n", GRID)
def test_even_batches_cover_everything_pad_only_the_last_step_and_match_one_big_batch(W, b, n):
    order = _order(n, seed=n)
    per_rank, lengths = _shard(order, W, b)
    steps = _global_steps(per_rank)
    big = [list(x) for x in BatchSampler(order, W * b, drop_last=False)]

    assert len(steps) == len(big) == math.ceil(n / (W * b))
    assert lengths == [len(steps)] * W
    assert all(len(batch) == b for batches in per_rank for batch in batches)  # every batch is full
    assert set(i for step in steps for i in step) == set(range(n))
    # Global step k of W ranks with batch b is batch k of one rank with batch W*b.
    for k in range(len(steps) - 1):
        assert steps[k] == big[k]
    last, real = steps[-1], big[-1]
    assert last[: len(real)] == real
    # Padding sits only in the final step and repeats the epoch's first samples.
    assert last[len(real):] == list(itertools.islice(itertools.cycle(order[: W * b]), W * b - len(real)))
    before_last = [i for step in steps[:-1] for i in step]
    assert len(before_last) == len(set(before_last))


@pytest.mark.parametrize("W, b, n", GRID)
def test_uneven_batches_yield_every_sample_exactly_once(W, b, n):
    order = _order(n, seed=n + 1)
    per_rank, lengths = _shard(order, W, b, even_batches=False)
    num_batches = math.ceil(n / b)
    assert [len(x) for x in per_rank] == lengths
    assert [len(x) for x in per_rank] == [num_batches // W + (1 if r < num_batches % W else 0) for r in range(W)]
    flat = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert flat == list(range(n))
    # The round-robin layout of the user's batches: rank r gets batches r, r+W, r+2W, ...
    user_batches = [list(x) for x in BatchSampler(order, b, drop_last=False)]
    for r in range(W):
        assert per_rank[r] == user_batches[r::W]


@pytest.mark.parametrize("W, b, n", GRID)
def test_drop_last_gives_equal_full_batches_without_repeats(W, b, n):
    order = _order(n, seed=n + 2)
    per_rank, lengths = _shard(order, W, b, drop_last=True)
    full_steps = (n // b) // W
    assert [len(x) for x in per_rank] == [full_steps] * W == lengths
    steps = _global_steps(per_rank) if full_steps else []
    assert [i for step in steps for i in step] == order[: full_steps * W * b]
    assert all(len(batch) == b for batches in per_rank for batch in batches)


@pytest.mark.parametrize("W, b, n", GRID)
def test_split_batches_split_each_user_batch(W, b, n):
    B = W * b
    order = _order(n, seed=n + 3)
    per_rank, lengths = _shard(order, W, B, split_batches=True)
    big = [list(x) for x in BatchSampler(order, B, drop_last=False)]
    steps = _global_steps(per_rank)
    assert lengths == [len(big)] * W
    assert len(steps) == len(big)
    assert all(len(batch) == b for batches in per_rank for batch in batches)
    for k in range(len(big) - 1):
        assert steps[k] == big[k]
        for r in range(W):
            assert per_rank[r][k] == big[k][r * b:(r + 1) * b]
    assert steps[-1][: len(big[-1])] == big[-1]
    assert set(i for step in steps for i in step) == set(range(n))


@pytest.mark.parametrize("W, b, n", GRID)
@pytest.mark.parametrize("split, even, drop_last", [
    (False, True, False), (False, False, False), (False, True, True), (False, False, True),
    (True, True, False), (True, True, True), (True, False, True),
])
def test_len_matches_the_number_of_batches_yielded(W, b, n, split, even, drop_last):
    batch = W * b if split else b
    per_rank, lengths = _shard(_order(n), W, batch, even_batches=even, drop_last=drop_last, split_batches=split)
    assert [len(x) for x in per_rank] == lengths


def test_len_with_split_batches_and_uneven_batches():
    """split_batches=True, even_batches=False: 9 samples, batch 4, 2 ranks -> user batches of 4, 4, 1.

    Rank 1 gets nothing of the final 1-sample batch, so it yields 2 batches; len() must say 2.
    """
    per_rank, lengths = _shard(list(range(9)), 2, 4, even_batches=False, split_batches=True)
    assert per_rank == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7]]]
    assert lengths == [3, 2]


@pytest.mark.parametrize("W", [2, 3, 4])
def test_variable_size_batches_are_padded_with_whole_user_batches(W):
    """A batch sampler without a fixed batch size (e.g. a token-budget sampler) and even_batches=True.

    The code pads missing batches of the final step with "the epoch's first ones"; a padding batch
    must be one of those batches, never bigger than any batch the user's sampler makes (a bigger
    batch is an out-of-memory risk for exactly the samplers that size batches to fit memory).
    """
    user_batches = [[0, 1], [2, 3, 4], [5], [6, 7], [8]]
    per_rank = [list(ShardedBatchSampler(user_batches, W, r, batch_size=None)) for r in range(W)]
    counts = {len(batches) for batches in per_rank}
    assert counts == {math.ceil(len(user_batches) / W)}
    yielded = [batch for batches in per_rank for batch in batches]
    assert set(i for batch in yielded for i in batch) == set(range(9))
    longest = max(len(b) for b in user_batches)
    assert all(len(batch) <= longest for batch in yielded), yielded
    assert all(batch in user_batches for batch in yielded), yielded


def test_split_batches_needs_a_divisible_batch_size():
    with pytest.raises(ValueError) as err:
        ShardedBatchSampler(BatchSampler(range(10), 5, False), num_replicas=2, rank=0, batch_size=5,
                            split_batches=True)
    assert "batch_size=5" in str(err.value) and "2 processes" in str(err.value)
    ShardedBatchSampler(BatchSampler(range(10), 6, False), num_replicas=3, rank=0, batch_size=6, split_batches=True)


def test_sharded_sampler_same_order_on_every_iteration_of_a_fixed_sampler():
    s = ShardedBatchSampler(BatchSampler(SequentialSampler(range(10)), 2, False), 2, 1, 2)
    assert list(s) == list(s) == [[2, 3], [6, 7], [0, 1]]


# -- IterableDatasetShard with simulated ranks -----------------------------------------------------

class Stream(IterableDataset):
    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


@pytest.mark.parametrize("W, b, n", GRID)
def test_iterable_shard_even(W, b, n):
    order = _order(n, seed=7)
    shards = [list(IterableDatasetShard(Stream(order), b, W, r)) for r in range(W)]
    chunks = math.ceil(n / (W * b))
    assert [len(s) for s in shards] == [chunks * b] * W
    assert set(itertools.chain(*shards)) == set(range(n))
    for k in range(chunks):  # chunk k of the stream is the ranks' k-th slices side by side
        chunk = [i for r in range(W) for i in shards[r][k * b:(k + 1) * b]]
        real = order[k * W * b:(k + 1) * W * b]
        assert chunk[: len(real)] == real
    before_last = [i for r in range(W) for i in shards[r][: (chunks - 1) * b]]
    assert len(before_last) == len(set(before_last))


@pytest.mark.parametrize("W, b, n", GRID)
def test_iterable_shard_uneven_and_drop_last(W, b, n):
    order = _order(n, seed=8)
    uneven = [list(IterableDatasetShard(Stream(order), b, W, r, even_batches=False)) for r in range(W)]
    assert sorted(itertools.chain(*uneven)) == list(range(n))
    dropped = [list(IterableDatasetShard(Stream(order), b, W, r, drop_last=True)) for r in range(W)]
    full = n // (W * b)
    assert [len(s) for s in dropped] == [full * b] * W
    assert sorted(itertools.chain(*dropped)) == sorted(order[: full * W * b])


def test_iterable_shard_split_batches():
    shards = [list(IterableDatasetShard(Stream(range(10)), 4, 2, r, split_batches=True)) for r in range(2)]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]


# -- prepare() on one process ----------------------------------------------------------------------

def _batches(loader):
    return [b.tolist() for b in loader]


def _flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_one_process_prepared_loader_yields_the_raw_loaders_batches(kind):
    """On a lone process there is nobody to even batches with: no sample may be repeated.

    Accelerate does not shard at all on one process; a raw loop sees [8, 9] as the last batch.
    """
    dataset = list(range(10)) if kind == "map" else Stream(range(10))
    raw = DataLoader(dataset, batch_size=4)
    prepared = Accelerator().prepare(raw)
    assert _batches(prepared) == _batches(raw) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("n, b", [(12, 4), (10, 4), (7, 7), (3, 5)])
def test_one_process_prepared_loader_covers_every_index(n, b):
    prepared = Accelerator().prepare(DataLoader(list(range(n)), batch_size=b, shuffle=True))
    batches = _batches(prepared)
    assert len(batches) == len(prepared) == math.ceil(n / b)
    assert set(_flat(batches)) == set(range(n))
    assert len(set(_flat(batches)[:n])) == n


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_drop_last_through_prepare_on_one_process(kind):
    dataset = list(range(10)) if kind == "map" else Stream(range(10))
    raw = DataLoader(dataset, batch_size=4, drop_last=True)
    prepared = Accelerator().prepare(raw)
    assert _batches(prepared) == _batches(raw) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_even_batches_false_and_drop_last_through_prepare():
    raw = DataLoader(list(range(10)), batch_size=4)
    assert _batches(Accelerator(even_batches=False).prepare(raw)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropped = DataLoader(list(range(10)), batch_size=4, drop_last=True)
    prepared = Accelerator().prepare(dropped)
    assert _batches(prepared) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(prepared) == 2


def test_loader_without_automatic_batching_on_one_process():
    """DataLoader(batch_size=None) hands out the dataset's items as they are (pre-batched data).

    Accelerate prepares such a loader on one process and yields the same items; fabric_lite
    fails on iteration with a bare "TypeError: 'NoneType' object is not iterable".
    """
    items = [torch.arange(3), torch.arange(3, 6), torch.arange(6, 9)]
    raw = DataLoader(items, batch_size=None)
    prepared = Accelerator().prepare(raw)
    assert _batches(prepared) == _batches(raw) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_split_batches_through_prepare_on_one_process():
    acc = Accelerator(split_batches=True)
    assert acc.split_batches is True
    prepared = acc.prepare(DataLoader(list(range(12)), batch_size=4))
    assert _batches(prepared) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert prepared.total_batch_size == 4


def test_every_epoch_reshuffles_and_same_seed_gives_same_orders():
    def epochs(seed, count=3):
        set_seed(seed)
        prepared = Accelerator().prepare(DataLoader(list(range(16)), batch_size=4, shuffle=True))
        return [_flat(_batches(prepared)) for _ in range(count)]

    a, b, c = epochs(1), epochs(1), epochs(2)
    assert a == b
    assert a != c
    assert a[0] != a[1] and a[1] != a[2] and a[0] != a[2]
    for order in a:
        assert sorted(order) == list(range(16))


def test_epoch_property_and_set_epoch_number_epochs_the_generator_draws_the_order():
    g = torch.Generator().manual_seed(3)
    prepared = Accelerator().prepare(DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=g))
    assert prepared.epoch == 0
    first = _batches(prepared)
    assert prepared.epoch == 1
    second = _batches(prepared)
    assert first != second
    # As in a plain loop, the order comes from the generator, not from the epoch number: reseeding it replays.
    prepared.set_epoch(0)
    assert prepared.epoch == 0
    g.manual_seed(3)
    assert _batches(prepared) == first
    assert _batches(prepared) == second
    assert prepared.epoch == 2


@pytest.mark.parametrize("n, b", [(12, 4), (10, 3)])
def test_loader_generator_gives_the_raw_loaders_first_epoch_order(n, b):
    raw = DataLoader(list(range(n)), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(1234))
    raw_order = _flat(_batches(raw))
    twin = DataLoader(list(range(n)), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(1234))
    prepared_order = _flat(_batches(Accelerator().prepare(twin)))
    assert prepared_order[:n] == raw_order
    other = DataLoader(list(range(n)), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(4321))
    assert _flat(_batches(Accelerator().prepare(other)))[:n] != raw_order


def test_sampler_set_epoch_is_called_each_epoch():
    class EpochSampler(SequentialSampler):
        def __init__(self, data):
            super().__init__(data)
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    sampler = EpochSampler(range(6))
    loader = DataLoader(list(range(6)), batch_size=2, sampler=sampler)
    prepared = Accelerator().prepare(loader)
    for _ in range(3):
        assert _flat(_batches(prepared)) == list(range(6))
    assert sampler.epochs == [0, 1, 2]


def test_end_of_dataloader_is_true_during_the_last_batch_only():
    acc = Accelerator()
    prepared = acc.prepare(DataLoader(list(range(10)), batch_size=3))
    for _ in range(2):
        seen = [acc.gradient_state.end_of_dataloader for _ in prepared]
        assert seen == [False, False, False, True]
        assert acc.gradient_state.end_of_dataloader is False


def test_end_of_dataloader_with_a_nested_loader():
    acc = Accelerator()
    outer = acc.prepare(DataLoader(list(range(4)), batch_size=2))
    inner = acc.prepare(DataLoader(list(range(3)), batch_size=1))
    record = []
    for _ in outer:
        before = acc.gradient_state.end_of_dataloader
        inner_flags = [acc.gradient_state.end_of_dataloader for _ in inner]
        record.append((before, inner_flags, acc.gradient_state.end_of_dataloader))
    assert record == [(False, [False, False, True], False), (True, [False, False, True], True)]


def test_peeking_a_batch_does_not_eat_into_the_next_epoch():
    """`next(iter(loader))` (a sanity check, a shape probe) must not change what a full pass yields.

    torch's DataLoader and Accelerate's prepared loader both start a fresh pass over all batches.
    """
    prepared = Accelerator().prepare(DataLoader(list(range(8)), batch_size=2))
    assert next(iter(prepared)).tolist() == [0, 1]
    assert _batches(prepared) == [[0, 1], [2, 3], [4, 5], [6, 7]]


# -- skip_first_batches and resuming ---------------------------------------------------------------

def _seeded_loader(seed=11, n=14, b=3, **kw):
    return DataLoader(list(range(n)), batch_size=b, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw)


def test_skip_first_batches_on_a_prepared_loader_keeps_the_order():
    acc = Accelerator()
    full = _batches(acc.prepare(_seeded_loader()))
    loader = acc.prepare(_seeded_loader())
    skipped = acc.skip_first_batches(loader, 2)
    assert _batches(skipped) == full[2:]
    # The original loader then continues with the next epoch, unskipped and reshuffled.
    reference = acc.prepare(_seeded_loader())
    _batches(reference)
    assert _batches(loader) == _batches(reference)
    assert len(_batches(loader)) == len(full)


def test_skip_first_batches_on_plain_loaders():
    plain = DataLoader(list(range(10)), batch_size=3)
    skipped = skip_first_batches(plain, 2)
    assert _batches(skipped) == [[6, 7, 8], [9]]
    assert len(skipped) == 2
    assert skipped.batch_size == 3
    full = _batches(_seeded_loader())
    assert _batches(Accelerator().skip_first_batches(_seeded_loader(), 3)) == full[3:]
    assert _batches(skip_first_batches(plain, 0)) == _batches(plain)
    with pytest.raises(ValueError, match="num_batches=-1"):
        skip_first_batches(plain, -1)


def test_load_state_resumes_the_loader_at_the_saved_position(tmp_path):
    acc = Accelerator()
    loader = acc.prepare(_seeded_loader())
    _batches(loader)  # a whole epoch first: the epoch counter is part of the position
    rest = []
    for i, batch in enumerate(loader):
        if i == 1:
            acc.save_state(tmp_path / "ckpt")
        if i >= 2:
            rest.append(batch.tolist())
    assert len(rest) == len(loader) - 2

    acc2 = Accelerator()
    set_seed(999)  # a different base seed: the checkpoint must bring back the saved one
    loader2 = acc2.prepare(DataLoader(list(range(14)), batch_size=3, shuffle=True))
    acc2.load_state(tmp_path / "ckpt")
    assert _batches(loader2) == rest
    # Accelerate-style scripts also call skip_first_batches with the saved step: no double skip.
    acc3 = Accelerator()
    loader3 = acc3.prepare(DataLoader(list(range(14)), batch_size=3, shuffle=True))
    acc3.load_state(tmp_path / "ckpt")
    assert _batches(acc3.skip_first_batches(loader3, 2)) == rest


def test_iterable_loader_resumes_after_load_state(tmp_path):
    acc = Accelerator()
    loader = acc.prepare(DataLoader(Stream(range(20)), batch_size=4))
    rest = []
    for i, batch in enumerate(loader):
        if i == 1:
            acc.save_state(tmp_path / "ckpt")
        if i >= 2:
            rest.append(batch.tolist())
    assert rest[:3] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    acc2 = Accelerator()
    loader2 = acc2.prepare(DataLoader(Stream(range(20)), batch_size=4))
    acc2.load_state(tmp_path / "ckpt")
    assert _batches(loader2) == rest
    assert len(_batches(loader2)) == 5  # the next epoch is whole again


# -- batches moved to the device -------------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "r"


class Movable:
    def __init__(self, values, moved_to=None):
        self.values = values
        self.moved_to = moved_to

    def to(self, device):
        return Movable(self.values, moved_to=torch.device(device))


def _collate(kind):
    def collate(items):
        x = torch.tensor(items, dtype=torch.float32)
        y = torch.tensor(items)
        if kind == "dict":
            return {"x": x, "nested": {"y": y, "names": [f"s{i}" for i in items]}, "n": len(items)}
        if kind == "namedtuple":
            return Pair(x, y)
        if kind == "dataclass":
            return Record(x, y)
        if kind == "list":
            return [x, y]
        if kind == "tuple":
            return (x, [y, {"z": y + 1}])
        if kind == "movable":
            return {"obj": Movable(items), "x": x}
        raise AssertionError(kind)

    return collate


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass", "list", "tuple", "movable"])
def test_nested_batches_come_back_intact(kind):
    acc = Accelerator(cpu=True)
    raw = DataLoader(list(range(6)), batch_size=3, collate_fn=_collate(kind))
    batches = list(acc.prepare(raw))
    assert len(batches) == 2
    first, expected = batches[0], _collate(kind)([0, 1, 2])
    assert type(first) is type(expected)
    if kind == "dict":
        assert torch.equal(first["x"], expected["x"]) and torch.equal(first["nested"]["y"], expected["nested"]["y"])
        assert first["nested"]["names"] == ["s0", "s1", "s2"] and first["n"] == 3
        assert first["x"].device == acc.device
    elif kind in ("namedtuple", "dataclass"):
        assert torch.equal(first.x, expected.x) and torch.equal(first.y, expected.y)
        assert first.x.dtype == torch.float32 and first.y.dtype == torch.int64
        if kind == "dataclass":
            assert first.tag == "r"
    elif kind == "list":
        assert all(torch.equal(a, e) for a, e in zip(first, expected))
    elif kind == "tuple":
        assert torch.equal(first[0], expected[0])
        assert type(first[1]) is list and torch.equal(first[1][1]["z"], torch.tensor([1, 2, 3]))
    else:
        assert type(first["obj"]) is Movable and first["obj"].values == [0, 1, 2]
        assert first["obj"].moved_to in (None, acc.device)  # moving to the CPU may be skipped
        assert torch.equal(batches[1]["x"], torch.tensor([3.0, 4.0, 5.0]))


def test_device_placement_false_leaves_batches_alone():
    acc = Accelerator(cpu=True)
    raw = DataLoader(list(range(4)), batch_size=2, collate_fn=_collate("movable"))
    loader = acc.prepare(raw, device_placement=[False])
    assert all(batch["obj"].moved_to is None for batch in loader)


@pytest.mark.timeout(60)
def test_num_workers_gives_the_same_batches():
    ds = TensorDataset(torch.arange(20).float(), torch.arange(20))
    a = Accelerator().prepare(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(5)))
    b = Accelerator().prepare(DataLoader(ds, batch_size=4, shuffle=True, num_workers=0,
                                         generator=torch.Generator().manual_seed(5)))
    for _ in range(2):
        with_workers = [y.tolist() for _, y in a]
        assert with_workers == [y.tolist() for _, y in b]
        assert sorted(_flat(with_workers)) == list(range(20))


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even", [True, False])
def test_sharding_shortcut_gives_the_general_paths_batches(W, shuffle, drop_last, even):
    # torch's BatchSampler over a Random/SequentialSampler takes a one-generator shortcut; any other
    # sampler takes the general path. Both must hand every rank the same batches, resumed or not.
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    from fabric_lite.data.loader import ShardedBatchSampler

    for b, n, skip in itertools.product([1, 3, 4], [1, 5, 12, 13, 25], [0, 1, 3]):
        got = {}
        for shortcut in (True, False):
            for r in range(W):
                data = list(range(n))
                sampler = RandomSampler(data, generator=torch.Generator().manual_seed(5)) if shuffle else SequentialSampler(data)
                s = ShardedBatchSampler(BatchSampler(sampler, b, drop_last), num_replicas=W, rank=r, batch_size=b,
                                        even_batches=even, drop_last=drop_last)
                s.skip = skip
                if not shortcut:
                    s._draw_order = lambda: None  # indices pulled from the sampler one by one
                got[shortcut, r] = list(s)
        assert all(got[True, r] == got[False, r] for r in range(W)), (b, n, skip, got)


# -- resuming on another number of processes ---------------------------------------------------------------

def _ranks(world, loader_factory):
    from fabric_lite.data.loader import shard_dataloader
    from fabric_lite.engine import GradientState

    return [shard_dataloader(loader_factory(), num_replicas=world, rank=r, device=None,
                             gradient_state=GradientState()) for r in range(world)]


@pytest.mark.parametrize("new_world", [1, 3, 5, 4])
def test_position_moves_to_another_world_size_by_samples(new_world):
    """Saved 3 steps into an epoch by 2 processes (24 of 48 samples), resumed by 1, 3, 4 or 5: the epoch goes on
    with sample 25 of the same order, every remaining sample once (the last step's padding is marked by
    `remainder`), whether or not 24 is a whole number of the new run's steps."""
    def make():
        return DataLoader(TensorDataset(torch.arange(48)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(3))

    reference = _ranks(1, make)[0]  # every loader draws from its own generator, all seeded alike
    full_epoch = [i for batch in reference for i in batch[0].tolist()]  # one process, the whole epoch
    old = _ranks(2, make)
    seen = []
    iterators = [iter(loader) for loader in old]
    for _ in range(3):
        for it in iterators:
            seen.extend(next(it)[0].tolist())
    state = old[0].state_dict()
    assert state["samples_seen"] == 24 and state["total_batch_size"] == 8
    new = _ranks(new_world, make)
    for loader in new:
        loader.load_state_dict(state)
    lengths = [loader.batches_left() for loader in new]
    remainder = new[0].remainder  # real samples in the last step (read when an iteration starts)
    steps = list(zip(*[list(loader) for loader in new]))  # each rank's batches, step by step
    assert lengths == [len(steps)] * new_world
    rest = []
    for k, step in enumerate(steps):
        flat = [i for batch in step for i in batch[0].tolist()]
        last = k == len(steps) - 1
        rest.extend(flat[:remainder] if last and remainder > 0 else flat)
    assert seen + rest == full_epoch  # the epoch's order, cut at sample 24: nothing twice, nothing skipped
    assert new[0].state_dict()["samples_seen"] == 0  # the epoch ended: the next one starts whole


def test_position_that_cannot_be_cut_is_refused():
    class Batches(BatchSampler):  # a custom batch sampler: its order cannot be cut part-way
        pass

    def make():
        ds = TensorDataset(torch.arange(48))
        return DataLoader(ds, batch_sampler=Batches(SequentialSampler(ds), batch_size=4, drop_last=False))

    new = _ranks(5, make)
    state = {"base_seed": 0, "epoch": 0, "batches_seen": 3, "samples_seen": None, "total_batch_size": None,
             "num_replicas": 2}
    with pytest.raises(ValueError, match="saved 3 batches into epoch 0 by 2 process.*this run has 5.*custom batch"):
        new[0].load_state_dict(state)

    def shuffled():  # a plain DataLoader whose sampler draws with replacement: its order cannot be cut
        ds = TensorDataset(torch.arange(48))
        return DataLoader(ds, batch_size=4, sampler=torch.utils.data.RandomSampler(ds, replacement=True))

    state = {"base_seed": 0, "epoch": 0, "batches_seen": 3, "samples_seen": 24, "total_batch_size": 8}
    with pytest.raises(ValueError, match="saved 24 samples into epoch 0.*global batch of 8.*cannot be cut"):
        _ranks(5, shuffled)[0].load_state_dict(state)
    _ranks(3, shuffled)[0].load_state_dict(state)  # 24 samples are 2 whole steps of 12: no cut needed


def _shuffled48():
    return DataLoader(TensorDataset(torch.arange(48)), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(3))


def _epoch_order():
    reference = _ranks(1, _shuffled48)[0]
    return [i for batch in reference for i in batch[0].tolist()]


def _steps(loaders, n=None):
    """`n` global steps (all, by default) of these ranks' loaders, as one flat list of real samples."""
    remainder = loaders[0].remainder
    its = [iter(loader) for loader in loaders]
    out, k, total = [], 0, loaders[0].batches_left()
    while (n is None or k < n) and k < total:
        flat = [i for it in its for i in next(it)[0].tolist()]
        k += 1
        out.extend(flat[:remainder] if k == total and remainder > 0 else flat)
    return out


def _saved_at(world, steps):
    loaders = _ranks(world, _shuffled48)
    seen = _steps(loaders, steps)
    return seen, loaders[0].state_dict()


def test_a_cut_position_survives_a_second_resume_at_the_same_world_size():
    seen, state = _saved_at(2, 3)                      # 24 of 48 samples
    middle_loaders = _ranks(5, _shuffled48)            # cut part-way: 24 is not a multiple of 20
    for loader in middle_loaders:
        loader.load_state_dict(state)
    middle = _steps(middle_loaders, 1)
    state = middle_loaders[0].state_dict()
    assert state["samples_seen"] == 44
    last = _ranks(5, _shuffled48)                      # the same world size again: the cut must be kept
    for loader in last:
        loader.load_state_dict(state)
    assert seen + middle + _steps(last) == _epoch_order()


def test_skip_first_batches_after_resuming_on_another_world_size_is_not_applied_twice():
    seen, state = _saved_at(2, 3)
    loaders = _ranks(3, _shuffled48)
    for loader in loaders:
        loader.load_state_dict(state)
    views = [skip_first_batches(loader, 3) for loader in loaders]  # Accelerate's resume code, in the saved run's batches
    assert seen + _steps(views) == _epoch_order()
    loaders = _ranks(3, _shuffled48)
    for loader in loaders:
        loader.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"skip_first_batches\(5\) after resuming .* the request is ignored"):
        views = [skip_first_batches(loader, 5) for loader in loaders]
        rest = _steps(views)
    assert seen + rest == _epoch_order()


def test_a_checkpoint_from_the_padded_last_step_resumes_into_the_next_epoch():
    def fifty():
        return DataLoader(TensorDataset(torch.arange(50)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(3))

    loaders = _ranks(5, fifty)
    its = [iter(loader) for loader in loaders]
    for _ in range(3):  # 3 steps of 20: the last one padded (60 > 50)
        for it in its:
            next(it)
    state = loaders[0].state_dict()
    assert state["samples_seen"] == 50
    resumed = _ranks(2, fifty)
    for loader in resumed:
        loader.load_state_dict(state)
    assert resumed[0].batches_left() == 0 and list(resumed[0]) == []
    assert len(list(resumed[0])) == len(resumed[0]) == 7  # the next epoch, whole
