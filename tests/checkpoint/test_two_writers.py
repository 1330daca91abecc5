"""Two runs that save into one directory at the same time (a script started twice, two jobs given the same
output directory): every save of both succeeds and what is left is whole, because publishing takes a lock
on the directory and a live writer's staging directory is never taken for an interrupted save's leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import WORKERS
from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint import locks


@pytest.mark.parametrize("mode,background", [("explicit", False), ("auto", False), ("explicit", True)],
                         ids=["same-name", "automatic-naming-and-pruning", "same-name-background"])
def test_two_runs_saving_into_one_directory(tmp_path, mode, background):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "shared"
    command = [sys.executable, str(WORKERS / "two_writers.py"), "--out", str(out), "--dir", str(target),
               "--mode", mode] + (["--background"] if background else [])
    runs = [subprocess.Popen(command + ["--rank", str(rank)], cwd=WORKERS, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    for run in runs:
        output, _ = run.communicate(timeout=240)
        assert run.returncode == 0, output[-3000:]
    for rank in range(2):
        errors = json.loads((out / f"rank{rank}.json").read_text())["errors"]
        assert errors == [], errors[:3]
    if mode == "auto":
        root = target / "checkpoints"
        names = sorted(os.listdir(root))
        assert names[-1] == "latest" and len(names) == 4 and all(n.startswith("checkpoint_") for n in names[:3])
        with open(root / "latest") as f:
            checkpoint_io.verify(str(root / json.load(f)["name"]))
    else:
        assert sorted(os.listdir(target)) == ["ckpt"]  # no staging or .old- directories left behind
        checkpoint_io.verify(str(target / "ckpt"))


def _sleep(seconds):
    import time

    time.sleep(seconds)


def test_a_forked_child_does_not_keep_a_lock(tmp_path):
    """A flock belongs to the open file, which fork shares: a DataLoader worker forked while a background save
    publishes must not keep the directory locked after the save lets go (the next publish would wait for ever)."""
    import multiprocessing
    import threading

    fs, path = checkpoint_io.filesystem(str(tmp_path))
    with locks.publishing(fs, path):
        child = multiprocessing.get_context("fork").Process(target=_sleep, args=(30,))
        child.start()
    try:
        acquired = threading.Event()

        def publish_again():
            with locks.publishing(fs, path):
                acquired.set()

        threading.Thread(target=publish_again, daemon=True).start()
        assert acquired.wait(10), "the forked child kept the lock"
        writer = checkpoint_io.CheckpointWriter(str(tmp_path / "ckpt"))  # and a whole save goes through
        writer.write("x.pt", {"a": 1})
        writer.clean_up_interrupted()
        writer.commit(writer.checksums)
        checkpoint_io.verify(str(tmp_path / "ckpt"))
    finally:
        child.kill()
        child.join()
