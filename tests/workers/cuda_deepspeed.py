"""DeepSpeed ZeRO-2 in fp16 on one GPU (a lone process): the engine's loss scaler skips an overflowing
step (and the scheduler with it), and save_state/load_state resumes bit for bit."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator

args = parse()
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 16, generator=g)
data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))

acc = Accelerator(strategy="deepspeed_stage_2", mixed_precision="fp16")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
model, optimizer, loader, scheduler = acc.prepare(model, optimizer, DataLoader(data, batch_size=16, shuffle=True),
                                                  scheduler)


def batches():
    while True:
        yield from loader


stream = batches()


def train(steps, inject_inf_at=None):
    skipped, losses = [], []
    for step in range(steps):
        xb, yb = next(stream)
        loss = F.mse_loss(model(xb), yb)
        losses.append(loss.item())
        if step == inject_inf_at:
            loss = loss * float("inf")
        acc.backward(loss)
        optimizer.step()
        skipped.append(acc.optimizer_step_was_skipped)
        scheduler.step()
        optimizer.zero_grad()
    return skipped, losses


def weights():
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in acc.unwrap_model(model).parameters()])


# DeepSpeed's dynamic loss scale starts at 2**16 (fp16.initial_scale_power) and halves on overflow.
skipped, losses = train(40, inject_inf_at=30)
lr_after = scheduler.get_last_lr()[0]
acc.save_state(f"{args.out}/ckpt")
train(6)
straight = weights()
acc.load_state(f"{args.out}/ckpt")
stream = batches()  # a new pass over the loader starts where the checkpoint left it
train(6)
write_result(args.out, 0, {
    "skipped": skipped, "first_loss": sum(losses[:5]) / 5, "last_loss": sum(losses[-5:]) / 5,
    "lr_after": lr_after, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    "resumed_equal": bool(torch.equal(straight, weights())), "device": str(acc.device),
})
acc.end_training()
