"""save_state mid-epoch, rebuild everything, load_state, finish: equal bit for bit to never stopping."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import IndexDataset, flat_weights, make_model, parse, write_result
from fabric_lite import Accelerator, set_seed

args = parse({"--ckpt": {}, "--precision": {"default": "no"}, "--workers": {"type": int, "default": 0}})
EPOCHS, STOP_EPOCH, STOP_STEP = 3, 1, 4  # step 4: the middle of an accumulation window


def build(seed):
    set_seed(seed)
    acc = Accelerator(mixed_precision=args.precision, gradient_accumulation_steps=2)
    model = torch.nn.Sequential(make_model(seed), torch.nn.Dropout(0.2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(IndexDataset(40), batch_size=3, shuffle=True, num_workers=args.workers)
    return (acc, *acc.prepare(model, opt, loader, sched))


def train(acc, model, opt, loader, sched, start_epoch=0, save_at=None, die_at=None):
    """Train to the end; optionally save_state after the step at `save_at` and stop at `die_at`."""
    for epoch in range(start_epoch, EPOCHS):
        for step, (x, idx) in enumerate(loader):
            if (epoch, step) == die_at:
                return
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), idx % 3)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if (epoch, step) == save_at:
                acc.save_state(args.ckpt)


acc, *objs = build(seed=1)
train(acc, *objs)
uninterrupted = flat_weights(acc.unwrap_model(objs[0]))
acc.free_memory()

# Save mid-epoch and mid-accumulation-window, train on as a killed job would have, then die.
acc, *objs = build(seed=1)
train(acc, *objs, save_at=(STOP_EPOCH, STOP_STEP), die_at=(STOP_EPOCH + 1, 2))
acc.free_memory()

acc, *objs = build(seed=99)  # different initial weights and RNG: everything must come from the checkpoint
acc.load_state(args.ckpt)
train(acc, *objs, start_epoch=objs[2].epoch)
resumed = flat_weights(acc.unwrap_model(objs[0]))
write_result(args.out, acc.process_index, {
    "equal": bool(torch.equal(uninterrupted, resumed)), "max_diff": float((uninterrupted - resumed).abs().max()),
})
