"""Weight averaging under the Trainer (tests/callbacks/test_weight_averaging.py): EMAWeightAveraging on the shared
run of `averaging_run`, on one process, on 2 DDP or FSDP processes (torchrun, gloo), or killed by SIGKILL after
step `--kill-at` and resumed from the last checkpoint (`--resume`)."""

import os
import signal

import torch

import averaging_run as ar
from common import parse, write_result
from fabric_lite.callbacks import Callback

args = parse({"--root": {"required": True}, "--strategy": {"default": "auto"}, "--kill-at": {"type": int, "default": 0},
              "--resume": {"action": "store_true"}})


class Kill(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if args.kill_at and trainer.global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


world = int(os.environ.get("WORLD_SIZE", "1"))
trainer, module, ema, trained = ar.fit(args.root, batch_size=ar.GLOBAL_BATCH // world, strategy=args.strategy,
                                       checkpoint_every=2, extra=[Kill()], ckpt_path="last" if args.resume else None)
full = ar.flat(module)  # (collective under FSDP: every rank gathers)
full_bytes = sum(p.numel() * p.element_size() for p in module.parameters()) if not ema.average.sharded else \
    sum(p.full_tensor().numel() * p.element_size() for p in module.parameters())
write_result(args.out, trainer.global_rank, {
    "final": full, "trained": trained, "global_step": trainer.global_step, "sharded": ema.average.sharded,
    "average_bytes": ema.average.local_bytes(), "model_bytes": full_bytes,
    "n_averaged": int(ema.average.n_averaged), "val_weights": ar.VAL_WEIGHTS[-1] if ar.VAL_WEIGHTS else None})
