"""Trainer.predict as Lightning users call it: return shapes, return_predictions, ckpt_path, BasePredictionWriter
per batch and per epoch with each batch's dataset indices, and predictions gathered in dataset order, on one
process and on two (21 samples: the shards differ in length)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import WORKERS
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks.prediction_writer import BasePredictionWriter
from fabric_lite.trainer.predict_loop import gather_in_dataset_order, join_samples, split_samples

sys.path.insert(0, str(WORKERS))
from common import IndexDataset  # noqa: E402
from predict_common import IndexedPredictor, Recorder  # noqa: E402


def make_trainer(tmp_path, callbacks=(), **kwargs):
    return Trainer(default_root_dir=str(tmp_path), callbacks=list(callbacks), enable_progress_bar=False,
                   enable_checkpointing=False, logger=False, enable_model_summary=False, **kwargs)


def test_predict_returns_batch_outputs_on_the_cpu_and_a_list_per_loader(tmp_path):
    trainer = make_trainer(tmp_path)
    module = IndexedPredictor()
    out = trainer.predict(module, DataLoader(IndexDataset(10), batch_size=4))
    assert [b["idx"].tolist() for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([b["logits"] for b in out]), module.net(IndexDataset(10).x))
    assert all(b["logits"].device.type == "cpu" for b in out)
    two = trainer.predict(module, [DataLoader(IndexDataset(3), batch_size=2), DataLoader(IndexDataset(5), batch_size=5)])
    assert [[b["idx"].tolist() for b in loader] for loader in two] == [[[0, 1], [2]], [[0, 1, 2, 3, 4]]]
    assert trainer.predict(module, DataLoader(IndexDataset(4), batch_size=2), return_predictions=False) is None
    with pytest.raises(TypeError, match="return_predictions='yes'"):
        trainer.predict(module, DataLoader(IndexDataset(4)), return_predictions="yes")


def test_prediction_writer_is_told_each_batch_and_the_epoch_with_dataset_indices(tmp_path):
    per_batch, per_epoch, both = Recorder("batch"), Recorder("epoch"), Recorder("batch_and_epoch")
    trainer = make_trainer(tmp_path, [per_batch, per_epoch, both])
    ds = IndexDataset(10)
    shuffled = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    out = trainer.predict(IndexedPredictor(), shuffled, return_predictions=False)
    assert out is None
    # the indices told are the samples' own (IndexDataset's label is the index), in the shuffled order
    assert len(per_batch.batch_writes) == 3 and per_batch.epoch_writes == []
    for indices, labels, batch_idx, dataloader_idx in per_batch.batch_writes:
        assert indices == labels and dataloader_idx == 0
    assert [w[2] for w in per_batch.batch_writes] == [0, 1, 2]
    assert sorted(i for w in per_batch.batch_writes for i in w[0]) == list(range(10))
    assert per_epoch.batch_writes == [] and len(per_epoch.epoch_writes) == 1
    count, indices = per_epoch.epoch_writes[0]
    assert count == 3 and indices == [[w[0] for w in per_batch.batch_writes]]  # per loader, per batch
    assert both.batch_writes == per_batch.batch_writes and both.epoch_writes == per_epoch.epoch_writes


def test_prediction_writer_refuses_an_unknown_interval_and_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="write_interval='step'.*'batch', 'epoch', 'batch_and_epoch'"):
        BasePredictionWriter("step")

    class Forgot(BasePredictionWriter):
        pass

    with pytest.raises(NotImplementedError, match="Forgot writes per batch.*write_on_batch_end"):
        make_trainer(tmp_path, [Forgot()]).predict(IndexedPredictor(), DataLoader(IndexDataset(2)))


def test_gathered_predictions_on_one_process_are_the_plain_ones_in_dataset_order(tmp_path):
    trainer = make_trainer(tmp_path)
    module = IndexedPredictor()
    loader = DataLoader(IndexDataset(10), batch_size=4)
    plain = trainer.predict(module, loader)
    gathered = trainer.predict(module, loader, gather=True)
    assert len(gathered) == len(plain)
    for a, b in zip(gathered, plain):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    shuffled = DataLoader(IndexDataset(10), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    ordered = trainer.predict(module, shuffled, gather=True)
    assert [b["idx"].tolist() for b in ordered] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_gather_drops_the_repeats_that_pad_the_last_step(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.predict(IndexedPredictor(), DataLoader(IndexDataset(2)))  # (attaches the strategy's collectives)
    # as a padded last step repeats the epoch's first samples on a rank
    preds = [torch.tensor([[2.0], [3.0]]), torch.tensor([[0.0], [2.0]])]
    assert [t.flatten().tolist() for t in gather_in_dataset_order(trainer, preds, [[2, 3], [0, 2]], 2)] == \
        [[0.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match="2 batch outputs but 1 batches of indices"):
        gather_in_dataset_order(trainer, preds, [[2, 3]], 2)


def test_split_and_join_samples_keep_the_structure_of_a_batch_output():
    out = {"a": torch.arange(6).reshape(3, 2), "b": (torch.arange(3), ["x", "y", "z"])}
    samples = split_samples(out, 3)
    assert samples[1]["a"].tolist() == [2, 3] and samples[2]["b"][1] == "z"
    back = join_samples(samples)
    assert back["a"].tolist() == out["a"].tolist() and back["b"][0].tolist() == [0, 1, 2]
    assert back["b"][1] == ["x", "y", "z"]
    with pytest.raises(ValueError, match=r"shape \(2,\) cannot be cut into the batch's 3 samples"):
        split_samples(torch.zeros(2), 3)
    with pytest.raises(TypeError, match="float cannot be cut"):
        split_samples(1.5, 3)


class Trained(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_predict_with_ckpt_path_uses_the_saved_weights(tmp_path):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g))
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=1, enable_progress_bar=False, logger=False,
                      enable_model_summary=False)
    module = Trained()
    trainer.fit(module, DataLoader(ds, batch_size=4))
    saved = [p.detach().clone() for p in module.parameters()]
    expected = trainer.predict(module, DataLoader(ds, batch_size=4))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # moved away from the checkpoint
    again = trainer.predict(module, DataLoader(ds, batch_size=4), ckpt_path="last")
    torch.testing.assert_close(torch.cat(again), torch.cat(expected))
    for p, q in zip(module.parameters(), saved):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match='predict\\(ckpt_path="best"\\) needs a ModelCheckpoint'):
        make_trainer(tmp_path).predict(Trained(), DataLoader(ds), ckpt_path="best")


def plain(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


def test_two_processes_write_their_own_shards_and_gather_the_one_process_predictions(tmp_path, launch):
    n, b = 21, 4
    reference = plain(make_trainer(tmp_path).predict(IndexedPredictor(), DataLoader(IndexDataset(n), batch_size=b)))
    results = launch("trainer_predict", 2, "--samples", n, "--batch", b, timeout=240)
    assert [r["world"] for r in results] == [2, 2]
    # global step k is batches 2k (rank 0) and 2k+1 (rank 1) of the one-process order: 6 batches, 3 each
    for rank, r in enumerate(results):
        assert r["mine"] == reference[rank::2]
        assert r["nothing"] is None
        for got, want in zip(r["gathered"], reference):
            assert got["idx"] == want["idx"]
            torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(want["logits"]))
        assert len(r["gathered"]) == len(reference) and r["from_writer"] == r["gathered"]
        # what the writer was told per batch: this rank's dataset indices, the samples it really got
        first_run = r["batch_writes"][:3]
        assert [w[0] for w in first_run] == [w[1] for w in first_run] == [ref["idx"] for ref in reference[rank::2]]
        count, indices = r["epoch_writes"][0]
        assert count == 3 and indices == [[ref["idx"] for ref in reference[rank::2]]]
        # two loaders: each gathered on its own, in dataset order
        assert [[b["idx"] for b in loader] for loader in r["two"]] == [[ref["idx"] for ref in reference],
                                                                       [[0, 1], [2, 3], [4]]]
        # ... and the writer heard which loader each batch came from (the 5 samples: batches 0, 2 on rank 0)
        second = 2 if rank == 0 else 1
        two_writes = r["batch_writes"][-(3 + second):]
        assert [w[3] for w in two_writes] == [0, 0, 0] + [1] * second
        assert [w[0] for w in two_writes[3:]] == ([[0, 1], [4]] if rank == 0 else [[2, 3]])
