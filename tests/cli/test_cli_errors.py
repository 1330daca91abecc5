"""Every `fabric-lite` command turns an expected failure (a bad value, a path that cannot be used, a checkpoint
that cannot be read, a file that safe loading refuses) into one line on stderr and status 2; a bug still shows
its traceback."""

import json
import pickle
import sys

import pytest
import torch

from conftest import run_command
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.cli.main import main

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "fabric_lite.cli"]


class Opaque:
    """An object no safe loader builds."""


def unsafe_checkpoint(root):
    """A whole checkpoint (manifest and checksums valid) whose model_0.pt holds a pickled custom object."""
    from fabric_lite import Accelerator
    from fabric_lite.checkpoint.checksums import checksum_of

    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state(str(root))
    weights = root / "model_0.pt"
    torch.save({"weight": torch.zeros(2, 2), "extra": Opaque()}, weights)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["model_0.pt"] = checksum_of(str(weights), manifest["files"]["model_0.pt"],
                                                  manifest["checksum"])
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def one_line(err, command):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fabric-lite {command}: error: "), err
    assert "Traceback" not in err and "\x1b[" not in err, err
    return lines[0]


def test_consolidate_of_a_file_safe_loading_refuses_is_one_line(tmp_path):
    ckpt = unsafe_checkpoint(tmp_path / "ckpt")
    proc = run_command([*CLI, "consolidate", str(ckpt), str(tmp_path / "out.pt")], timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = one_line(proc.stderr, "consolidate")
    assert str(ckpt) in line and "weights_only" in line and "Opaque" in line, line
    assert "if you trust" in line.lower(), line
    assert not (tmp_path / "out.pt").exists()


def test_consolidate_of_what_is_not_a_checkpoint_is_status_2(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "w.pt")]) == 2
    assert "No checkpoint" in one_line(capsys.readouterr().err, "consolidate")


def test_config_that_cannot_be_written_is_status_2(tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["config", "--config-file", str(blocked / "config.yaml"), "--default"]) == 2
    assert f"cannot write {blocked}/config.yaml" in one_line(capsys.readouterr().err, "config")


# Each command, and a public function it calls on the way: made to fail as user input or the file system can.
FAIL_AT = {
    "launch": ("fabric_lite.cli.launch_command", "launch_command", ["x.py"]),
    "explain": ("fabric_lite.cli.explain", "explain_command", ["x.py"]),
    "test": ("fabric_lite.cli.launch_command", "launch_command", []),
    "env": ("fabric_lite.launch.config_file", "find_config", []),
    "config": ("fabric_lite.launch.config_file", "save_config", ["--default"]),
    "consolidate": ("fabric_lite.checkpoint.state", "export_weights", ["ckpt", "out.pt"]),
}
ERRORS = {
    "value": ValueError("--thing=7 must be below 5; pass a smaller one.\n(second line of detail)"),
    "missing_file": FileNotFoundError(2, "No such file or directory", "/data/x.yaml"),
    "permission": PermissionError(13, "Permission denied", "/root/out"),
    "checkpoint": CheckpointError("/ckpt/manifest.json is damaged: no files. Load an earlier checkpoint."),
    "unpickling": pickle.UnpicklingError("Weights only load failed. Long story.\n\tWeightsUnpickler error: "
                                         "Unsupported global: GLOBAL mod.Thing was not an allowed global by default."),
}


@pytest.mark.parametrize("command", sorted(FAIL_AT))
@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_every_command_reports_an_expected_failure_in_one_line(command, kind, tmp_path, monkeypatch, capsys):
    import importlib

    module, name, argv = FAIL_AT[command]
    error = ERRORS[kind]

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(importlib.import_module(module), name, fail)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(tmp_path / "config"))
    assert main([command, *argv]) == 2
    line = one_line(capsys.readouterr().err, command)
    expected = {"value": "--thing=7 must be below 5; pass a smaller one. (second line of detail)",
                "missing_file": "/data/x.yaml", "permission": "/root/out", "checkpoint": "/ckpt/manifest.json",
                "unpickling": "mod.Thing"}[kind]
    assert expected in line, line


def test_a_bug_still_shows_its_traceback(monkeypatch):
    import fabric_lite.checkpoint.state as state

    def broken(*args, **kwargs):
        raise KeyError("a bug, not a user's mistake")

    monkeypatch.setattr(state, "export_weights", broken)
    with pytest.raises(KeyError):
        main(["consolidate", "ckpt", "out.pt"])


def test_explain_keeps_the_traceback_of_the_users_own_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise ValueError('the script itself is wrong')\n")
    proc = run_command([*CLI, "explain", "--cpu", str(script)], timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "the script itself is wrong" in proc.stderr
