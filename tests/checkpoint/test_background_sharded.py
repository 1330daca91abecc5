"""Background saves of sharded checkpoints: FSDP2 (DCP shards) and DeepSpeed ZeRO-3 (the engine's own files).

The training thread only takes a host copy of each process's shards; DCP's write (over a gloo group of its
own) or the engine files' writes, the checksums and the publish run on the background thread. Real processes
(gloo on CPU, tests/workers/bg_sharded.py): runs saving continuously (the next save as soon as the last is
published) are SIGKILLed, every process at once, at random moments, and every checkpoint they left must load
and resume bit for bit. By hand, 100 kills: ``python tests/workers/bg_sharded.py --out /tmp/k --phase kills
--trials 100 --strategy fsdp`` (or ``deepspeed_stage_3``).
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.callbacks.checkpoint import CONTINUOUS, ModelCheckpoint
from fabric_lite.checkpoint.saver import Snapshot, _HostBuffers


def _kills(tmp_path, strategy, trials, seed):
    from test_resume import Run

    run = Run("bg_sharded.py", tmp_path / "out", "--phase", "kills", "--strategy", strategy, "--trials", trials,
              "--root", tmp_path / "trials", "--seed", seed, "--steps", 40, "--step-sleep", 0.02, timeout=600)
    (report,) = run.ok()
    verify = report["verify"]
    assert verify is not None, report["logs"]
    return report, verify


@pytest.mark.parametrize("strategy, trials", [("fsdp", 8), ("deepspeed_stage_3", 3)])
def test_background_sharded_saves_killed_at_random_moments_load_and_resume_exact(tmp_path, strategy, trials):
    report, verify = _kills(tmp_path, strategy, trials, seed=3)
    assert report["trials"][0]["codes"] == [0, 0], report["trials"][0]  # the uninterrupted run
    assert report["killed"] == trials - 1
    assert report["in_flight"] >= (trials - 1) // 2, report["trials"]  # most kills land inside a save
    assert verify["unloadable"] == [] and verify["different"] == [], verify
    assert verify["checked"] >= trials, verify  # (every run but one killed very early leaves checkpoints)


# -- in one process ---------------------------------------------------------------------------------------

def test_a_snapshot_of_a_sharded_tensor_keeps_its_placement_and_reuses_its_buffer():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    started = not dist.is_initialized()
    if started:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
        buffers = _HostBuffers()
        taken = Snapshot(buffers)
        copy = taken.copy({"w": value, "again": value})
        assert taken.finish() is None
        assert isinstance(copy["w"], DTensor) and copy["w"].placements == value.placements
        assert copy["w"] is copy["again"]  # one copy of a tensor seen twice
        assert torch.equal(copy["w"].to_local(), value.to_local())
        value.to_local().add_(1)  # training goes on: the copy does not move
        assert torch.equal(copy["w"].to_local(), torch.arange(6.0).reshape(3, 2))
        first = copy["w"].to_local().data_ptr()
        again = Snapshot(buffers)
        second = again.copy({"w": value})
        assert second["w"].to_local().data_ptr() == first  # the host buffer is reused from save to save
    finally:
        if started:
            dist.destroy_process_group()


class _Tiny(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)  # a step lasts about as long as a write of this checkpoint
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_continuous_policy_saves_whenever_the_last_save_is_published_and_keeps_two(tmp_path, monkeypatch):
    from fabric_lite.checkpoint.files import CheckpointWriter

    # each background write lasts until training has taken two more steps (as a big model's would), or 1 s
    original = CheckpointWriter.write
    trainer = None

    def write(writer, name, obj):
        if threading.current_thread() is not threading.main_thread() and name.startswith("rng"):
            start, deadline = trainer.global_step, time.monotonic() + 1.0
            while trainer.global_step < start + 2 and time.monotonic() < deadline:
                time.sleep(0.001)
        return original(writer, name, obj)

    monkeypatch.setattr(CheckpointWriter, "write", write)
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=CONTINUOUS, save_top_k=1)
    assert callback.save_top_k == 2 and callback.every_n_epochs == 0  # at least two kept; no extra epoch saves
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 4)), batch_size=2)
    trainer = Trainer(max_epochs=1, callbacks=[callback], default_root_dir=str(tmp_path), enable_progress_bar=False,
                      logger=False, accelerator="cpu", enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Tiny(), data)
    history = trainer.accelerator.checkpoint_saver.history
    assert all(r.background for r in history) and all(r.error is None for r in history)
    # 20 steps, each write overlapping two of them: a save every 2-3 steps, the next one started at once
    assert 4 <= len(history) <= 10, len(history)
    names = sorted((p.name for p in (tmp_path / "ckpt").iterdir() if p.name != "latest"),
                   key=lambda n: int(n.rsplit("=", 1)[1]))
    assert len(names) == 2, names  # the two newest


def test_continuous_policy_refuses_what_defeats_it():
    with pytest.raises(ValueError, match="monitor"):
        ModelCheckpoint(every_n_train_steps=CONTINUOUS, monitor="loss")
    with pytest.raises(ValueError, match="async_save=False"):
        ModelCheckpoint(every_n_train_steps=CONTINUOUS, async_save=False)
    with pytest.raises(ValueError, match="a number of steps"):
        ModelCheckpoint(every_n_train_steps="often")
    assert ModelCheckpoint(every_n_train_steps=CONTINUOUS, save_top_k=-1).save_top_k == -1


def test_sharded_and_engine_formats_save_in_the_background():
    acc = Accelerator()
    assert acc.checkpoint_saver.why_blocking() is None
    from fabric_lite.strategies.deepspeed_checkpoint import DeepSpeedCheckpointFormat

    assert DeepSpeedCheckpointFormat.stages_engine_files
