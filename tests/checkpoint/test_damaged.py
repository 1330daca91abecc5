"""A damaged checkpoint is a CheckpointError when named, and skipped with a warning when the newest is
looked for: whatever is wrong with its manifest or files, never another exception type."""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.accelerator.configs import ProjectConfiguration
from fabric_lite.checkpoint.files import CheckpointError, newest_whole_checkpoint


def _run(project):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project),
                                                                    automatic_checkpoint_naming=True))
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A project with checkpoint_0 and checkpoint_1 (the newest), and checkpoint_1's weights."""
    project = tmp_path_factory.mktemp("project")
    acc, model, opt = _run(project)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        acc.save_state()
    return project, {k: v.clone() for k, v in model.state_dict().items()}


def _copy(two_checkpoints, tmp_path):
    project = tmp_path / "project"
    shutil.copytree(two_checkpoints[0], project)
    return project, project / "checkpoints" / "checkpoint_1"


def _good_manifest(two_checkpoints):
    with open(two_checkpoints[0] / "checkpoints" / "checkpoint_1" / "manifest.json") as f:
        return json.load(f)


def _cases(good):
    meta = good["meta"]
    return {
        "empty": "", "truncated": json.dumps(good)[:40], "not json": "hello", "binary": b"\xff\xfe\x00\x81",
        "a list": "[1, 2]", "null": "null", "meta a string": {**good, "meta": "x"}, "meta missing": {**good, "meta": None},
        "files a list": {**good, "files": ["model_0.pt"]}, "files missing": {k: v for k, v in good.items() if k != "files"},
        "files empty": {**good, "files": {}}, "checksum a number": {**good, "files": {k: 5 for k in good["files"]}},
        "algorithm a number": {**good, "checksum": 5}, "unknown algorithm": {**good, "checksum": "md4"},
        "version a string": {**good, "format_version": "3"}, "version 99": {**good, "format_version": 99},
        "version true": {**good, "format_version": True},
        "huge step": {**good, "meta": {**meta, "step": 10 ** 400}}, "negative step": {**good, "meta": {**meta, "step": -1}},
        "step a float": {**good, "meta": {**meta, "step": 1.5}}, "world size 0": {**good, "meta": {**meta, "world_size": 0}},
        "saved_at NaN": {**good, "meta": {**meta, "saved_at": "NaN"}}, "saved_at inf": '{"meta": {"saved_at": 1e999}}',
        "engine a number": {**good, "meta": {**meta, "engine": 3}},
        "traversal": {**good, "files": {"../model_0.pt": v for v in good["files"].values()}},
        "missing file listed": {**good, "files": {**good["files"], "extra.pt": "zip:00"}},
        "wrong checksum": {**good, "files": {k: "zip:0000" for k in good["files"]}},
        "missing": None,
    }


def _write_manifest(directory, content):
    path = directory / "manifest.json"
    if content is None:
        path.unlink()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))


def _load_named(project, ckpt):
    """Load `ckpt` by name; the error, or None after a load that gave the checkpoint's weights."""
    acc, model, _ = _run(project)
    try:
        acc.load_state(ckpt)
    except CheckpointError as err:
        return err
    return None


def test_every_damaged_manifest_is_a_checkpoint_error_and_the_newest_search_falls_back(two_checkpoints, tmp_path):
    cases = _cases(_good_manifest(two_checkpoints))
    for i, (name, content) in enumerate(cases.items()):
        project, ckpt = _copy(two_checkpoints, tmp_path / str(i))
        _write_manifest(ckpt, content)
        named = _load_named(project, ckpt)
        # a listed file that nothing here reads is missing: loading by name needs only the others
        assert isinstance(named, CheckpointError) or (named is None and name == "missing file listed"), name
        acc, model, _ = _run(project)
        with pytest.warns(UserWarning, match=r"Skipping checkpoint .*checkpoint_1"):
            url = acc.load_state()
        assert url.endswith("checkpoint_0"), name


def test_random_damage_to_a_manifest_never_escapes_as_another_exception(two_checkpoints, tmp_path):
    project, ckpt = _copy(two_checkpoints, tmp_path)
    text = (ckpt / "manifest.json").read_bytes()
    rng = random.Random(1234)
    outcomes = {"refused": 0, "loaded": 0}
    for trial in range(150):
        data = bytearray(text)
        how = trial % 3
        if how == 0:  # flip a few bytes
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == 1:  # truncate
            data = data[: rng.randrange(len(data))]
        else:  # replace one value with another type
            manifest = json.loads(text)
            section = manifest if rng.random() < 0.5 else manifest["meta"]
            key = rng.choice(sorted(section))
            section[key] = rng.choice([None, -1, 2 ** 70, 1.5, "x", [], {}, True, float("inf")])
            data = json.dumps(manifest).encode()
        (ckpt / "manifest.json").write_bytes(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _load_named(project, ckpt)  # anything but a CheckpointError escapes and fails the test
        outcomes["refused" if result is not None else "loaded"] += 1
    assert outcomes["refused"] > 100, outcomes


def _state_after_loading(project, ckpt):
    """What a load of `ckpt` leaves (weights, optimizer state, torch's random state), or its CheckpointError."""
    acc, model, opt = _run(project)
    torch.manual_seed(99)
    try:
        acc.load_state(ckpt)
    except CheckpointError as err:
        return err
    return [v.clone() for v in model.state_dict().values()], repr(opt.state_dict()), torch.get_rng_state()


@pytest.mark.parametrize("file", ["model_0.pt", "training_state.pt", "rng_0.pt"])
def test_flipped_or_truncated_files_are_refused(two_checkpoints, tmp_path, file):
    clean = _state_after_loading(*_copy(two_checkpoints, tmp_path / "clean"))
    rng = random.Random(file)
    refused = 0
    for trial in range(12):
        project, ckpt = _copy(two_checkpoints, tmp_path / str(trial))
        data = bytearray((ckpt / file).read_bytes())
        if trial % 2:
            data = data[: rng.randrange(len(data))]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (ckpt / file).write_bytes(bytes(data))
        got = _state_after_loading(project, ckpt)
        if isinstance(got, CheckpointError):
            assert file in str(got), (trial, got)
            refused += 1
            acc, _, _ = _run(project)
            with pytest.warns(UserWarning, match=rf"Skipping checkpoint .*checkpoint_1.*{file}"):
                assert acc.load_state().endswith("checkpoint_0")
        else:  # only bytes nothing reads may change unnoticed (a zip record's trailing size copy): same state
            assert all(torch.equal(a, b) for a, b in zip(got[0], clean[0])) and got[1] == clean[1], trial
            assert torch.equal(got[2], clean[2]), trial
    assert refused >= 10


def test_recovery_publishes_only_a_staging_directory_that_verifies(two_checkpoints, tmp_path):
    """A crash between the two moves of a publish leaves checkpoint_1.staging-*; reading checkpoint_1
    publishes it only when its manifest parses and its files match it."""
    for i, damage in enumerate(["empty manifest", "corrupt file", "none"]):
        project, ckpt = _copy(two_checkpoints, tmp_path / str(i))
        staged = ckpt.parent / "checkpoint_1.staging-abcd1234"
        os.rename(ckpt, staged)
        if damage == "empty manifest":  # a full disk while the manifest was written
            (staged / "manifest.json").write_text("")
        elif damage == "corrupt file":
            (staged / "model_0.pt").write_bytes(b"0" * 10)
        err = _load_named(project, ckpt)
        if damage == "none":
            assert err is None and ckpt.is_dir()
        else:
            assert isinstance(err, CheckpointError) and not ckpt.exists() and staged.exists(), damage


class _Module(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_when_every_checkpoint_is_damaged_fit_starts_fresh_with_a_warning(tmp_path):
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    common = dict(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False)
    Trainer(**common).fit(_Module(), data)
    root = tmp_path / "checkpoints"
    saved = [d for d in root.iterdir() if d.is_dir()]
    assert saved
    for d in saved:
        (d / "manifest.json").write_text("{")
    for attempt in ("search", "fit"):
        with pytest.warns(UserWarning) as record:
            if attempt == "search":
                assert newest_whole_checkpoint(str(root)) is None
            else:
                trainer = Trainer(**common)
                trainer.fit(_Module(), data, ckpt_path="last")
        messages = " | ".join(str(w.message) for w in record)
        assert "Skipping checkpoint" in messages and "nothing to resume from" in messages, messages
    assert trainer.global_step == 2  # trained from the start
