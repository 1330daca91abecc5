"""`fabric_lite.data_loader` on real processes (tests/data/test_accelerate_data_loader.py): `prepare_data_loader` with
this run's process count, dispatched with a slice function, and the kinds (`DataLoaderShard`, `DataLoaderDispatcher`)
of loaders prepared here and by the Accelerator. Each rank writes what it read."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator, DataLoaderConfiguration
from fabric_lite.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from fabric_lite.state import PartialState

args = parse()
state = PartialState(cpu=True)
rank = state.process_index
dataset = TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1), torch.arange(10))


def labels(loader):
    return [batch[1].tolist() for batch in loader]


def kinds(loader):
    return [isinstance(loader, DataLoaderShard), isinstance(loader, DataLoaderDispatcher)]


out = {"num_processes": state.num_processes}
shard = prepare_data_loader(DataLoader(dataset, batch_size=2))  # this run's num_processes and process_index
out["shard"], out["shard_kinds"] = labels(shard), kinds(shard)

calls = []


def slice_fn(batch, cut, process_index, num_processes):
    calls.append([cut.start, cut.stop, process_index, num_processes])
    return [tensor[cut] for tensor in batch]


dispatched = prepare_data_loader(DataLoader(dataset, batch_size=2), device=state.device, put_on_device=True,
                                 dispatch_batches=True, slice_fn_for_dispatch=slice_fn)
out["dispatched"], out["dispatched_kinds"], out["slice_calls"] = labels(dispatched), kinds(dispatched), calls

built = DataLoaderDispatcher(dataset, split_batches=True, batch_size=4)
out["built"], out["built_kinds"] = labels(built), kinds(built)

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
out["accelerator_dispatched_kinds"] = kinds(accelerator.prepare(DataLoader(dataset, batch_size=2)))
accelerator.dataloader_config.dispatch_batches = False
out["accelerator_shard_kinds"] = kinds(accelerator.prepare(DataLoader(dataset, batch_size=2)))
write_result(args.out, rank, out)
