"""A raw-door training script for `fabric-lite explain --rehearse` (tests/explain/test_rehearsal.py).

Under the rehearsal the script stops at its first optimizer step and the rehearsal reports. Run for real (launched on
several processes), it measures what the rehearsal reports, by other means, after the same first step: the bytes of
the storages each rank holds (torch.UntypedStorage.nbytes)."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator

args = parse({"--hidden": {"type": int, "default": 1024}, "--no-step": {"action": "store_true"}})
acc = Accelerator(gradient_accumulation_steps=2)
model = torch.nn.Sequential(torch.nn.Linear(256, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 256))
mesh = acc.torch_device_mesh
if mesh is not None and mesh["tp"].size() > 1:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(2048, 256, generator=g), torch.randn(2048, 256, generator=g))
model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=2))
if args.no_step:
    raise SystemExit(0)


def held(tensors):
    """Bytes of the distinct storages behind `tensors` (their local shards): what this process allocated for them."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


for x, y in loader:
    with acc.accumulate(model):
        acc.backward(F.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if acc.sync_gradients:
            break
        optimizer.zero_grad()
params = list(model.parameters())
state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
write_result(args.out, acc.process_index, {
    "parameter_bytes": held(params),
    "gradient_bytes": held(p.grad for p in params if p.grad is not None),
    "optimizer_state_bytes": held(state),
})
acc.end_training()
