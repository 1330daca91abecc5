import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_dotted(path: str):
    """The object at a dotted path: the longest importable module prefix, then attributes (the name tables' rows)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)
WORKERS = Path(__file__).resolve().parent / "workers"

# tests/ mirrors the package, one folder per layer; some test modules share helpers across folders
# (`from test_resume import Run`), so every folder is importable whichever module pytest collects first.
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "workers"
                      and not p.name.startswith((".", "_"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


# What a launcher sets; a unit test runs as a lone process whatever the shell around pytest exports.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FABRIC_LITE_MIXED_PRECISION",
              "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "FABRIC_LITE_USE_CPU", "FABRIC_LITE_STRATEGY", "FABRIC_LITE_LAUNCHED", "TORCHELASTIC_RESTART_COUNT",
              "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK",
              "RAY_JOB_ID", "RAY_RAYLET_PID")


@pytest.fixture(autouse=True)
def _cpu_unless_a_cuda_test(request, monkeypatch):
    """Every test trains on the CPU, as in CI, also on a machine with a GPU ("auto" would pick it);
    tests/test_cuda.py (the `cuda` marker) is where the GPU paths are tested."""
    if request.node.get_closest_marker("cuda") is None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(autouse=True)
def _lone_process(monkeypatch, tmp_path_factory):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    # a developer's own `fabric-lite config` file must not change what launches in tests do
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(tmp_path_factory.getbasetemp() / "no_config"))
    # nor an Accelerate config file, which `fabric-lite launch` reads where no fabric_lite one exists
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "no_hf_home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(cmd, timeout=180, env=None, cwd=None, gpus=False):
    """Run a command with a hard timeout; a hang fails the test instead of blocking CI.

    The child sees no GPU unless `gpus`: the multi-process tests are about gloo on CPUs, and on a
    machine with one GPU their processes would otherwise pick it (and NCCL, one GPU per process)."""
    full_env = dict(os.environ)
    full_env.pop("WORLD_SIZE", None)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if not gpus:
        full_env["CUDA_VISIBLE_DEVICES"] = ""
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


# -- a real S3-compatible server (moto) on 127.0.0.1, reached through s3fs -------------------------

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of a moto S3 server running in this process for the whole session (skips without moto/s3fs)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import logging

    access_log = logging.getLogger("werkzeug")   # one INFO line per request: noise in failure reports
    level = access_log.level
    access_log.setLevel(logging.WARNING)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        access_log.setLevel(level)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch, tmp_path):
    """Point every S3 client created in this test (boto, s3fs, fabric_lite's URLs) at the moto server."""
    import s3fs

    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    missing = tmp_path / "no-aws-config"   # never read the developer's own ~/.aws files
    monkeypatch.setenv("AWS_CONFIG_FILE", str(missing))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(missing))
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_endpoint
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh, empty bucket on the session's moto server, as a URL: ``s3://fl-test-<hex>``."""
    import uuid

    import s3fs

    name = f"fl-test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(name)
    yield f"s3://{name}"
    try:
        fs.rm(name, recursive=True)   # moto keeps everything in memory
    except Exception:  # cleanup only; a test that broke the bucket has already failed
        pass


# -- tracker servers (tests/tracker_servers.py): one MLflow server for the session, wandb offline per test --

@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow")
    from tracker_servers import start_mlflow_server

    with start_mlflow_server(tmp_path_factory.mktemp("mlflow_server")) as url:
        yield url


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    from tracker_servers import files_under, stop_wandb, wandb_offline

    home = wandb_offline(monkeypatch, tmp_path / "wandb_env")
    yield home
    stop_wandb()
    assert files_under(home) == []  # nothing went to the home folder
