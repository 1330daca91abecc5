"""`fabric_lite.data_loader`: Accelerate's `prepare_data_loader`, `BatchSamplerShard`, `IterableDatasetShard`,
`DataLoaderShard` and `DataLoaderDispatcher` with Accelerate's arguments. The expected indices are the ones Accelerate
deals to each process (its documented examples and its even_batches / split_batches / drop_last rules), written out."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler, TensorDataset

from fabric_lite import Accelerator, PartialState, skip_first_batches
from fabric_lite.data import DataLoaderShard as PreparedLoader
from fabric_lite.data import IterableDatasetShard as OwnIterableShard
from fabric_lite.data import ShardedBatchSampler
from fabric_lite.data.seedable import SeedableRandomSampler
from fabric_lite.data_loader import (
    BatchSamplerShard, DataLoaderDispatcher, DataLoaderShard, IterableDatasetShard, prepare_data_loader,
)
from fabric_lite.utils import NotSupportedError


@pytest.fixture(autouse=True)
def _fresh_state():
    PartialState._reset_state()
    yield
    PartialState._reset_state()


class Stream(IterableDataset):
    """0, 1, ..., n - 1 as tensors, with no length."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


def sequential(n, batch_size, drop_last=False):
    return BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)


def dealt(n, batch_size, processes, drop_last=False, split_batches=False, even_batches=True):
    """Every process's batches of BatchSamplerShard over range(n)."""
    return [list(BatchSamplerShard(sequential(n, batch_size, drop_last), processes, p, split_batches, even_batches))
            for p in range(processes)]


def rows(loader):
    return [(batch[0] if isinstance(batch, (list, tuple)) else batch).tolist() for batch in loader]


# (samples, batch size, processes, drop_last, split_batches, even_batches) -> each process's batches
ACCELERATES_DEALING = {
    # the whole batches in turns; the last step complete
    (24, 3, 2, False, False, True): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                                     [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]],
    # even_batches: the last step is completed from the start of the epoch (wrap-around)
    (21, 3, 2, False, False, True): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                                     [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]],
    (22, 3, 2, False, False, True): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                                     [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]]],
    (20, 3, 2, False, False, True): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 0]],
                                     [[3, 4, 5], [9, 10, 11], [15, 16, 17], [1, 2, 3]]],
    (18, 3, 4, False, False, True): [[[0, 1, 2], [12, 13, 14]], [[3, 4, 5], [15, 16, 17]],
                                     [[6, 7, 8], [0, 1, 2]], [[9, 10, 11], [3, 4, 5]]],
    (2, 3, 2, False, False, True): [[[0, 1, 0]], [[1, 0, 1]]],  # fewer samples than one step: cycled
    (5, 3, 1, False, False, True): [[[0, 1, 2], [3, 4, 0]]],  # one process: every batch full too
    # drop_last: an incomplete last step is dropped
    (21, 3, 2, True, False, True): [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]]],
    # even_batches=False: the processes take what is there
    (22, 3, 2, False, False, False): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                                      [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21]]],
    (20, 3, 2, False, False, False): [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19]],
                                      [[3, 4, 5], [9, 10, 11], [15, 16, 17]]],
    # split_batches: each process takes its piece of every batch
    (24, 4, 2, False, True, True): [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [22, 23]]],
    (22, 4, 2, False, True, True): [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [0, 1]]],
    (21, 4, 2, False, True, True): [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 0]],
                                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [1, 2]]],
    (3, 4, 2, False, True, True): [[[0, 1]], [[2, 0]]],
    (21, 4, 2, True, True, True): [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]],
                                   [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]],
    # split_batches, even_batches=False: pieces of batch_size // processes from the start of the short batch
    (21, 4, 2, False, True, False): [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20]],
                                     [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]],
    (19, 8, 4, False, True, False): [[[0, 1], [8, 9], [16, 17]], [[2, 3], [10, 11], [18]],
                                     [[4, 5], [12, 13]], [[6, 7], [14, 15]]],
}


@pytest.mark.parametrize("case", list(ACCELERATES_DEALING), ids=str)
def test_batch_sampler_shard_deals_accelerates_batches(case):
    n, batch_size, processes, drop_last, split_batches, even_batches = case
    expected = ACCELERATES_DEALING[case]
    assert dealt(n, batch_size, processes, drop_last, split_batches, even_batches) == expected
    lengths = [len(BatchSamplerShard(sequential(n, batch_size, drop_last), processes, p, split_batches,
                                     even_batches)) for p in range(processes)]
    assert lengths == [len(batches) for batches in expected]  # (what it yields: Accelerate's counts 1 here always)


def test_batch_sampler_shard_documented_example_and_arguments():
    # Accelerate's docstring: a sampler of [[0, 1, 2, 3], [4, 5, 6, 7]] on two processes
    batches = sequential(8, 4)
    assert [list(BatchSamplerShard(batches, 2, p)) for p in range(2)] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert [list(BatchSamplerShard(batches, 2, p, split_batches=True)) for p in range(2)] == \
        [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    shard = BatchSamplerShard(batch_sampler=batches, num_processes=2, process_index=1, split_batches=False,
                              even_batches=True)
    assert isinstance(shard, BatchSampler)
    assert (shard.num_processes, shard.process_index, shard.batch_size, shard.drop_last, shard.total_length) == \
        (2, 1, 4, False, 2)
    assert list(BatchSamplerShard(batches)) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # defaults: one process
    with pytest.raises(ValueError, match="multiple of 2"):
        BatchSamplerShard(sequential(9, 3), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="process_index=2"):
        BatchSamplerShard(batches, 2, 2)


def test_batch_sampler_shard_hands_the_epoch_to_its_sampler():
    seeded = SeedableRandomSampler(range(12), seed=3)
    shard = BatchSamplerShard(BatchSampler(seeded, 3, False), 2, 0)
    shard.set_epoch(5)
    assert seeded.epoch == 5
    first = list(shard)
    assert [i for b in first for i in b] == [i for b in list(BatchSampler(seeded, 3, False))[0::2] for i in b]


def test_iterable_dataset_shard_documented_examples():
    # Accelerate's docstring: a dataset of 0..7 on two processes
    assert [list(IterableDatasetShard(range(8), batch_size=4, num_processes=2, process_index=p)) for p in range(2)] \
        == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(IterableDatasetShard(range(8), 4, num_processes=2, process_index=p, split_batches=True))
            for p in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # a short last chunk: completed with the first chunk (wrap-around), or dropped
    assert [list(IterableDatasetShard(range(10), 4, False, 2, p)) for p in range(2)] == \
        [[0, 1, 2, 3, 8, 9, 0, 1], [4, 5, 6, 7, 2, 3, 4, 5]]
    assert [list(IterableDatasetShard(range(10), 4, True, 2, p)) for p in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(IterableDatasetShard(range(3), 2, False, 2, p)) for p in range(2)] == [[0, 1], [2, 0]]
    # one process: whole batches too
    assert list(IterableDatasetShard(range(5), batch_size=2)) == [0, 1, 2, 3, 4, 0]
    assert list(IterableDatasetShard(range(5), batch_size=2, drop_last=True)) == [0, 1, 2, 3]
    assert list(IterableDatasetShard(range(5))) == [0, 1, 2, 3, 4]  # the defaults: batch_size=1, one process
    # its length is what this process reads
    for args in [(10, 4, False, 2, 0), (10, 4, True, 2, 1), (12, 4, False, 2, 1, True), (5, 2, False, 1, 0)]:
        shard = IterableDatasetShard(range(args[0]), *args[1:])
        assert len(shard) == len(list(shard)), args
    with pytest.raises(ValueError, match="multiple of 2"):
        IterableDatasetShard(range(8), 3, num_processes=2, split_batches=True)


def test_prepare_data_loader_deals_as_accelerate_for_each_process():
    dataset = TensorDataset(torch.arange(22))
    for split_batches, batch_size in ((False, 3), (True, 4)):
        expected = ACCELERATES_DEALING[(22, batch_size, 2, False, split_batches, True)]
        for p in range(2):
            loader = prepare_data_loader(DataLoader(dataset, batch_size=batch_size), num_processes=2, process_index=p,
                                         split_batches=split_batches)
            assert rows(loader) == expected[p]
            assert loader.total_batch_size == (4 if split_batches else 6)
    uneven = [rows(prepare_data_loader(DataLoader(dataset, batch_size=3), None, 2, p, even_batches=False))
              for p in range(2)]
    assert uneven == ACCELERATES_DEALING[(22, 3, 2, False, False, False)]
    # an IterableDataset: each process reads its slice of every chunk of 2 * batch_size
    streamed = [rows(prepare_data_loader(DataLoader(Stream(10), batch_size=2), num_processes=2, process_index=p))
                for p in range(2)]
    assert streamed == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    # one process (the defaults: this run's): the plain loader's batches
    assert rows(prepare_data_loader(DataLoader(dataset, batch_size=5))) == [list(range(i, min(i + 5, 22)))
                                                                          for i in range(0, 22, 5)]


def test_prepared_loaders_are_of_accelerates_kinds():
    dataset = TensorDataset(torch.arange(8))
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2), num_processes=2, process_index=0)
    assert isinstance(loader, DataLoaderShard) and isinstance(loader, PreparedLoader)
    assert not isinstance(loader, DataLoaderDispatcher)
    assert isinstance(loader.batch_sampler, BatchSamplerShard) and isinstance(loader.batch_sampler, ShardedBatchSampler)
    assert (loader.batch_sampler.num_processes, loader.batch_sampler.process_index) == (2, 0)
    streamed = prepare_data_loader(DataLoader(Stream(8), batch_size=2), num_processes=2, process_index=1)
    assert isinstance(streamed.dataset, IterableDatasetShard) and isinstance(streamed.dataset, OwnIterableShard)
    assert streamed.dataset.num_processes == 2 and streamed.dataset.process_index == 1
    # dispatched, even on one process (nothing to hand out: the kind the script asked for), also when skipping
    dispatched = prepare_data_loader(DataLoader(dataset, batch_size=2), put_on_device=True, dispatch_batches=True)
    assert isinstance(dispatched, DataLoaderDispatcher) and not isinstance(dispatched, DataLoaderShard)
    assert rows(dispatched) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    skipping = skip_first_batches(dispatched, 1)
    assert isinstance(skipping, DataLoaderDispatcher) and rows(skipping) == [[2, 3], [4, 5], [6, 7]]
    # an IterableDataset placed on a device is dispatched by default, as in Accelerate
    streamed_placed = prepare_data_loader(DataLoader(Stream(4), batch_size=2), put_on_device=True)
    assert isinstance(streamed_placed, DataLoaderDispatcher)
    assert isinstance(prepare_data_loader(DataLoader(Stream(4), batch_size=2)), DataLoaderShard)
    # what Accelerator.prepare returns is a DataLoaderShard too
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(DataLoader(dataset, batch_size=2))
    assert isinstance(prepared, DataLoaderShard) and not isinstance(prepared, DataLoaderDispatcher)
    assert not isinstance(DataLoader(dataset), (DataLoaderShard, DataLoaderDispatcher))
    assert issubclass(DataLoaderShard, DataLoader) and issubclass(DataLoaderDispatcher, DataLoader)


def test_prepare_data_loader_places_batches_only_with_put_on_device():
    dataset = TensorDataset(torch.arange(6))
    placed = prepare_data_loader(DataLoader(dataset, batch_size=3), device=torch.device("meta"), put_on_device=True)
    assert {batch[0].device.type for batch in placed} == {"meta"}
    kept = prepare_data_loader(DataLoader(dataset, batch_size=3), device="meta")
    assert {batch[0].device.type for batch in kept} == {"cpu"}
    assert prepare_data_loader(DataLoader(dataset, batch_size=3), device="meta", put_on_device=True,
                               non_blocking=True).device == torch.device("meta")


def test_prepare_data_loader_seedable_sampler_and_state():
    dataset = TensorDataset(torch.arange(12))

    def shuffled(seed):
        return prepare_data_loader(DataLoader(dataset, batch_size=3, sampler=RandomSampler(dataset)),
                                   use_seedable_sampler=True, data_seed=seed, use_stateful_dataloader=True)

    loader = shuffled(7)
    assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    order = [i for batch in rows(loader) for i in batch]
    expected = SeedableRandomSampler(range(12), seed=7).order(0).tolist()
    assert order == expected
    assert [i for batch in rows(shuffled(8)) for i in batch] != expected
    # use_stateful_dataloader: state_dict mid-epoch, and a new loader goes on from there
    loader = shuffled(7)
    iterator = iter(loader)
    first = [next(iterator)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    resumed = shuffled(7)
    resumed.load_state_dict(state)
    assert first + rows(resumed) == [expected[i:i + 3] for i in range(0, 12, 3)]


def test_rng_types_are_accepted_and_checked():
    dataset = TensorDataset(torch.arange(4))
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2), rng_types=["torch", "generator"])
    assert rows(loader) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"rng_types=\['torch', 'dice'\]"):
        prepare_data_loader(DataLoader(dataset, batch_size=2), rng_types=["torch", "dice"])


def test_what_cannot_apply_is_refused_naming_the_argument():
    dataset = TensorDataset(torch.arange(4))
    with pytest.raises(NotSupportedError, match="torch_device_mesh"):
        prepare_data_loader(DataLoader(dataset, batch_size=2), torch_device_mesh=object())
    with pytest.raises(NotSupportedError, match="torch_device_mesh"):
        DataLoaderShard(dataset, batch_size=2, torch_device_mesh=object())
    with pytest.raises(ValueError, match="put_on_device=True"):
        prepare_data_loader(DataLoader(dataset, batch_size=2), dispatch_batches=True)
    with pytest.raises(ValueError, match="dispatch_batches=True, num_processes=2"):  # no such processes here
        prepare_data_loader(DataLoader(dataset, batch_size=2), num_processes=2, process_index=0, put_on_device=True,
                            dispatch_batches=True)
    with pytest.raises(ValueError, match="process_index=3"):
        prepare_data_loader(DataLoader(dataset, batch_size=2), num_processes=2, process_index=3)
    with pytest.raises(TypeError, match="list"):
        prepare_data_loader([1, 2])


def test_loader_classes_build_with_accelerates_arguments():
    dataset = TensorDataset(torch.arange(21))
    # Accelerate's way to read one process's share by hand: a BatchSamplerShard in a DataLoaderShard
    shard = DataLoaderShard(dataset, device=torch.device("meta"), rng_types=["torch"], skip_batches=1,
                            batch_sampler=BatchSamplerShard(sequential(21, 3), num_processes=2, process_index=1))
    assert isinstance(shard, DataLoaderShard) and isinstance(shard, PreparedLoader)
    assert [batch[0].shape[0] for batch in shard] == [3, 3, 3] and next(iter(shard))[0].device.type == "meta"
    plain = DataLoaderShard(dataset, batch_size=4, drop_last=True)
    assert rows(plain) == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    read = DataLoaderShard(dataset, batch_sampler=BatchSamplerShard(sequential(21, 3), 2, 1))
    assert rows(read) == ACCELERATES_DEALING[(21, 3, 2, False, False, True)][1]
    numbered = DataLoaderShard(dataset, batch_size=7, iteration=3)
    assert numbered.epoch == 3
    dispatcher = DataLoaderDispatcher(dataset, split_batches=False, skip_batches=2, batch_size=5)
    assert isinstance(dispatcher, DataLoaderDispatcher) and not isinstance(dispatcher, DataLoaderShard)
    assert rows(dispatcher) == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19], [20]]


@pytest.mark.timeout(240)
def test_two_processes_prepare_dispatch_and_kinds(launch):
    """2 real processes (gloo), tests/workers/accelerate_data_loader.py: prepare_data_loader takes this run's
    processes; dispatched batches are cut by slice_fn_for_dispatch; the kinds of every prepared loader."""
    ranks = launch("accelerate_data_loader", 2, timeout=200)
    for p, got in enumerate(ranks):
        assert got["num_processes"] == 2
        mine = [[0, 1], [4, 5], [8, 9]] if p == 0 else [[2, 3], [6, 7], [0, 1]]  # 10 samples, steps of 2 x 2
        assert got["shard"] == mine and got["shard_kinds"] == [True, False]
        assert got["dispatched"] == mine and got["dispatched_kinds"] == [False, True]
        assert got["slice_calls"] == [[2 * p, 2 * p + 2, p, 2]] * 3
        # DataLoaderDispatcher(split_batches=True, batch_size=4): each process's half of every batch of 4
        assert got["built"] == ([[0, 1], [4, 5], [8, 9]] if p == 0 else [[2, 3], [6, 7], [0, 1]])
        assert got["built_kinds"] == [False, True]
        assert got["accelerator_dispatched_kinds"] == [False, True]
        assert got["accelerator_shard_kinds"] == [True, False]
