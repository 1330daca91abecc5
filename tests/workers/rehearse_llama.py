"""The Llama-style model through the raw door with Accelerate's ParallelismConfig from the launch: tensor parallelism
on torch_device_mesh["tp"] before prepare, FSDP2 over the data-parallel dimensions, bf16 autocast on a GPU. Used by
`fabric-lite explain --rehearse` (tests/explain/test_rehearsal.py, tests/test_cuda.py)."""

import torch.nn.functional as F
import torch
from torch.utils.data import DataLoader

from common import parse
from fabric_lite import Accelerator
from llama import Llama, tensor_parallel, tokens

args = parse({"--dim": {"type": int, "default": 256}, "--layers": {"type": int, "default": 4},
              "--heads": {"type": int, "default": 8}})
acc = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
model = Llama(dim=args.dim, layers=args.layers, heads=args.heads)
mesh = acc.torch_device_mesh
if mesh is not None and mesh["tp"].size() > 1:
    tensor_parallel(model, mesh["tp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(tokens(4096), batch_size=2))
for x, y in loader:
    logits = model(x)
    acc.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
    acc.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
