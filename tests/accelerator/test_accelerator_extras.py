"""Accelerate names beyond the core loop, and recovery from an interrupted checkpoint publish."""

import shutil

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from fabric_lite import Accelerator, GradientAccumulationPlugin
from fabric_lite.accelerator.accelerator import DistributedType
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.data.loader import ShardedBatchSampler


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_sync_each_batch_still_steps_every_n_micro_batches():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_each_batch=True))
    model, opt = acc.prepare(*_model_and_opt())
    loader = acc.prepare(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=1))
    steps = []
    opt.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    for (x,) in loader:
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            opt.step()
            opt.zero_grad()
    assert len(steps) == 2


def test_interrupted_publish_is_recovered_on_load(tmp_path):
    acc = Accelerator()
    model, opt = acc.prepare(*_model_and_opt())
    target = tmp_path / "last"
    acc.save_state(target)
    saved = model.weight.detach().clone()
    # a crash between "move the old checkpoint aside" and "move the new one in" leaves only .old-*
    target.rename(tmp_path / "last.old-deadbeef")
    with torch.no_grad():
        model.weight.add_(1.0)
    acc.load_state(target)
    assert torch.equal(model.weight, saved) and target.exists()
    # a complete staging directory (its manifest is written last) wins over an older copy
    shutil.copytree(target, tmp_path / "last.staging-cafe")
    (tmp_path / "last.staging-cafe" / "marker").write_text("newer")
    target.rename(tmp_path / "last.old-beef")
    acc.load_state(target)
    assert (target / "marker").exists()
    # the next save clears what interrupted saves left behind
    acc.save_state(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    acc = Accelerator()
    acc.prepare(*_model_and_opt())
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        acc.load_state(tmp_path / "nothing-here")


def test_split_batches_needs_a_batch_size():
    sampler = BatchSampler(SequentialSampler(range(10)), 5, False)
    with pytest.raises(ValueError, match="split_batches=True needs the DataLoader's batch_size"):
        ShardedBatchSampler(sampler, num_replicas=2, rank=0, batch_size=None, split_batches=True)


def test_len_of_a_skipping_loader_counts_what_it_yields():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=1))
    skipping = acc.skip_first_batches(loader, 3)
    assert len(skipping) == 7 == len(list(skipping))
    assert isinstance(loader, DataLoader) and len(loader) == 10


def test_state_hooks_run_and_can_be_removed(tmp_path):
    acc = Accelerator()
    model, opt = acc.prepare(*_model_and_opt())
    calls = []

    def on_save(models, weights, output_dir):
        calls.append(("save", len(models), sorted(weights[0]), str(output_dir)))
        weights[0]["weight"] = torch.zeros_like(weights[0]["weight"])  # hooks may edit what is written

    handle = acc.register_save_state_pre_hook(on_save)
    acc.register_load_state_pre_hook(lambda models, input_dir: calls.append(("load", len(models))))
    acc.save_state(tmp_path / "c")
    acc.load_state(tmp_path / "c")
    assert calls == [("save", 1, ["bias", "weight"], str(tmp_path / "c")), ("load", 1)]
    assert torch.count_nonzero(model.weight) == 0
    handle.remove()
    acc.save_state(tmp_path / "d")
    assert len(calls) == 2


def test_process_decorators_triggers_and_names():
    acc = Accelerator()
    assert acc.on_process(lambda: "ran", process_index=0)() == "ran"
    assert acc.on_process(lambda: "ran", process_index=1)() is None
    assert acc.on_last_process(lambda: 5)() == 5
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False
    assert acc.distributed_type == DistributedType.NO != DistributedType.DEEPSPEED
    assert acc.native_amp is False and Accelerator(mixed_precision="fp16").native_amp is True
    assert acc.scaler is None and Accelerator(mixed_precision="fp16").scaler is not None


def test_dynamo_backend_compiles_the_model():
    acc = Accelerator(dynamo_backend="eager")
    model, opt = acc.prepare(*_model_and_opt())
    assert hasattr(model, "_orig_mod")
    out = model(torch.randn(3, 4))
    assert out.shape == (3, 2)
    assert isinstance(acc.unwrap_model(model), torch.nn.Linear)
