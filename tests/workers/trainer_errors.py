"""Trainer under DDP: mistakes that would make one process wait for the others for ever.

`--scenario` picks what to try; each rank reports the exception it saw (or none) as JSON.
"""

import datetime
import os

import torch.distributed as dist

import trainer_common as tc
from common import parse, write_result
from fabric_lite import DDPStrategy, Trainer
from fabric_lite.callbacks import ModelCheckpoint

args = parse({"--root": {"required": True}, "--scenario": {"required": True, "action": "append"},
              "--collective-timeout": {"type": float, "default": 15.0}})


class OneRankSyncsInValidation(tc.RankScripted):
    def validation_step(self, batch, batch_idx):
        self.log("val/both", 1.0, sync_dist=True)
        if self.trainer.is_global_zero:
            self.log("val/only0", 1.0, sync_dist=True)


class OneRankSyncsInTrainingEpoch(tc.RankScripted):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.is_global_zero:
            self.log("train/only0", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class OneRankSyncsPerStep(tc.RankScripted):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.is_global_zero:
            self.log("train/only0_step", loss, sync_dist=True)     # on_step by default in training
        return loss


def scenario(name):
    callbacks = []
    if name == "val_sync_one_rank":
        module = OneRankSyncsInValidation([[0] * 4] * 2)
    elif name == "train_epoch_sync_one_rank":
        module = OneRankSyncsInTrainingEpoch([[0] * 4] * 2)
    elif name == "step_sync_one_rank":
        module = OneRankSyncsPerStep([[0] * 4] * 2)
    elif name == "checkpoint_unsynced_monitor":
        # Each process sees its own (unsynced) value: rank 0 improves every epoch, rank 1 never after epoch 0.
        module = tc.RankScripted([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
        callbacks = [ModelCheckpoint(monitor="val/metric", mode="min", save_top_k=1)]
    elif name == "checkpoint_unsynced_filename":
        # Same decision everywhere (keep all), but the file name holds a per-process value.
        module = tc.RankScripted([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
        callbacks = [ModelCheckpoint(monitor="val/metric", save_top_k=-1, filename="{epoch}-{val/metric:.1f}")]
    else:
        raise SystemExit(f"unknown scenario {name}")
    # A short collective timeout turns a hang into an exception the test can read.
    strategy = DDPStrategy(timeout=datetime.timedelta(seconds=args.collective_timeout))
    trainer = Trainer(max_epochs=3, default_root_dir=f"{args.root}/{name}", callbacks=callbacks, strategy=strategy,
                      num_sanity_val_steps=0, enable_progress_bar=False, enable_checkpointing=bool(callbacks))
    try:
        trainer.fit(module, tc.small_loader(), tc.small_loader(n=8))
    except Exception as err:  # reported, not raised: the test reads what each rank saw
        return {"error": type(err).__name__, "message": str(err), "global_step": trainer.global_step}
    ckpt = trainer.checkpoint_callback
    exists = ckpt is not None and os.path.isdir(ckpt.dirpath)
    dirs = sorted(d for d in os.listdir(ckpt.dirpath) if os.path.isdir(os.path.join(ckpt.dirpath, d))) if exists else None
    return {"error": None, "global_step": trainer.global_step,
            "best_model_path": getattr(ckpt, "best_model_path", None),
            "saved": dirs,
            "files": {d: sorted(os.listdir(os.path.join(ckpt.dirpath, d))) for d in dirs} if exists else None}


results = {}
for name in args.scenario:
    results[name] = scenario(name)
    write_result(args.out, dist.get_rank(), results)
