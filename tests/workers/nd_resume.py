"""Stop an N-D run part-way, save it, and go on on another layout (tests/strategies/test_nd_resume.py).

Two epochs over 48 shuffled samples (IndexDataset: each sample carries its index), a global micro-batch of 8
samples shared by the data-parallel ranks, accumulation 2, clipping at 0.5, AdamW. Layouts:

- `--sizes R,S,T`: ParallelismConfig(dp_replicate_size=R, dp_shard_size=S, tp_size=T); with T > 1 the script
  applies tensor parallelism (ColwiseParallel / RowwiseParallel) on accelerator.torch_device_mesh["tp"];
- `--sizes ddp`: strategy="ddp" on the processes launched, no ParallelismConfig.

`--stop-after K` saves after K optimizer steps to `--save` and stops; `--load DIR` (other initial weights, so
that everything must come from the checkpoint) loads DIR and trains to the end. Every rank reports its
data-parallel rank, its tensor-parallel rank and the sample indices of each micro-batch it trained on, with the
epoch; rank 0 also the final full weights."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, parse, write_result
from fabric_lite import Accelerator, ParallelismConfig
from fabric_lite.utils import set_seed

args = parse({"--sizes": {"default": "1,1,1"}, "--stop-after": {"type": int, "default": 0},
              "--save": {"default": None}, "--load": {"default": None}})
N, EPOCHS, GLOBAL_BATCH = 48, 2, 8

if args.sizes == "ddp":
    acc = Accelerator(strategy="ddp", gradient_accumulation_steps=2)
    dp, tp, dp_rank, tp_rank = acc.num_processes, 1, acc.process_index, 0
else:
    replicate, shard, tp = (int(x) for x in args.sizes.split(","))
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard,
                                                           tp_size=tp), gradient_accumulation_steps=2)
    # (Accelerate's data_parallel_rank is the rank along dp_replicate alone)
    dp, tp_rank = replicate * shard, acc.tensor_parallel_rank
    dp_rank = acc.data_parallel_rank * shard + acc.data_parallel_shard_rank
set_seed(99 if args.load else 0)  # a resumed run starts from other weights: the checkpoint must bring them
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
if tp > 1:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, acc.torch_device_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
loader = DataLoader(IndexDataset(N), batch_size=GLOBAL_BATCH // dp, shuffle=True,
                    generator=torch.Generator().manual_seed(7))
model, optimizer, loader = acc.prepare(model, optimizer, loader)
if args.load:
    acc.load_state(args.load)

seen, steps, stopped = [], 0, False
for epoch in range(loader.epoch, EPOCHS):
    for x, i in loader:
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), i % 3)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        seen.append([epoch, i.tolist()])
        steps += int(acc.sync_gradients)
        if steps == args.stop_after and acc.sync_gradients:
            acc.save_state(args.save)
            stopped = True
            break
    if stopped:
        break
result = {"dp_rank": dp_rank, "tp_rank": tp_rank, "dp": dp, "seen": seen}
weights = acc.get_state_dict(model)  # (every rank takes part in gathering the full weights)
if acc.is_main_process:
    result["weights"] = {k: v.reshape(-1).tolist() for k, v in weights.items()}
write_result(args.out, acc.process_index, result)
acc.end_training()
