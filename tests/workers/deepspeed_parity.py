"""The raw door under DDP and under each DeepSpeed ZeRO configuration, from the same weights on the same data.

Every run: 2 epochs of 8 batches per process, gradient accumulation 2 (the last window of an epoch is a
full one), gradient clipping at 0.5 (active: the gradients are larger), AdamW with weight decay and a
per-step LR schedule. Each rank writes rank{r}.json: per strategy, the full final weights (gathered at
ZeRO-3), the first and last loss, and (DeepSpeed) where `save_state` put its checkpoint.
"""

import contextlib
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, make_model, parse, write_result
from fabric_lite import Accelerator

args = parse({"--strategies": {"required": True}, "--precision": {"default": "no"}})
rank = int(os.environ.get("RANK", "0"))
targets = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(7))
results = {}
for name in args.strategies.split(","):
    accelerator = Accelerator(strategy=name, gradient_accumulation_steps=2, mixed_precision=args.precision)
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(IndexDataset(64), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, norms = [], []
    for epoch in range(2):
        for x, index in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x) * 3.0, targets[index])
                accelerator.backward(loss)
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                if norm is not None:  # DDP reports the norm; DeepSpeed clips inside its step
                    norms.append(float(norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    inner = accelerator.unwrap_model(model)
    gathered = contextlib.nullcontext()
    if getattr(accelerator.strategy, "stage", None) == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(inner.parameters()))
    with gathered:
        weights = {k: v.detach().float().reshape(-1).tolist() for k, v in inner.named_parameters()}
    entry = {"weights": weights, "first_loss": sum(losses[:4]) / 4, "last_loss": sum(losses[-4:]) / 4,
             "lr": optimizer.param_groups[0]["lr"], "largest_norm": max(norms, default=None)}
    if name.startswith("deepspeed"):
        entry["checkpoint"] = accelerator.save_state(os.path.join(args.out, f"ckpt_{name}"))
    results[name] = entry
write_result(args.out, rank, results)
