"""Trainer under DDP: parity with one process, metrics over uneven validation shards, early stopping.

Several scenarios share one launch (each launch costs seconds); results are written after each.
"""

import torch

import trainer_common as tc
from common import parse, write_result
from fabric_lite import Trainer
from fabric_lite.callbacks import EarlyStopping

args = parse({"--root": {"required": True}})
results = {}


def done(name, value, rank):
    results[name] = value
    write_result(args.out, rank, results)


# 1. 2 processes x batch 4 (and x batch 2 x accumulate 2) == 1 process x batch 8
trainer, w = tc.fit_parity(f"{args.root}/parity", batch_size=4)
rank = trainer.strategy.global_rank
done("parity", {"weights": w, "global_step": trainer.global_step, "world": trainer.world_size,
                "strategy": type(trainer.strategy).__name__}, rank)
trainer, w = tc.fit_parity(f"{args.root}/accum", batch_size=2, accumulate=2)
done("accum", {"weights": w, "global_step": trainer.global_step}, rank)

# 2. validation metrics over 101 samples in batches of 8: 13 batches, 7 on rank 0 and 6 on rank 1
train, val = tc.classification_set(64, seed=1), tc.classification_set(101, seed=2)
module = tc.Classifier()
trainer = Trainer(max_epochs=2, default_root_dir=f"{args.root}/metrics", enable_progress_bar=False,
                  enable_checkpointing=False)
trainer.fit(module, torch.utils.data.DataLoader(train, batch_size=8),
            torch.utils.data.DataLoader(val, batch_size=8))
fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
seen = list(module.seen)
validated = trainer.validate(module, torch.utils.data.DataLoader(val, batch_size=8))[0]
done("metrics", {"fit": fit_metrics, "validate": validated, "seen": seen,
                 "by_hand_acc": tc.accuracy(module.net, val), "global_x0": val.tensors[0][:, 0].mean().item(),
                 "global_x0_max": val.tensors[0][:, 0].max().item(),
                 "local_x0": val.tensors[0][seen, 0].mean().item()}, rank)

# 3. early stopping on a per-process (unsynced) metric: every rank must stop at the same epoch
values = [[5, 4, 4, 4, 4, 4, 4, 4], [5, 4, 3, 2, 1, 0, -1, -2]]
stopper = EarlyStopping(monitor="val/metric", patience=2)
trainer = Trainer(max_epochs=8, default_root_dir=f"{args.root}/early", callbacks=[stopper],
                  enable_progress_bar=False, enable_checkpointing=False)
trainer.fit(tc.RankScripted(values), tc.small_loader(), tc.small_loader(n=8))
done("early", {"stopped_epoch": stopper.stopped_epoch, "current_epoch": trainer.current_epoch,
               "global_step": trainer.global_step}, rank)
