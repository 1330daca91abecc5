import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


# What a launcher sets; a unit test runs as a lone process whatever the shell around pytest exports.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FABRIC_LITE_MIXED_PRECISION",
              "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "FABRIC_LITE_USE_CPU")


@pytest.fixture(autouse=True)
def _lone_process(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(cmd, timeout=180, env=None, cwd=None):
    """Run a command with a hard timeout; a hang fails the test instead of blocking CI."""
    full_env = dict(os.environ)
    full_env.pop("WORLD_SIZE", None)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout}s (a hang?)\n{err.stdout}\n{err.stderr}")
    return proc


def torchrun(script, nproc, *args, out_dir, timeout=180, env=None, launcher="torchrun", launcher_args=()):
    """Start `script` on `nproc` processes; return each rank's JSON result from out_dir/rank{r}.json."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
    else:
        cmd = [sys.executable, "-m", "fabric_lite.cli", "launch"]
    cmd += ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            *launcher_args, str(script), "--out", str(out_dir), *map(str, args)]
    proc = run_command(cmd, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"launch failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-8000:]}")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture
def launch(tmp_path):
    def _launch(name, nproc, *args, **kwargs):
        out = tmp_path / f"out_{name}_{nproc}"
        out.mkdir(exist_ok=True)
        return torchrun(WORKERS / f"{name}.py", nproc, *args, out_dir=out, **kwargs)

    return _launch
