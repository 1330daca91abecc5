"""Checkpoints, weights and logs on a real S3-compatible server (moto on 127.0.0.1), through s3fs.

Nothing here mocks the fsspec API: every byte goes over HTTP to the server that the `s3_bucket`
fixture (tests/conftest.py) starts once per session, and the library is given plain ``s3://`` URLs,
as a user would. The load-side tests upload a checkpoint written on the local disk, so that they
check reading from S3 even while writing there is broken.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch import nn

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

from fabric_lite import Accelerator, Trainer, set_seed  # noqa: E402
from fabric_lite.callbacks import CSVLogger, TensorBoardLogger  # noqa: E402
from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter  # noqa: E402

from test_trainer import Dropout, Recorder, _resume_run, loader, regression_data, weights  # noqa: E402



# -- helpers ---------------------------------------------------------------------------------------

def _fs():
    return s3fs.S3FileSystem()   # endpoint and keys from the environment the fixture set


def _keys(url):
    """The object keys under `url`, relative to it, sorted."""
    fs = _fs()
    fs.invalidate_cache()
    root = url.split("://", 1)[1].rstrip("/")
    return sorted(k[len(root) + 1:] for k in fs.find(root))


def _all_keys(bucket):
    fs = _fs()
    fs.invalidate_cache()
    return sorted(fs.find(bucket.split("://", 1)[1]))


def _trained_accelerator(seed=0, steps=3):
    """A prepared model/optimizer/scheduler with a few steps taken (non-trivial optimizer state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return acc, model, opt, sched


def _fresh_accelerator(seed=1):
    return _trained_accelerator(seed=seed, steps=0)


def _assert_same_state(a, b):
    (acc_a, model_a, opt_a, sched_a), (acc_b, model_b, opt_b, sched_b) = a, b
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][i][k])), (i, k)
    assert sched_a.state_dict() == sched_b.state_dict()
    assert acc_a.step == acc_b.step


def _save_locally_and_upload(tmp_path, url, seed=0):
    """Write a checkpoint with save_state on the local disk and copy its files to `url` on S3."""
    trained = _trained_accelerator(seed)
    local = tmp_path / "local_ckpt"
    trained[0].save_state(str(local))
    fs = _fs()
    for f in sorted(local.iterdir()):
        fs.put_file(str(f), f"{url.split('://', 1)[1]}/{f.name}")
    fs.invalidate_cache()
    return trained


def _flip_bytes(url):
    fs = _fs()
    path = url.split("://", 1)[1]
    data = bytearray(fs.cat_file(path))
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()


# -- the server itself -----------------------------------------------------------------------------

def test_bucket_fixture_gives_an_empty_bucket_on_the_local_server(s3_bucket, s3_env):
    assert s3_bucket.startswith("s3://fl-test-") and s3_env.startswith("http://127.0.0.1:")
    assert _all_keys(s3_bucket) == []
    _fs().pipe_file(f"{s3_bucket[5:]}/a/b.txt", b"hello")
    assert _fs().cat_file(f"{s3_bucket[5:]}/a/b.txt") == b"hello"


# -- CheckpointWriter, the two steps that differ on S3 ---------------------------------------------

def test_clean_up_before_the_first_save_under_a_new_prefix(s3_bucket):
    # an object store has no empty directories: the parent prefix does not exist yet
    writer = CheckpointWriter(f"{s3_bucket}/run/ckpt")
    writer.clean_up_interrupted()   # nothing to clean: must not fail


def test_commit_publishes_the_staged_files_and_removes_the_staging_prefix(s3_bucket):
    writer = CheckpointWriter(f"{s3_bucket}/ckpt")
    writer.clean_up_interrupted()
    writer.write("a.pt", {"x": torch.arange(3)})
    writer.commit(dict(writer.checksums))
    assert _keys(s3_bucket) == ["ckpt/a.pt", "ckpt/manifest.json"]


# -- Accelerator.save_state / load_state -----------------------------------------------------------

def test_save_state_then_load_state_round_trip_on_s3(s3_bucket):
    url = f"{s3_bucket}/run/ckpt"
    trained = _trained_accelerator()
    assert trained[0].save_state(url) == url
    files = _keys(url)
    assert "manifest.json" in files and "model_0.pt" in files and "training_state.pt" in files
    manifest = json.loads(_fs().cat_file(f"{url[5:]}/manifest.json"))
    assert sorted(manifest["files"]) == sorted(f for f in files if f != "manifest.json")
    assert _all_keys(s3_bucket) == [f"{s3_bucket[5:]}/run/ckpt/{f}" for f in files]   # nothing else
    fresh = _fresh_accelerator()
    fresh[0].load_state(url)
    _assert_same_state(trained, fresh)


def test_overwriting_a_checkpoint_in_place_on_s3_leaves_no_staging_keys(s3_bucket):
    url = f"{s3_bucket}/run/ckpt"
    _trained_accelerator()[0].save_state(url)
    second = _trained_accelerator(seed=5, steps=4)
    second[0].save_state(url)
    keys = _all_keys(s3_bucket)
    assert not [k for k in keys if ".staging-" in k or ".old-" in k or ".tmp-" in k], keys
    fresh = _fresh_accelerator()
    fresh[0].load_state(url)
    _assert_same_state(second, fresh)


def test_load_state_from_s3_restores_everything_exactly(s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/ckpt"
    trained = _save_locally_and_upload(tmp_path, url)
    assert "manifest.json" in _keys(url) and "model_0.pt" in _keys(url)
    fresh = _fresh_accelerator()
    assert fresh[0].load_state(url) == url
    _assert_same_state(trained, fresh)


@pytest.mark.parametrize("name", ["model_0.pt", "training_state.pt"])
def test_a_corrupt_object_is_refused_naming_the_file(s3_bucket, tmp_path, name):
    url = f"{s3_bucket}/run/ckpt"
    _save_locally_and_upload(tmp_path, url)
    _flip_bytes(f"{url}/{name}")
    fresh = _fresh_accelerator()
    before = [p.detach().clone() for p in fresh[1].parameters()]
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as err:
        fresh[0].load_state(url)
    assert "checksum" in str(err.value)
    if name == "training_state.pt":   # read first: nothing was restored
        assert all(torch.equal(a, b) for a, b in zip(before, fresh[1].parameters()))


def test_a_checkpoint_whose_manifest_was_deleted_is_refused(s3_bucket, tmp_path):
    url = f"{s3_bucket}/run/ckpt"
    _save_locally_and_upload(tmp_path, url)
    _fs().rm_file(f"{url[5:]}/manifest.json")
    _fs().invalidate_cache()
    assert "manifest.json" not in _keys(url) and "model_0.pt" in _keys(url)
    with pytest.raises(CheckpointError, match="manifest.json"):
        _fresh_accelerator()[0].load_state(url)


def test_a_missing_checkpoint_is_refused(s3_bucket):
    with pytest.raises(CheckpointError, match="No checkpoint"):
        _fresh_accelerator()[0].load_state(f"{s3_bucket}/run/nothing-here")


# -- Accelerator.save_model ------------------------------------------------------------------------

def test_save_model_writes_safetensors_readable_back(s3_bucket):
    from safetensors.torch import load as st_load

    acc, model, _, _ = _trained_accelerator()
    url = f"{s3_bucket}/export/model"
    acc.save_model(model, url, safe_serialization=True)
    assert _keys(url) == ["model.safetensors"]
    loaded = st_load(_fs().cat_file(f"{url[5:]}/model.safetensors"))
    expected = acc.unwrap_model(model).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


# -- Trainer ---------------------------------------------------------------------------------------

def test_trainer_writes_checkpoints_to_s3_and_resumes_bit_for_bit(s3_bucket, tmp_path):
    root = f"{s3_bucket}/run"
    first, _ = _resume_run(root, 2, save_last=True)
    assert first.global_step == 16
    rec = Recorder()
    resumed, resumed_module = _resume_run(root, 4, ckpt_path="last", rec=rec, save_last=True)
    names = {k.split("/", 1)[0] for k in _keys(f"{root}/checkpoints")}
    assert {"epoch=3-step=32", "last"} <= names and "epoch=1-step=16" not in names
    assert rec.epoch_starts == [2, 3]
    assert rec.train_batches[0] == (2, 0, 17)
    _, straight_module = _resume_run(tmp_path / "straight", 4)
    assert resumed.global_step == 32 and resumed.current_epoch == 4
    assert torch.equal(weights(resumed_module), weights(straight_module))


@pytest.mark.parametrize("save_last", [True, None], ids=["last-dir", "newest-checkpoint"])
def test_trainer_resumes_from_checkpoints_uploaded_to_s3_bit_for_bit(s3_bucket, tmp_path, save_last):
    # The read side of the test above: checkpoints written locally, then copied to S3; the resumed run
    # writes none (enable_checkpointing=False), so only `ckpt_path="last"` discovery and loading go to S3.
    _resume_run(tmp_path / "a", 2, save_last=save_last)
    fs = _fs()
    root = f"{s3_bucket}/run"
    local = tmp_path / "a" / "checkpoints"
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(f), f"{root[5:]}/checkpoints/{f.relative_to(local).as_posix()}")
    fs.invalidate_cache()
    assert "epoch=1-step=16/manifest.json" in _keys(f"{root}/checkpoints")
    assert ("last/manifest.json" in _keys(f"{root}/checkpoints")) == bool(save_last)
    set_seed(0)
    module, rec = Dropout(), Recorder()
    trainer = Trainer(default_root_dir=root, max_epochs=4, enable_progress_bar=False, enable_checkpointing=False,
                      callbacks=[rec])
    trainer.fit(module, loader(regression_data(n=30), batch_size=4, shuffle=True, seed=3),
                loader(regression_data(n=12, seed=5)), ckpt_path="last")
    assert rec.epoch_starts == [2, 3]
    assert rec.train_batches[0] == (2, 0, 17)
    _, straight_module = _resume_run(tmp_path / "straight", 4)
    assert trainer.global_step == 32 and trainer.current_epoch == 4
    assert torch.equal(weights(module), weights(straight_module))


# -- loggers ---------------------------------------------------------------------------------------

def _fit_with(logger, tmp_path):
    set_seed(0)
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=2, enable_progress_bar=False,
                      enable_checkpointing=False, log_every_n_steps=2, callbacks=[logger])
    trainer.fit(Dropout(), loader(regression_data(n=16), batch_size=4), loader(regression_data(n=8, seed=5)))
    return trainer


def test_csv_logger_writes_metrics_to_s3(s3_bucket, tmp_path):
    save_dir = f"{s3_bucket}/logs"
    _fit_with(CSVLogger(save_dir=save_dir, name="csv"), tmp_path)
    assert _keys(save_dir) == ["csv/version_0/metrics.csv"]
    text = _fs().cat_file(f"{save_dir[5:]}/csv/version_0/metrics.csv").decode()
    header, *rows = text.strip().splitlines()
    assert header.split(",")[0] == "step" and "train/loss" in header and len(rows) >= 2
    _fit_with(CSVLogger(save_dir=save_dir, name="csv"), tmp_path)   # the next free version, found on S3
    assert _keys(save_dir) == ["csv/version_0/metrics.csv", "csv/version_1/metrics.csv"]


def test_tensorboard_logger_writes_event_files_to_s3(s3_bucket, tmp_path):
    pytest.importorskip("tensorboard")
    save_dir = f"{s3_bucket}/logs"
    _fit_with(TensorBoardLogger(save_dir=save_dir, name="tb"), tmp_path)
    keys = [k for k in _keys(save_dir) if not k.endswith("/")]   # tensorboard also writes a "directory" marker
    assert keys and all(k.startswith("tb/version_0/events.out.tfevents.") for k in keys), keys
    assert sum(_fs().size(f"{save_dir[5:]}/{k}") for k in keys) > 100


# -- storage that cannot be reached ----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_save_state_to_an_unreachable_endpoint_fails_quickly_and_writes_nothing(s3_bucket, s3_env, monkeypatch,
                                                                                  tmp_path):
    import fsspec.config

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")   # nothing listens on port 1
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")                    # botocore: no retries of its own
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)           # s3fs: no retries of its own
    # fsspec's per-protocol defaults for every S3FileSystem the library creates from a URL
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {
        "connect_timeout": 2, "read_timeout": 2, "retries": {"total_max_attempts": 1}}})
    s3fs.S3FileSystem.clear_instance_cache()
    acc = _trained_accelerator()[0]
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        acc.save_state(f"{s3_bucket}/run/ckpt")
    elapsed = time.monotonic() - start
    message = f"{type(err.value).__module__}.{type(err.value).__name__}: {err.value}"
    (tmp_path / "error.txt").write_text(message)
    print(f"\nunreachable endpoint: raised after {elapsed:.2f}s: {message}")
    assert elapsed < 30
    assert "127.0.0.1:1" in message
    # back on the real server: nothing was written
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env)
    monkeypatch.delitem(fsspec.config.conf, "s3")
    s3fs.S3FileSystem.clear_instance_cache()
    assert _all_keys(s3_bucket) == []


# -- an object store that fails mid-upload: the previous checkpoint, `latest`, and no staging stay ------

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


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_a_failed_upload_leaves_the_previous_checkpoint_and_latest(faulty_s3, background):
    from fabric_lite import ProjectConfiguration

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
