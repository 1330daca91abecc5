"""The module and writer the prediction tests share (in the test process and in the workers)."""

from common import make_model
from fabric_lite import TrainModule
from fabric_lite.callbacks.prediction_writer import BasePredictionWriter


class IndexedPredictor(TrainModule):
    """Predicts logits and hands back each sample's own index (IndexDataset's label), so a test can tell
    which samples a batch held."""

    def __init__(self):
        super().__init__()
        self.net = make_model(seed=0)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, idx = batch
        return {"logits": self.net(x), "idx": idx}


class Recorder(BasePredictionWriter):
    """Records what it is told: per batch (indices, the samples' own indices, batch_idx, dataloader_idx) and
    per epoch (the number of outputs and the batch indices)."""

    def __init__(self, interval):
        super().__init__(interval)
        self.batch_writes, self.epoch_writes = [], []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batch_writes.append([list(batch_indices), batch[1].tolist(), batch_idx, dataloader_idx])

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        self.epoch_writes.append([len(predictions), batch_indices])
