"""Train a small model with the Accelerator; report final weights and which samples each step saw."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, flat_weights, make_model, parse, write_result
from fabric_lite import Accelerator, set_seed

args = parse({"--batch-size": {"type": int}, "--accum": {"type": int, "default": 1},
              "--epochs": {"type": int, "default": 2}, "--n": {"type": int, "default": 64},
              "--optimizer": {"default": "sgd"}})
set_seed(7)
accelerator = Accelerator(gradient_accumulation_steps=args.accum)
model = make_model()
if args.optimizer == "sgd":
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(IndexDataset(args.n), batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
seen = []
losses = []
for epoch in range(args.epochs):
    for x, idx in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), idx % 3)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen.append(accelerator.gather(idx).tolist())
        losses.append(loss.item())
write_result(args.out, accelerator.process_index, {
    "weights": flat_weights(accelerator.unwrap_model(model)).tolist(),
    "seen": seen, "losses": losses, "strategy": type(accelerator.strategy).__name__,
    "world": accelerator.num_processes, "device": str(accelerator.device),
    "backend": __import__("torch.distributed", fromlist=["x"]).get_backend() if accelerator.num_processes > 1 else None,
})
