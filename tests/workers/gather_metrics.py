"""gather_for_metrics over datasets whose size does not divide evenly; a DDP step on uneven data."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, make_model, parse, write_result
from fabric_lite import Accelerator

args = parse()
accelerator = Accelerator()
result = {}
for n in (10, 11, 13, 17):
    for batch_size in (2, 3):
        for split in (False, True):
            if split and batch_size % accelerator.num_processes:
                continue
            acc = Accelerator(split_batches=split)
            loader = acc.prepare(DataLoader(IndexDataset(n), batch_size=batch_size))
            gathered, objects = [], []
            for x, idx in loader:
                gathered += acc.gather_for_metrics(idx).tolist()
                objects += acc.gather_for_metrics([f"s{i}" for i in idx.tolist()])
                nested = acc.gather_for_metrics({"idx": idx, "x": x})
                assert nested["idx"].shape[0] == nested["x"].shape[0]
            result[f"{n}/{batch_size}/{split}"] = {"tensors": gathered, "objects": objects}

# Training on a dataset that does not divide evenly must not hang (every rank gets the same batches).
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(IndexDataset(13), batch_size=2, shuffle=True))
steps = 0
for epoch in range(2):
    for x, idx in loader:
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), idx % 3))
        optimizer.step()
        steps += 1
result["uneven_steps"] = steps
result["len"] = len(loader)
write_result(args.out, accelerator.process_index, result)
