"""Real SLURM launches: a one-host cluster (munged, slurmctld, slurmd) started by this module.

`srun` starts the worker twice with no launcher; fabric_lite reads the ranks from the step's SLURM
variables. Inside an `sbatch` script (one process, not a step) the same worker is a lone process
even though the job asked for two tasks. Skipped unless run as root with SLURM and MUNGE installed
(apt-get install slurmctld slurmd slurm-client munge).
"""

import json
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import WORKERS, free_port, run_command

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "scontrol")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _clean_env(**extra):
    """This process's environment without any SLURM_* variable (pytest itself may run inside a job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the tasks train with gloo on CPUs, also on a machine with a GPU
    env.update(extra)
    return env


def _stop(procs):
    for proc in reversed(procs):   # slurmd, then slurmctld, then munged
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _start(procs, cmd, log: Path, env, **kwargs):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                **kwargs)
    procs.append(proc)
    return proc


@pytest.fixture(scope="module")
def slurm_cluster():
    """Start munged + slurmctld + slurmd on this host with a config in a temp dir; yield the client env."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM/MUNGE not installed ({', '.join(missing)} not on PATH): "
                    "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("starting a SLURM cluster (slurmd runs jobs as any user) needs root")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        pytest.skip("no 'munge' user to run munged as (installed by the munge package)")

    # Not under pytest's tmp dir: /tmp/pytest-of-root is 0700 and munged (user munge) needs every
    # directory on the way to its socket to be searchable by all.
    root = Path(tempfile.mkdtemp(prefix="fl-slurm-"))
    root.chmod(0o755)
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    for path in (munge_dir, key):
        shutil.chown(path, "munge", "munge")
    munge_socket = munge_dir / "munge.socket.2"

    host = socket.gethostname().split(".")[0]
    node_line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=fltest",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        # free ports, so a system SLURM (6817/6818) or a second test session does not collide
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        # fabric_lite derives the rendezvous port from the job id (15000 + id % 20000): a random
        # first id keeps two sessions on one host from sharing a port
        f"FirstJobId={random.randint(1, 19000)}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        f"{node_line} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ]))
    env = _clean_env(SLURM_CONF=str(conf))
    procs = []
    logs = {"munged": munge_dir / "munged.log", "slurmctld": root / "slurmctld.out", "slurmd": root / "slurmd.out"}

    def diagnostics():
        return "\n".join(f"--- {name} ---\n{_tail(log)}" for name, log in logs.items()) + \
            f"\n--- slurmctld.log ---\n{_tail(root / 'slurmctld.log')}\n--- slurmd.log ---\n{_tail(root / 'slurmd.log')}"

    try:
        _start(procs, ["munged", "--foreground", f"--socket={munge_socket}", f"--key-file={key}",
                       f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={logs['munged']}",
                       f"--seed-file={munge_dir / 'munged.seed'}"],
               munge_dir / "munged.out", env, user="munge", group="munge", cwd=munge_dir)
        deadline = time.monotonic() + 15
        while not munge_socket.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start\n{_tail(munge_dir / 'munged.out')}\n{diagnostics()}")
            time.sleep(0.1)
        _start(procs, ["slurmctld", "-D", "-f", str(conf)], logs["slurmctld"], env, cwd=root)
        _start(procs, ["slurmd", "-D", "-f", str(conf)], logs["slurmd"], env, cwd=root)

        deadline = time.monotonic() + 30
        state = ""
        while True:
            for name, proc in zip(DAEMONS, procs):
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited with {proc.returncode} while the cluster started\n{diagnostics()}")
            query = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env,
                                   timeout=20)
            state = query.stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the SLURM node is not idle after 30 s (sinfo: {state!r} {query.stderr.strip()!r})\n"
                            f"{diagnostics()}")
            time.sleep(0.5)
        yield {"env": {"SLURM_CONF": str(conf)}, "host": host, "root": root}
    finally:
        _stop(procs)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    # run_command starts from os.environ: no variable of an enclosing job may reach srun/sbatch
    for name in list(os.environ):
        if name.startswith("SLURM"):
            monkeypatch.delenv(name)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return dict(slurm_cluster["env"])


def test_srun_two_tasks_without_a_launcher(slurm_cluster, slurm_env, tmp_path):
    env = dict(slurm_env)
    try:
        socket.gethostbyname(slurm_cluster["host"])
    except OSError:
        # fabric_lite takes the rendezvous host from SLURM_STEP_NODELIST; this host's own name does
        # not resolve here, so point the ranks at loopback instead (the one case we override it)
        env["MASTER_ADDR"] = "127.0.0.1"
    # --overcommit: two tasks even on a one-CPU node (slurmd -C describes the real machine)
    proc = run_command(["srun", "-N1", "-n2", "--overcommit", sys.executable, str(WORKERS / "cluster_gather.py"),
                        "--out", str(tmp_path)], timeout=120, env=env)
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["world"] == 2 and res["local_rank"] == rank
        assert res["gathered"] == [0, 1]
        assert res["source"] == "SLURM (srun)"


def test_sbatch_script_is_a_lone_process(slurm_cluster, slurm_env, tmp_path):
    """The batch script of a two-task job is one process: SLURM_PROCID/SLURM_NTASKS are set there, but
    no step variable, so a plain `python train.py` must not wait for a second rank."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f"env | grep ^SLURM > {tmp_path / 'batch_env.txt'}\n"
                      f"exec {sys.executable} {WORKERS / 'cluster_gather.py'} --out {out}\n")
    proc = run_command(["sbatch", "--parsable", "-N1", "-n2", "--overcommit", "-o", str(tmp_path / "job.log"),
                        str(script)], timeout=60, env=slurm_env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    job_id = proc.stdout.strip().split(";")[0]
    # poll the job ourselves: `sbatch --wait` checks only every few seconds
    deadline = time.monotonic() + 120
    state = ""
    while time.monotonic() < deadline:
        show = run_command(["scontrol", "-o", "show", "job", job_id], timeout=30, env=slurm_env)
        state = next((f.split("=", 1)[1] for f in show.stdout.split() if f.startswith("JobState=")), "")
        if state not in ("", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.2)
    assert state == "COMPLETED", f"batch job {job_id}: {state or 'no state'}\n{_tail(tmp_path / 'job.log')}"
    batch_env = dict(line.split("=", 1) for line in (tmp_path / "batch_env.txt").read_text().splitlines()
                     if "=" in line)
    assert batch_env.get("SLURM_PROCID") == "0" and batch_env.get("SLURM_NTASKS") == "2"
    assert "SLURM_STEP_NUM_TASKS" not in batch_env
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json"]
    res = json.loads((out / "rank0.json").read_text())
    assert res["rank"] == 0 and res["world"] == 1 and res["gathered"] == [0]
    assert res["source"] == "lone process"
