"""`Trainer(explain=True)` and `fabric-lite explain`: the printed plan (world size, per-process batch,
effective global batch, sharding, checkpoint location, settings given twice or ignored), and that
nothing is trained or written."""

from __future__ import annotations

import copy
import itertools
import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import WORKERS, run_command
from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.callbacks import CSVLogger, TensorBoardLogger
from fabric_lite.engine import GradientState
from fabric_lite.data.loader import ShardedBatchSampler, shard_dataloader
from fabric_lite.strategies.environments import read_launch_settings
from fabric_lite.explain import loader_share


@pytest.fixture(autouse=True)
def _no_explain_env(monkeypatch):
    monkeypatch.delenv("FABRIC_LITE_EXPLAIN", raising=False)


def value(out: str, label: str) -> str:
    """The value printed on the plan line `label` (the plan prints '  label<2+ spaces>value')."""
    match = re.search(rf"^  {re.escape(label)}\s{{2,}}(.*)$", out, re.MULTILINE)
    assert match, f"no line {label!r} in the plan:\n{out}"
    return match.group(1)


def data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Regressor(TrainModule):
    def __init__(self, manual=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.steps = 0
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- Trainer(explain=True) -------------------------------------------------------------------------

def test_trainer_explain_prints_the_plan_and_trains_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    module = Regressor()
    before = copy.deepcopy(module.state_dict())
    trainer = Trainer(explain=True, max_epochs=3, accumulate_grad_batches=4, default_root_dir=str(root),
                      limit_val_batches=3, callbacks=[TensorBoardLogger(str(root / "tb")), CSVLogger(str(root / "csv"))],
                      enable_progress_bar=False)
    trainer.fit(module, DataLoader(data(40), batch_size=4, shuffle=True))
    out = capsys.readouterr().out

    assert value(out, "world size") == "1"
    assert value(out, "processes per node") == "1"
    assert value(out, "ranks from") == "lone process"
    assert value(out, "strategy") == "SingleDeviceStrategy"
    assert value(out, "precision").startswith("32-true")
    assert value(out, "train: per-process batch") == "4"
    assert value(out, "train: batches per process") == "10 per epoch"
    assert value(out, "train: samples per process") == "40 per epoch"
    assert value(out, "gradient accumulation").startswith("4 batch(es) per optimizer step")
    assert value(out, "effective global batch").startswith("16 = 4 per process x 1 process(es) x 4 accumulation")
    assert value(out, "optimizer steps per epoch") == "3"
    assert value(out, "stops after") == "max_epochs=3: 9 optimizer steps"
    assert value(out, "checkpoints") == f"{root}/checkpoints"
    assert f"{root / 'tb'}/version_0" in value(out, "loggers")
    assert "limit_val_batches=3 is ignored" in value(out, "limit_val_batches")
    # set up as for training, but no step, no callback set-up, nothing written
    assert module.steps == 0 and trainer.global_step == 0
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    assert not root.exists() or not any(root.rglob("*"))


def test_trainer_explain_reports_settings_manual_optimization_ignores(tmp_path, capsys):
    trainer = Trainer(explain=True, accumulate_grad_batches=2, gradient_clip_val=1.0, check_val_every_n_epoch=2,
                      default_root_dir=str(tmp_path), enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regressor(manual=True), DataLoader(data(10), batch_size=3))
    out = capsys.readouterr().out
    assert "ignored with manual optimization" in value(out, "accumulate_grad_batches")
    assert "ignored with manual optimization" in value(out, "gradient_clip_val")
    assert "is ignored: there is no validation" in value(out, "check_val_every_n_epoch")
    assert value(out, "checkpoints") == "none (enable_checkpointing=False)"
    assert value(out, "train: end of epoch").startswith("the last batch holds 1 sample(s)")
    assert not any(tmp_path.iterdir())


def test_explain_env_stops_the_first_prepare_with_a_loader(monkeypatch, capsys):
    monkeypatch.setenv("FABRIC_LITE_EXPLAIN", "1")
    monkeypatch.setenv("FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "3")
    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(nn.Linear(4, 1))  # no loader: no plan yet
    with pytest.raises(SystemExit) as exit_info:
        acc.prepare(model, DataLoader(data(10), batch_size=5))
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert value(out, "loader 1: batches per process") == "2 per epoch"
    assert value(out, "effective global batch").startswith("10 = 5 per process x 1 process(es) x 2 accumulation")
    assert "gradient_accumulation_steps=2 (Accelerator argument or plugin) wins over the launcher " \
           "(FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS=3)" in value(out, "gradient_accumulation_steps")


def test_explain_env_off_values():
    assert read_launch_settings({"FABRIC_LITE_EXPLAIN": "0"}).explain is None
    assert read_launch_settings({"FABRIC_LITE_EXPLAIN": ""}).explain is None
    assert read_launch_settings({"FABRIC_LITE_EXPLAIN": "1"}).explain == "1"


# -- the sharding lines agree with the sampler the real run builds -------------------------------

@pytest.mark.parametrize("world,split,even,drop", [
    (w, s, e, d) for w, s, e, d in itertools.product((1, 2, 3), (False, True), (True, False), (False, True))])
def test_loader_share_matches_the_real_shards(world, split, even, drop):
    for n, b in itertools.product((0, 1, 5, 12, 13, 23), (1, 3, 6)):
        loader = DataLoader(list(range(n)), batch_size=b, drop_last=drop)
        prepared = shard_dataloader(loader, num_replicas=1, rank=0, device=None, gradient_state=GradientState(),
                                    split_batches=split, even_batches=even)
        share = loader_share(prepared, world)
        if split and world > 1 and b % world:
            assert share.error and "divisible" in share.error
            continue
        ranks = [list(ShardedBatchSampler(loader.batch_sampler, world, r, b, split, even, drop)) for r in range(world)]
        total = sum(len(batch) for rank in ranks for batch in rank)
        case = dict(n=n, b=b, world=world, split=split, even=even, drop=drop)
        assert share.batches == len(ranks[0]), case
        assert share.samples == sum(len(batch) for batch in ranks[0]), case
        assert share.padded == (0 if drop else total - n), case
        assert share.dropped == (n - total if drop else 0), case


# -- `fabric-lite explain` -------------------------------------------------------------------------

def explain(*args, timeout=120):
    return run_command([sys.executable, "-m", "fabric_lite.cli", "explain", *map(str, args)], timeout=timeout)


def test_cli_explain_plans_the_launch_and_never_trains(tmp_path):
    proc = explain("--nproc-per-node", 2, "--gradient-accumulation-steps", 2, WORKERS / "explain_script.py",
                   "--out", tmp_path, "--samples", 50, "--batch-size", 4)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dry run in one process" in out
    assert value(out, "world size") == "2"
    assert value(out, "processes per node") == "2"
    assert value(out, "nodes") == "1"
    assert value(out, "strategy").startswith("DDPStrategy")
    assert value(out, "loader 1: per-process batch") == "4"
    # 50 samples in 13 batches of 4; rank 0 of 2 gets 7, the last global step padded with 6 repeats
    assert value(out, "loader 1: batches per process") == "7 per epoch (rank 0 of 2)"
    assert value(out, "loader 1: samples per process") == "28 per epoch"
    assert value(out, "loader 1: end of epoch").startswith("6 sample(s) repeated")
    assert value(out, "effective global batch").startswith("16 = 4 per process x 2 process(es) x 2 accumulation")
    assert "--gradient-accumulation-steps 2" in value(out, "gradient accumulation")
    assert not (tmp_path / "trained.marker").exists()


def test_cli_explain_reports_settings_set_twice_or_ignored(tmp_path):
    proc = explain("--nproc-per-node", 2, "--mixed-precision", "bf16", WORKERS / "explain_script.py",
                   "--out", tmp_path, "--mixed-precision", "fp16", "--rng-types", "--devices", 3)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert value(out, "precision").startswith("16-mixed")
    conflict = value(out, "mixed_precision")
    assert "Accelerator(mixed_precision='fp16') wins over --mixed-precision bf16" in conflict
    assert "accepted for compatibility and ignored" in value(out, "rng_types")
    assert "devices=3 disagrees with the launcher" in value(out, "devices")
    assert not (tmp_path / "trained.marker").exists()


def test_cli_explain_trainer_script(tmp_path):
    proc = explain("--gradient-accumulation-steps", 2, WORKERS / "explain_trainer.py", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # Trainer(devices=2) would start itself again on 2 processes; the dry run does not
    assert value(out, "world size") == "2"
    assert "started by Trainer(devices=2)" in value(out, "ranks from")
    assert value(out, "train: batches per process") == "3 per epoch (rank 0 of 2)"
    assert value(out, "effective global batch").startswith("30 = 5 per process x 2 process(es) x 3 accumulation")
    assert "--gradient-accumulation-steps 2 is ignored" in value(out, "gradient_accumulation_steps")
    assert "is ignored: there is no val loader" in value(out, "limit_val_batches")
    assert value(out, "checkpoints") == f"{tmp_path / 'root'}/checkpoints"
    assert not (tmp_path / "trained.marker").exists()
    assert not (tmp_path / "root").exists()


def test_cli_explain_script_without_prepare(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no accelerator here')\n")
    proc = explain(script)
    assert proc.returncode == 1
    assert "nothing to explain" in proc.stderr


def test_the_doors_record_the_arguments_given_under_a_planned_launch(monkeypatch, tmp_path):
    """`fabric-lite explain` hands the planned launch down; the doors keep what the caller passed, as passed
    (a default given explicitly too, and before fast_dev_run rewrites limits), and nothing otherwise."""
    from fabric_lite import Trainer

    plain = Trainer(accelerator="cpu", default_root_dir=str(tmp_path))
    assert plain.explain_arguments is None and plain.accelerator.explain_arguments is None
    monkeypatch.setenv("FABRIC_LITE_EXPLAIN", json.dumps({"nproc_per_node": 2, "nnodes": 1}))
    trainer = Trainer(accelerator="cpu", num_sanity_val_steps=2, fast_dev_run=True, devices=2,
                      default_root_dir=str(tmp_path))
    assert trainer.explain_arguments == {"accelerator": "cpu", "num_sanity_val_steps": 2, "fast_dev_run": True,
                                         "devices": 2, "default_root_dir": str(tmp_path)}
    acc = Accelerator(cpu=True, gradient_accumulation_steps=1, devices=2)  # devices=2 is for the planned launch
    assert acc.explain_arguments == {"cpu": True, "gradient_accumulation_steps": 1, "devices": 2}
    assert acc.num_processes == 1
