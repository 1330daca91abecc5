"""examples/xla_example.py on XLA's CPU device, in the XLA environment: `make test-xla`. Skipped elsewhere
(there tests/test_examples.py checks that the example names what to install)."""

import re
import sys

import pytest

from conftest import ROOT, run_command

pytest.importorskip("torch_xla", reason="needs torch_xla and its own torch: run `make test-xla`")

pytestmark = pytest.mark.slow


def test_xla_example(tmp_path, monkeypatch):
    for name in ("CPU_NUM_DEVICES", "XLA_USE_SPMD"):  # one XLA CPU device, no SPMD, whatever the shell says
        monkeypatch.delenv(name, raising=False)
    proc = run_command([sys.executable, str(ROOT / "examples" / "xla_example.py"), "--epochs", "2"],
                       timeout=180, cwd=tmp_path, env={"PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "device xla:0 (XLA), 1 replica(s)" in proc.stdout, proc.stdout
    losses = [float(v) for v in re.findall(r"epoch \d: mean loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[-1] < losses[0], proc.stdout
    assert (tmp_path / "runs" / "xla" / "checkpoint" / "manifest.json").exists()
