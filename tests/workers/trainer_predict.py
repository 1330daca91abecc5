"""Trainer.predict on several processes: what a BasePredictionWriter is told on each rank, and every rank's
predictions gathered back in dataset order (21 samples: not divisible by 2)."""

from torch.utils.data import DataLoader

from common import IndexDataset, parse, write_result
from predict_common import IndexedPredictor, Recorder
from fabric_lite import Trainer
from fabric_lite.trainer.predict_loop import gather_in_dataset_order

args = parse({"--samples": {"type": int, "default": 21}, "--batch": {"type": int, "default": 4}})


class GatheringWriter(Recorder):
    """Records as Recorder does, and gathers every rank's predictions in write_on_epoch_end (a collective)."""

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        super().write_on_epoch_end(trainer, module, predictions, batch_indices)
        if len(batch_indices) == 1:
            self.gathered = gather_in_dataset_order(trainer, predictions, batch_indices[0], args.batch)


writer = GatheringWriter("batch_and_epoch")
trainer = Trainer(callbacks=[writer], enable_progress_bar=False, enable_checkpointing=False, logger=False,
                  enable_model_summary=False)
loader = DataLoader(IndexDataset(args.samples), batch_size=args.batch)
mine = trainer.predict(IndexedPredictor(), loader)
gathered = trainer.predict(IndexedPredictor(), loader, gather=True)
nothing = trainer.predict(IndexedPredictor(), loader, return_predictions=False)
two = trainer.predict(IndexedPredictor(), [loader, DataLoader(IndexDataset(5), batch_size=2)], gather=True)


def plain(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


write_result(args.out, trainer.global_rank, {
    "world": trainer.world_size,
    "mine": plain(mine),
    "gathered": plain(gathered),
    "from_writer": plain(writer.gathered),
    "nothing": nothing,
    "two": [plain(p) for p in two],
    "batch_writes": writer.batch_writes,
    "epoch_writes": writer.epoch_writes,
})
