"""N-D parallelism through the raw door: ParallelismConfig(dp_replicate, dp_shard, tp), tensor parallelism applied by
the script on accelerator.torch_device_mesh["tp"] before prepare, FSDP2 over the data-parallel dimensions. With no
sizes given, the same loop on one process is the reference."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator, ParallelismConfig
from fabric_lite.utils import set_seed

args = parse({"--sizes": {"default": "1,1,1"}, "--steps": {"type": int, "default": 3},
              "--own-mesh": {"action": "store_true"}, "--save": {"default": None}, "--load": {"default": None}})
if args.sizes == "launch":  # the sizes come from `fabric-lite launch --use_parallelism_config ...`
    acc = Accelerator(gradient_accumulation_steps=2)
    config = acc.parallelism_config
    replicate, shard, tp = config.dp_replicate_size, config.dp_shard_size, config.tp_size
else:
    replicate, shard, tp = (int(x) for x in args.sizes.split(","))
    config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp)
    acc = Accelerator(parallelism_config=config, gradient_accumulation_steps=2)
dp = replicate * shard
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
mesh = acc.torch_device_mesh
if tp > 1:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if args.own_mesh:  # a tensor-parallel layout on a mesh the script built itself: refused in one sentence
        from torch.distributed.device_mesh import init_device_mesh

        parallelize_module(model, init_device_mesh("cpu", (tp,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        try:
            acc.prepare(model)
        except ValueError as err:
            write_result(args.out, acc.process_index, {"error": str(err)})
        acc.end_training()
        raise SystemExit(0)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
evaluation = TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1).repeat(1, 8), torch.arange(10))
# one optimizer step sees 2 micro-batches of 8 samples in all, over the data-parallel ranks
model, optimizer, loader, eval_loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=8 // dp),
                                                    DataLoader(evaluation, batch_size=2))
if args.load:  # another layout's checkpoint: the weights it saved, in this layout
    acc.load_state(args.load)
    write_result(args.out, acc.process_index, {"loaded": {k: v.tolist() for k, v in acc.get_state_dict(model).items()}})
    acc.end_training()
    raise SystemExit(0)
losses, norms, seen = [], [], []
for x, y in loader:
    with acc.accumulate(model):
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        if acc.sync_gradients:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    losses.append(float(acc.reduce(loss.detach(), "mean")))
    seen += y.tolist()
    if len(losses) == 2 * args.steps:
        break
gathered = []
for x, y in eval_loader:
    gathered += acc.gather_for_metrics(y).tolist()
weights = {k: v.tolist() for k, v in acc.get_state_dict(model).items()}
if args.save:
    acc.save_state(args.save)
write_result(args.out, acc.process_index, {
    "losses": losses, "norms": norms, "weights": weights, "gathered": gathered, "seen": seen,
    "ranks": [acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank],
    "mesh": list(mesh.mesh_dim_names) if mesh is not None else None,
})
acc.end_training()
