"""A disk that is really full under a save (a small tmpfs, ENOSPC from the kernel): the previous checkpoint
stays whole, `latest` points at it, one clear error names the file and the cause, and no staging files are left
that a later save would trip over; blocking and background saves alike. (A failing S3 upload: test_s3.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import WORKERS

# -- a full disk ------------------------------------------------------------------------------------------


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_a_full_disk_leaves_the_previous_checkpoint_and_no_staging(tmp_path, background):
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("mounting a small tmpfs needs `unshare -rm` (unprivileged user namespaces), not allowed here")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    flags = " --background" if background else ""
    # 1600 KiB: one ~1 MB checkpoint fits, a second copy of it beside the first does not
    script = (f"mount -t tmpfs -o size=1600k tmpfs {mount} && exec {sys.executable} {WORKERS / 'full_disk.py'} "
              f"--out {out} --dir {mount}{flags}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=WORKERS, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((out / "rank0.json").read_text())
    assert r["error"].startswith("CheckpointError: save_state(") and \
        "OSError: [Errno 28] No space left on device (writing model_0.pt of " in r["error"], r["error"]
    assert "The previous checkpoint there, if any, is intact" in r["error"]
    assert r["listing"] == ["ckpt", "latest"]          # no staging directory left
    assert r["free_after"] == r["free_before"]          # every byte of the failed save given back
    assert r["first_loads"] and r["latest"] == "ckpt"
    assert r["small_saved"]                             # and the next save that fits is written
