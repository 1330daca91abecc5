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


def _on_a_small_disk(tmp_path, size, worker, args):
    """Run `worker` with a tmpfs of `size` mounted at --dir (in a user and mount namespace of its own); its report."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("mounting a small tmpfs needs `unshare -rm` (unprivileged user namespaces), not allowed here")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    script = (f"mount -t tmpfs -o size={size} tmpfs {mount} && exec {sys.executable} {WORKERS / worker} "
              f"--out {out} --dir {mount} {' '.join(args)}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=WORKERS, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_a_full_disk_leaves_the_previous_checkpoint_and_no_staging(tmp_path, background):
    # 1600 KiB: one ~1 MB checkpoint fits, a second copy of it beside the first does not
    r = _on_a_small_disk(tmp_path, "1600k", "full_disk.py", ["--background"] if background else [])
    assert r["error"].startswith("CheckpointError: save_state(") and \
        "OSError: [Errno 28] No space left on device (writing model_0.pt of " in r["error"], r["error"]
    assert "The previous checkpoint there, if any, is intact" in r["error"]
    assert r["listing"] == ["ckpt", "latest"]          # no staging directory left
    assert r["free_after"] == r["free_before"]          # every byte of the failed save given back
    assert r["first_loads"] and r["latest"] == "ckpt"
    assert r["small_saved"]                             # and the next save that fits is written


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_a_disk_that_fills_at_every_point_of_a_save(tmp_path, background):
    """Free space is cut a page at a time below what a save needs, so the disk fills while each file, the
    manifest and then `latest` are written. Every failure says what it was writing and whether the checkpoint
    was published; nothing half-written stays; `latest` always names a whole checkpoint; the run resumes
    from the newest whole one."""
    r = _on_a_small_disk(tmp_path, "1m", "full_disk_sweep.py", ["--pages", "20"] + (["--background"] if background else []))
    attempts = r["attempts"]
    assert attempts[-1]["error"] is None, attempts[-1]   # with room enough the save goes through
    seen = set()
    for a in attempts:
        names = [n for n in a["listing"] if n != "latest"]
        assert all(n.startswith("checkpoint_") and "." not in n for n in names), a  # no staging, no latest.tmp-*
        assert a["latest_whole"], a
        if a["error"] is None:
            continue
        error = a["error"]
        assert error.startswith("CheckpointError: save_state(") and "[Errno 28] No space left on device (writing " in error
        if "published the checkpoint, which is whole" in error:
            seen.add("latest")
            assert "updating `latest` failed" in error and "(writing " in error and error.count("/latest)") == 1
            assert a["newest"] != a["latest"]             # the new one is whole and found as the newest
        else:
            assert "wrote nothing" in error and "The previous checkpoint there, if any, is intact." in error, error
            assert a["newest"] == a["latest"] == "checkpoint_0", a
            seen.add("manifest" if "(writing manifest.json of " in error else "file")
    assert seen == {"file", "manifest", "latest"}, [a["error"] for a in attempts]  # every point was reached
    assert r["loaded"] == attempts[-1]["newest"]
