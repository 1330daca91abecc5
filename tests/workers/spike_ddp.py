"""SpikeDetection on 2 processes (DDP, gloo): the loss is NaN on rank 1 only, at batch 2 of epoch 0; every mode
must act on both processes at the same step. Also the raw door's watch_losses()/step_is_finite()."""

import os
import warnings

import spike_common as sc
import torch.distributed as dist
from common import parse, write_result
from fabric_lite.callbacks import TrainingSpikeException

args = parse({"--root": {"required": True}})
results = {}
BAD = dict(bad_rank=1, bad_epoch=0, bad_batch=2)


reduces = [0]  # the all-reduces made from Python (DDP's gradient buckets are not among them)
_all_reduce = dist.all_reduce


def counted(*a, **k):
    reduces[0] += 1
    return _all_reduce(*a, **k)


dist.all_reduce = counted


def since(start):
    return reduces[0] - start


def done(name, value, rank):
    results[name] = value
    write_result(args.out, rank, results)


# the plain loop that leaves that step out (the loss times 0: no update under SGD), then "skip"
start = reduces[0]
module = sc.Regression(skip={(0, 2)})
trainer = sc.fit(f"{args.root}/reference", module, [], strategy="ddp")
rank = trainer.global_rank
done("reference", {"weights": sc.flat(module), "global_step": trainer.global_step, "reduces": since(start)}, rank)

start = reduces[0]
module = sc.Regression(**BAD)
trainer = sc.fit(f"{args.root}/skip", module, [sc.spike("skip")], strategy="ddp")
done("skip", {"weights": sc.flat(module), "global_step": trainer.global_step, "reduces": since(start)}, rank)

# "warn" decides in one all-reduce of its own per step (the NaN is in the loss only: the gradients stay finite)
start = reduces[0]
module = sc.Regression(**BAD)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = sc.fit(f"{args.root}/warn", module, [sc.spike("warn")], strategy="ddp")
done("warn", {"warnings": [str(w.message) for w in caught if "SpikeDetection" in str(w.message)],
              "global_step": trainer.global_step, "reduces": since(start)}, rank)

# "rollback": checkpoints every 2 steps; the spike at batch 2 goes back to the one after batch 1
module = sc.Regression(**BAD)
trainer = sc.fit(f"{args.root}/rollback", module, [sc.spike("rollback")], strategy="ddp", every_n_train_steps=2)
done("rollback", {"weights": sc.flat(module), "global_step": trainer.global_step, "seen": module.seen,
                  "excluded": open(f"{args.root}/rollback/skip_batches.json").read()}, rank)

# killed later (epoch 1), then resumed from the checkpoint taken before the spike: the batch stays left out, though
# this time the loss there is finite and nothing detects anything
first = os.path.join(f"{args.root}/rollback/ckpt", "epoch=0-step=2")
module = sc.Regression(kill_at=(1, 1))
try:
    sc.fit(f"{args.root}/rollback", module, [sc.spike("rollback")], strategy="ddp", ckpt_path=first)
except KeyboardInterrupt:
    pass
module = sc.Regression()
trainer = sc.fit(f"{args.root}/rollback", module, [sc.spike("rollback")], strategy="ddp", ckpt_path=first)
done("resumed", {"weights": sc.flat(module), "global_step": trainer.global_step, "seen": module.seen}, rank)

# "error": every process raises at the same batch
module = sc.Regression(**BAD)
try:
    sc.fit(f"{args.root}/error", module, [sc.spike("error")], strategy="ddp")
    done("error", None, rank)
except TrainingSpikeException as err:
    done("error", {"message": str(err), "batch_idx": err.batch_idx, "global_step": module.trainer.global_step}, rank)

# the raw door
start = reduces[0]
w, skipped = sc.raw_loop(bad_rank=1, bad_step=2)
raw_reduces = since(start)
start = reduces[0]
w_ref, skipped_ref = sc.raw_loop(skip_step=2, check=False)
done("raw", {"weights": w, "skipped": skipped, "reference": w_ref, "reduces": raw_reduces,
             "reference_reduces": since(start)}, rank)
