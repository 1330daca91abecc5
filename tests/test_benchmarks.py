"""The benchmark scripts keep working: each runs in its quick mode, exits 0 and prints its table.

Timings are not checked here (they depend on the machine and its load); benchmarks/README.md records
them. The file takes ~75 s on 2 quiet cores (fsdp_memory.py --quick ~17 s of it, fp8_vs_bf16.py --quick
~13 s). Left out or cut short: import_time.py (no quick mode: a run starts 45 fresh interpreters),
checkpoint.py runs --quick without its peak-memory children (--no-memory, 6 s instead of 13 s), and of
the two DDP benchmarks only trainer_overhead.py --ddp runs (it uses the same launch path as overhead.py --ddp);
resume_time.py --quick resumes one process from the local disk once (~10 s: two interpreters start).
peers.py runs with whatever is installed: in the project's environment it names the missing peers
and still compares fabric_lite with the raw loop.
"""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT, free_port, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BENCH = ROOT / "benchmarks"


def run_quick(cmd, timeout=120):
    proc = run_command(cmd, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("script, extra, rows", [
    ("overhead.py", [], ["calls/step", "tiny   raw", "tiny   accelerator", "small  accelerator", "time ratio"]),
    ("trainer_overhead.py", [], ["median s/step", "raw", "trainer bare", "trainer full", "set-up calls"]),
    ("memory.py", [], ["peak MB", "tiny   raw", "tiny   accelerator", "tiny   trainer bare", "target: peak RSS"]),
    ("checkpoint.py", ["--no-memory"], ["median MB/s", "save raw", "save fabric_lite", "load fabric_lite"]),
    ("gpt_gpu.py", [], ["tokens/s", "raw ", "accelerator ", "trainer ", "calls/step"]),
    ("resume_time.py", [], ["1 process, local disk", "process start", "read + verify", "loader position",
                            "first step", "largest part:", "Python calls of one load_state",
                            "dataset items loaded for the first batch: [8] (a batch is 8)"]),
])
def test_quick_run_prints_its_table(script, extra, rows):
    out = run_quick([sys.executable, str(BENCH / script), "--quick", *extra])
    for row in rows:
        assert row in out, f"{row!r} missing from the output of {script}:\n{out}"


def test_fp8_vs_bf16_quick_trains_both_from_the_same_start():
    """--quick: a 2-layer GPT in bf16 and in fp8 (torchao's emulation on CPU, where no GPU computes in fp8; ~13 s)."""
    pytest.importorskip("torchao")
    out = run_quick([sys.executable, str(BENCH / "fp8_vs_bf16.py"), "--quick"])
    assert "floor ln(4) = 1.3863" in out and "each seen once" in out and "fp8 layers (7)" in out, out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:5]] for line in out.splitlines()
            if line.startswith(("bf16 ", "fp8 ")) and not line.startswith("fp8 layers")}
    assert set(rows) == {"bf16", "fp8"}, out
    (bf16_first, bf16_tail, _, _), (fp8_first, fp8_tail, _, _) = rows["bf16"], rows["fp8"]
    assert fp8_first == pytest.approx(bf16_first, rel=0.01)  # the same weights and batch: rounding apart
    assert bf16_tail < bf16_first - 0.1 and fp8_tail < fp8_first - 0.1  # both learn in 30 steps
    assert fp8_tail == pytest.approx(bf16_tail, rel=0.01), out  # measured: 0.01% apart
    assert "BELOW THE FLOOR" not in out and "loss difference fp8 - bf16" in out and "time ratio" in out


def test_peers_quick_names_what_is_missing():
    out = run_quick([sys.executable, str(BENCH / "peers.py"), "--quick"])
    for row in ("calls/step", "raw", "fabric_lite Accelerator", "fabric_lite Trainer bare"):
        assert row in out, out
    for module, row in (("accelerate", "HF Accelerate Accelerator"), ("lightning", "Lightning Trainer bare")):
        installed = _importable(module)
        assert (row in out) == installed, out
        if not installed:
            assert "NOT INSTALLED" in out, out


def test_trainer_overhead_ddp_quick():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(BENCH / "trainer_overhead.py"), "--ddp", "--quick"]
    out = run_quick(cmd)
    assert "2 process(es)" in out and "DDP" in out, out
    for row in ("raw", "trainer bare", "trainer full"):
        assert row in out, out
    assert out.count("Trainer overhead |") == 1, f"only rank 0 prints the table:\n{out}"


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_deepspeed_memory_quick_shows_the_zero3_saving():
    pytest.importorskip("deepspeed")
    out = run_quick([sys.executable, str(BENCH / "deepspeed_memory.py"), "--quick"], timeout=170)
    rows = [line.split() for line in out.splitlines() if line.startswith(("ddp ", "deepspeed_stage_3 "))]
    assert len(rows) == 4, out
    # exact byte counts: ZeRO-3 holds half the parameters and half the optimizer state of DDP per process
    assert all(r[-2] == "1.00" for r in rows[:2]) and all(r[-2] == "0.50" for r in rows[2:]), out


def test_fsdp_memory_quick_shows_the_sharding():
    out = run_quick([sys.executable, str(BENCH / "fsdp_memory.py"), "--quick"], timeout=170)
    for row in ("params MB", "ddp ", "fsdp ", "fsdp meta ", "calls/step", "start-up under FSDP"):
        assert row in out, out
    # exact byte counts: on 2 processes FSDP holds half the parameters and optimizer state of DDP per process
    assert "parameters + optimizer state 0.500 (1/N = 0.500)" in out, out
