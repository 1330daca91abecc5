"""Callbacks under DDP (2 processes, gloo): BackboneFinetuning's new parameter group, a changing accumulation
window and ModelPruning's masks train as one process with the global batch; BackboneFinetuning without
find_unused_parameters is refused."""

import callbacks_common as cc
from common import parse, write_result
from fabric_lite.strategies import DDPStrategy

args = parse({"--root": {"required": True}})
results = {}


def done(name, value, rank):
    results[name] = value
    write_result(args.out, rank, results)


trainer, w = cc.fit(f"{args.root}/ft", 4, cc.finetuning(), strategy=DDPStrategy(find_unused_parameters=True))
rank = trainer.global_rank
done("finetuning", {"weights": w, "global_step": trainer.global_step, "world": trainer.world_size}, rank)

trainer, w = cc.fit(f"{args.root}/acc", 2, cc.accumulation(), strategy="ddp")
done("accumulation", {"weights": w, "global_step": trainer.global_step}, rank)

trainer, w = cc.fit(f"{args.root}/prune", 4, cc.pruning(), strategy="ddp")
done("pruning", {"weights": w, "global_step": trainer.global_step}, rank)

try:
    cc.fit(f"{args.root}/refused", 4, cc.finetuning(), strategy="ddp")
    done("refused", None, rank)
except ValueError as err:
    done("refused", str(err), rank)
