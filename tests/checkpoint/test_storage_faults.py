"""Storage that fails under a save: a disk that is really full (a small tmpfs, ENOSPC from the kernel) and an
S3 server (moto) whose uploads fail part-way through a checkpoint (an HTTP proxy in front of it answers 500 for
one file). Each leaves the previous checkpoint whole, `latest` pointing at it, one clear error, and no
staging files that a later save would trip over; blocking and background saves alike."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch import nn

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


# -- an object store that fails mid-upload ------------------------------------------------------------------

class FaultyProxy:
    """An HTTP proxy in front of the moto server that answers 500 InternalError to every PUT of an object whose
    key contains `fail_on` (while it is set); everything else is passed through unchanged."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("://", 1)[1].split(":")
        self.fail_on = None
        self.failed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers `Expect: 100-continue`, which S3 clients send with uploads

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT" and proxy.fail_on and proxy.fail_on in self.path:
                    proxy.failed += 1
                    error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                             b"<Message>injected upload failure</Message></Error>")
                    self.send_response(500)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty_s3(s3_env, s3_bucket, monkeypatch):
    import s3fs

    proxy = FaultyProxy(s3_env)  # the moto server's URL
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # one retry: the failure is not a passing glitch
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_bucket, proxy
    proxy.close()
    s3fs.S3FileSystem.clear_instance_cache()


def _fs():
    import s3fs

    return s3fs.S3FileSystem()  # endpoint and keys from the environment the fixtures set


def _keys(url):
    fs = _fs()
    fs.invalidate_cache()
    root = url.split("://", 1)[1].rstrip("/")
    return sorted(k[len(root) + 1:] for k in fs.find(root))


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_a_failed_upload_leaves_the_previous_checkpoint_and_latest(faulty_s3, background):
    from fabric_lite import Accelerator, ProjectConfiguration
    from fabric_lite.checkpoint.files import CheckpointError

    bucket, proxy = faulty_s3
    project = f"{bucket}/run"

    def build(seed):
        torch.manual_seed(seed)
        acc = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return (acc, *acc.prepare(model, opt))

    acc, model, opt = build(0)
    acc.save_state(blocking=not background)
    acc.wait_for_checkpoint()
    good = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    proxy.fail_on = "model_0.pt"  # training_state.pt and rng_0.pt upload; model_0.pt does not
    with pytest.raises(CheckpointError, match=r"checkpoint_1\) failed and wrote nothing \(rank 0: .*model_0\.pt.*"
                                              r"previous checkpoint there, if any, is intact"):
        acc.save_state(blocking=not background)
        acc.wait_for_checkpoint()
    assert proxy.failed >= 1
    proxy.fail_on = None
    keys = _keys(project)
    assert [k for k in keys if not k.startswith("checkpoints/checkpoint_0/")] == ["checkpoints/latest"], keys
    assert json.loads(_fs().cat(f"{project}/checkpoints/latest"))["name"] == "checkpoint_0"
    acc2, model2, _ = build(1)
    acc2.load_state()  # the newest whole checkpoint: the one before the failure
    assert all(torch.equal(a, b) for a, b in zip(good, model2.parameters()))
    acc.save_state(blocking=not background)  # the store works again: so does the next save
    acc.wait_for_checkpoint()
    newest = json.loads(_fs().cat(f"{project}/checkpoints/latest"))["name"]
    assert newest != "checkpoint_0" and f"checkpoints/{newest}/manifest.json" in _keys(project)
