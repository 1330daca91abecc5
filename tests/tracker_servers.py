"""Real tracking backends for the tracker and logger tests, and readers for what they recorded.

- `start_mlflow_server`: an `mlflow server` on 127.0.0.1 (a free port) with a SQLite store in a temporary folder,
  waited for until it answers /health, and stopped (its whole process group) afterwards.
- `wandb_offline`: the environment for wandb in offline mode with every folder it writes (runs, cache, config,
  data, and HOME itself) in a temporary folder, so that nothing goes to the network or to the user's home.
- `read_wandb_run`: the records of an offline run's `.wandb` file, decoded with wandb's own protobuf messages.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

from conftest import free_port

MLFLOW_START_TIMEOUT = 90  # seconds; it takes ~7 s on an idle 2-core machine


@contextlib.contextmanager
def start_mlflow_server(root: Path) -> Iterator[str]:
    """Run `mlflow server` with its store under `root`; yields its URL (http://127.0.0.1:PORT)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job workers: only the web server
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer in {MLFLOW_START_TIMEOUT} s:\n"
                                   f"{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # the server and the uvicorn worker it started
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wandb_offline(monkeypatch, root: Path) -> Path:
    """Set the environment for offline wandb runs that keep every file under `root`; returns the HOME used."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    values = {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB__DISABLE_STATS": "true",
        "WANDB_DIR": str(root / "wandb_dir"), "WANDB_CACHE_DIR": str(root / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(root / "wandb_config"), "WANDB_DATA_DIR": str(root / "wandb_data"),
        "WANDB_ARTIFACT_DIR": str(root / "wandb_artifacts"), "HOME": str(home),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    return home


def stop_wandb() -> None:
    """End wandb's background service, so that the next test's runs start one with that test's environment."""
    if "wandb" in sys.modules:
        import wandb

        wandb.teardown()


def files_under(path: Path) -> List[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


# -- reading an offline run ----------------------------------------------------------------------------
# A .wandb file is a 7-byte header (b":W&B", magic 0xBEE1, version) then records in 32 KiB blocks, each record
# (or piece of one, when it crosses a block) behind a 7-byte header: CRC-32C, length, type (1 whole, 2 first,
# 3 middle, 4 last). A record is a serialized wandb.proto.wandb_internal_pb2.Record.

_BLOCK = 32 * 1024
_HEADER = 7


def wandb_run_dir(wandb_root: Path, run_id: str) -> Path:
    found = glob.glob(str(wandb_root / "wandb" / f"offline-run-*-{run_id}"))
    assert len(found) == 1, (wandb_root, run_id, found)
    return Path(found[0])


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, hex(magic))
    pos, pieces = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zeros: padding to the end of the block
            pos += left
            continue
        pieces += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb_run(run_dir: Path) -> Dict[str, Any]:
    """{"run_id", "project", "name", "config": {...}, "history": [{...}, ...], "summary": {...}, "exit_code"}."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    out: Dict[str, Any] = {"config": {}, "history": [], "summary": {}, "exit_code": None}
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(run_id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            for item in record.run.config.update:
                out["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                out["summary"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    out["config"].pop("_wandb", None)
    return out
