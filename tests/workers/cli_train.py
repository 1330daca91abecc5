"""Train a tiny model with the Accelerator (fixed seed, shuffled sampler); write this rank's final
weights and where it ran. Used to compare a 2-node job with a 2-process single-node one."""

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, flat_weights, make_model, parse, write_result
from fabric_lite import Accelerator, set_seed

args = parse()
set_seed(11)
acc = Accelerator()
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(IndexDataset(48), batch_size=4, shuffle=True)
model, optimizer, loader = acc.prepare(model, optimizer, loader)
seen = []
for epoch in range(2):
    for x, idx in loader:
        optimizer.zero_grad()
        acc.backward(F.cross_entropy(model(x), idx % 3))
        optimizer.step()
        seen.append(acc.gather(idx).tolist())
write_result(args.out, acc.process_index, {
    "weights": flat_weights(acc.unwrap_model(model)).tolist(), "seen": seen,
    "rank": acc.process_index, "world": acc.num_processes, "local_rank": acc.local_process_index,
    "node_rank": int(os.environ.get("GROUP_RANK", "-1")), "strategy": type(acc.strategy).__name__,
})
