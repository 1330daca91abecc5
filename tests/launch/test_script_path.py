"""A training script that is not there (or is a directory) is refused in one line before any process starts:
by `fabric-lite launch`, `fabric-lite explain`, and the re-launch of `Trainer(devices=N)`."""

import sys
import time

import pytest

from conftest import run_command

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "fabric_lite.cli"]


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("command", ["launch", "explain"])
def test_a_missing_script_is_refused_in_one_line_before_anything_starts(tmp_path, command):
    missing = tmp_path / "trian.py"
    started = time.monotonic()
    proc = run_command([*CLI, command, "--cpu", "--nproc-per-node", "2", str(missing), "--epochs", "1"], timeout=60)
    one_line_error(proc, f"fabric-lite {command}: error:", str(missing), "does not exist")
    assert "-m" in proc.stderr  # what to do for a module
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("command", ["launch", "explain"])
def test_a_directory_as_the_script_is_refused_in_one_line(tmp_path, command):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    proc = run_command([*CLI, command, "--cpu", "--nproc-per-node", "2", str(folder)], timeout=60)
    one_line_error(proc, f"fabric-lite {command}: error:", str(folder), "is a directory", "__main__.py")


def test_check_script_reads_a_path_only_where_the_launch_runs_a_script_path(tmp_path):
    from fabric_lite.cli.launch_flags import launch_command_parser
    from fabric_lite.launch.launch_checks import LaunchError, check_script

    def args(*argv):
        return launch_command_parser().parse_args(list(argv))

    script = tmp_path / "train.py"
    script.write_text("")
    check_script(args(str(script)))
    check_script(args("-m", "no.such.module"))  # a module: Python finds it in the workers
    check_script(args("--no-python", "no-such-program"))  # a program: looked up on PATH by the workers
    check_script(args("--no_python", "no-such-program"))
    runnable = tmp_path / "app"  # a directory with __main__.py is what `python app/` runs
    runnable.mkdir()
    (runnable / "__main__.py").write_text("")
    check_script(args(str(runnable)))
    with pytest.raises(LaunchError, match="does not exist"):
        check_script(args("--run-path", str(tmp_path / "gone.py")))
    with pytest.raises(LaunchError, match="is a directory"):
        check_script(args(str(tmp_path)))


def test_launch_command_refuses_a_missing_script_with_status_2(tmp_path, capsys):
    from fabric_lite.cli.launch_command import launch_command

    code = launch_command(["--cpu", "--nproc-per-node", "1", str(tmp_path / "nope.py")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(tmp_path / "nope.py") in err, err


def test_trainer_relaunch_of_a_script_that_is_gone_says_so_before_starting_anything(tmp_path):
    script = tmp_path / "vanishing.py"
    script.write_text(
        "import os\n"
        "from fabric_lite import Trainer\n"
        "os.remove(__file__)  # moved or deleted while it ran: it cannot be started again\n"
        "Trainer(devices=2, accelerator='cpu', strategy='ddp')\n")
    proc = run_command([sys.executable, str(script)], timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "torch.distributed" not in output and "can't open file" not in output, output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert str(script) in last and "no longer exists" in last and "fabric-lite launch" in last, last
