"""Resume on another number of processes, both doors (tests/checkpoint/test_world_size.py).

One epoch of 96 shuffled samples (IndexDataset: each sample carries its index), SGD on a linear model, DDP
on `WORLD_SIZE` processes (one process: no launcher) with `--batch` samples per process. Phases:

- `save`: train `--save-at` optimizer steps, save a checkpoint to `--ckpt`, stop;
- `resume`: a fresh run (other seed) that loads `--ckpt` and trains to the end of the epoch;
- `full`: the whole epoch uninterrupted.

`--accum K` (raw door): K micro-steps per optimizer step; `--save-at` counts micro-steps, so an odd count with
K=2 saves inside an accumulation window.

Every rank reports the sample indices it trained on, step by step; rank 0 also the final weights."""

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import IndexDataset, parse, write_result
from fabric_lite import Accelerator, Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback

args = parse({"--door": {"required": True}, "--phase": {"required": True}, "--batch": {"type": int, "required": True},
              "--save-at": {"type": int, "default": 0}, "--ckpt": {"required": True},
              "--accum": {"type": int, "default": 1}})
rank = int(os.environ.get("RANK", "0"))
N = 96


def loader():
    return DataLoader(IndexDataset(N), batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(7))


def net(seed):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def loss_of(model, batch):
    x, i = batch
    return F.mse_loss(model(x), torch.stack([x[:, 0], x[:, 1] * 2, i.float() / N], 1))


seed = 99 if args.phase == "resume" else 0
steps = []

if args.door == "raw":
    set_seed(seed)
    acc = Accelerator(gradient_accumulation_steps=args.accum)
    model = net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    model, opt, data = acc.prepare(model, opt, loader())
    if args.phase == "resume":
        acc.load_state(args.ckpt)
    for batch in data:
        steps.append(batch[1].tolist())
        with acc.accumulate(model):
            acc.backward(loss_of(model, batch))
            opt.step()
            opt.zero_grad()
        if args.phase == "save" and len(steps) == args.save_at:
            acc.save_state(args.ckpt)
            break
    weights = acc.unwrap_model(model)
else:
    class Module(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = net(seed)

        def training_step(self, batch, batch_idx):
            steps.append(batch[1].tolist())
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == args.save_at:
                trainer.save_checkpoint(args.ckpt)
                trainer.should_stop = True

    set_seed(seed)
    module = Module()
    trainer = Trainer(max_epochs=1, default_root_dir=os.path.join(args.out, "root"), enable_progress_bar=False,
                      enable_checkpointing=False, num_sanity_val_steps=0,
                      callbacks=[SaveAt()] if args.phase == "save" else [])
    trainer.fit(module, loader(), ckpt_path=args.ckpt if args.phase == "resume" else None)
    weights = module.net
write_result(args.out, rank, {"steps": steps,
                              "weights": torch.cat([p.detach().reshape(-1) for p in weights.parameters()]).tolist()})
