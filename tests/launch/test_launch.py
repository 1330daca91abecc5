"""The launcher front doors: fabric-lite launch, torchrun, notebook_launcher, and the README example."""

import re
import sys
import textwrap

import pytest

from conftest import WORKERS, free_port, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_fabric_lite_launch_passes_settings_to_the_accelerator(launch):
    # flags placed before the script reach each worker's Accelerator()
    flags = ("--mixed-precision", "bf16", "--gradient-accumulation-steps", "3", "--cpu")
    results = launch("launch_settings", 2, launcher="fabric-lite", launcher_args=flags)
    for r in results:
        assert r["mixed_precision"] == "bf16" and r["accum"] == 3 and r["world"] == 2 and r["device"] == "cpu"
        assert "strategy='single'" in r["single_error"] and "rank" in r["single_error"]
        assert "devices=3" in r["devices_error"] and "launcher" in r["devices_error"]
        assert r["other"] == ["no", 1, "bf16"]


NOTEBOOK_CELL = textwrap.dedent('''
    import torch
    from fabric_lite import Accelerator, notebook_launcher

    def training_function(scale):
        accelerator = Accelerator()
        total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]))
        return {"rank": accelerator.process_index, "world": accelerator.num_processes,
                "sum": total.item() * scale, "precision": accelerator.mixed_precision}

    results = notebook_launcher(training_function, args=(10,), num_processes=2, mixed_precision="fp16")
    print("RESULTS", results)
''')


def test_notebook_launcher_runs_a_function_defined_in_a_cell(tmp_path):
    # A notebook's functions live in an interactive namespace nothing can import: run the cell with
    # exec() in a fresh namespace, which is what a notebook kernel does.
    script = tmp_path / "kernel.py"
    script.write_text(f"exec(compile({NOTEBOOK_CELL!r}, '<cell>', 'exec'), {{'__name__': '__main__'}})\n")
    proc = run_command([sys.executable, str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS"))
    results = eval(line[len("RESULTS "):])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 30.0 and r["precision"] == "fp16" for r in results)


def test_readme_example_runs_alone_and_under_torchrun(tmp_path):
    alone = run_command([sys.executable, "examples/migration_digits.py", "--epochs", "3",
                         "--project-dir", str(tmp_path / "one")], timeout=120)
    assert alone.returncode == 0, alone.stderr[-4000:]
    accuracy = float(alone.stdout.strip().splitlines()[-1].split("valid accuracy ")[1].split()[0])
    assert accuracy > 0.85
    assert list((tmp_path / "one" / "migration_digits").glob("events.out.tfevents.*"))
    two = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                       str(free_port()), "examples/migration_digits.py", "--epochs", "2",
                       "--project-dir", str(tmp_path / "two")], timeout=180)
    assert two.returncode == 0, two.stderr[-4000:]
    assert "(297 samples)" in two.stdout  # gather_for_metrics counted the validation set exactly once


def test_launch_refuses_a_bad_flag_before_starting_anything():
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--mixed-precision", "fp17", "x.py"], timeout=60)
    assert proc.returncode == 2
    assert "Unknown precision 'fp17'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "frobnicate"], timeout=60)
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


def test_launch_refuses_more_processes_than_the_machine_has_unless_told_to_oversubscribe(tmp_path):
    import os

    from conftest import WORKERS

    cores = len(os.sched_getaffinity(0))
    env = {"CUDA_VISIBLE_DEVICES": ""}
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", "100000",
                        str(WORKERS / "sleeper.py"), "0"], timeout=60, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"--nproc-per-node=100000 would start more worker processes than this machine has CPU core(s) "
            f"({cores})") in proc.stderr and "--oversubscribe" in proc.stderr
    assert "worker pid" not in proc.stdout  # nothing was started
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", str(cores + 1),
                        "--oversubscribe", "--master-port", str(free_port()), str(WORKERS / "sleeper.py"), "0"],
                       timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.count("worker pid") == cores + 1, proc.stderr[-3000:]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_workers_do_not_outlive_their_launcher(tmp_path, sig):
    """torch's agent starts workers in sessions of their own: a launcher killed outright (SIGKILL) used to
    leave them running, orphaned. Now they die with it; SIGTERM stops them and exits 128 + 15 in one line."""
    import os
    import signal
    import subprocess
    import time

    from conftest import WORKERS

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}

    def start():
        """The launcher, once both workers said their pid; None (with why) if it ended before they did."""
        proc = subprocess.Popen([sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), str(WORKERS / "sleeper.py"), "120"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        pids = []
        while len(pids) < 2:
            line = proc.stdout.readline()
            if not line:
                proc.kill()
                return None, [], f"exit {proc.wait()}: {proc.stderr.read()[-3000:]}"
            if line.startswith("worker pid"):
                pids.append(int(line.split()[2]))
        return proc, pids, ""

    # Once in several full-suite runs the launcher ended, silently, before its workers started (not reproduced
    # alone); that is not what this test is about, so it starts again once, and fails if that happens twice.
    proc, workers, why = start()
    if proc is None:
        proc, workers, again = start()
        assert proc is not None, f"the launcher ended before its workers started, twice: {why} / {again}"
    try:
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in workers if _running(pid)]
        assert alive == [], f"workers {alive} outlived the launcher"
        if sig == "SIGTERM":
            assert proc.returncode == 128 + 15 and "stopped by SIGTERM" in err and "Traceback" not in err, err
    finally:
        proc.kill()
        for pid in workers:
            if _running(pid):
                os.kill(pid, 9)


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, IndexError):
        return False


def test_trainer_example_writes_logs_and_checkpoints_and_resumes(tmp_path):
    root = tmp_path / "run"
    first = run_command([sys.executable, "examples/trainer_digits.py", "--epochs", "2", "--root", str(root)], timeout=120)
    assert first.returncode == 0, first.stderr[-4000:]
    assert list((root / "logs" / "version_0").glob("events.out.tfevents.*"))
    assert (root / "csv" / "version_0" / "metrics.csv").exists()
    assert (root / "checkpoints" / "last" / "manifest.json").exists()
    assert "after 94 steps" in first.stdout  # 1500 samples / batch 32 = 47 steps an epoch
    # ckpt_path="last": a second run with more epochs continues where the first stopped
    second = run_command([sys.executable, "examples/trainer_digits.py", "--epochs", "3", "--root", str(root)], timeout=120)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "after 141 steps" in second.stdout


def test_trainer_with_devices_2_starts_its_own_processes(tmp_path):
    # the script's own arguments (`--run` once read as torchrun's `--run-path`) reach every process untouched
    proc = run_command([sys.executable, str(WORKERS / "trainer_relaunch.py"), "--run", "x", "--nnodes", "3"],
                       timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # two processes share the pipe, so their lines may interleave: look for both reports anywhere
    assert sorted(re.findall(r"RANK (\d) OF 2 STEPS 4 PORT \d+ ARGS --run x --nnodes 3", proc.stdout)) == ["0", "1"]


def test_trainer_example_on_two_processes_in_bf16(tmp_path):
    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "examples/trainer_digits.py", "--epochs", "2", "--precision", "bf16-mixed",
                        "--root", str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "after 48 steps" in proc.stdout  # 1500 samples, 2 processes x batch 32: 24 steps an epoch
    accuracy = float(proc.stdout.split("val/acc ")[1].split()[0])
    assert accuracy > 0.8
    assert list((tmp_path / "logs" / "version_0").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("flags, env, expected", [
    ([], {}, ("c10d", "localhost:0")),                                           # one machine: a free port
    (["--master-port", "23456"], {}, ("static", "", 23456)),                    # a port given: kept
    ([], {"PET_MASTER_PORT": "12345"}, ("static", "", 12345)),                  # torchrun's variable: kept
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], {}, ("static", "", 29500)),  # several machines: torch's port
    (["--standalone"], {}, ("static", "", 29500)),                               # torch's standalone mode decides
])
def test_launch_picks_the_rendezvous_port_as_torch_2_13_does(monkeypatch, flags, env, expected):
    from fabric_lite.cli.launch_command import free_port_rendezvous
    from fabric_lite.cli.launch_flags import launch_command_parser

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = launch_command_parser().parse_args([*flags, "train.py"])
    free_port_rendezvous(args)
    if expected[0] == "c10d":
        assert (args.rdzv_backend, args.rdzv_endpoint) == expected and args.rdzv_id
    else:
        assert (args.rdzv_backend, args.rdzv_endpoint, args.master_port) == expected
