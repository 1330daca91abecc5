"""Peak memory of a training run through fabric_lite, next to the same run in plain PyTorch.

Every run is its own fresh Python process, so one run's peak never carries into the next: the raw
PyTorch loop, the Accelerator and the Trainer (bare: no progress bar, no checkpoints), on the tiny
and the small MLP of overhead.py (the same model, data, optimizer and loops: this script imports
them from overhead.py and trainer_overhead.py). Each child reports its resident set size (RSS) at
three points:

  torch   after `import torch` and the workload module (overhead.py, which does not load fabric_lite)
  base    after the data set and one model are built: what every run holds before its loop starts
  peak    the most RSS the child ever held: ru_maxrss from wait4() on that child, read by the parent

The framework's imports come after `base`, so they count in the peak. `peak - base` is what the run
itself added (model copies, gradients, AdamW state, the framework), often more telling than the peak,
which is mostly torch's own libraries. With CUDA (and without --cpu) every loop trains on the GPU,
and the child also reports torch.cuda.max_memory_allocated / max_memory_reserved; on a CPU-only
machine those columns are left out and the script says so.

Runs are repeated (the order of the loops reverses every round) and the table shows medians.

    python benchmarks/memory.py            # tiny and small MLP, 5 rounds (~2 minutes)
    python benchmarks/memory.py --quick    # smoke run: tiny MLP, 1 round, a few steps (~10 s)

Target: peak RSS of a framework run over the raw loop's <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOOPS = ("raw", "accelerator", "trainer bare")
CHILD_NAMES = {"raw": "raw", "accelerator": "accelerator", "trainer bare": "trainer"}
DEFAULT_STEPS = {"tiny": 300, "small": 40}  # a little over two epochs of each (128 / 16 steps an epoch)
QUICK_STEPS = {"tiny": 20, "small": 3}
TARGET = 1.05
MARK = "MEMORY-RESULT "


def _status_kib(field: str) -> int:
    """A `VmRSS:`-style line of /proc/self/status, in KiB (0 where there is no procfs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- child: one run in a fresh process -------------------------------------------------------------

def child(loop: str, model: str, steps: int, quick: bool, cpu: bool) -> None:
    report: Dict[str, object] = {"loop": loop, "model": model, "steps": steps}
    if cpu:  # before torch loads: the Accelerator and the Trainer would otherwise pick the GPU themselves
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    sys.path.insert(0, str(HERE))
    from overhead import QUICK, SPECS, Spec, build_mlp, framework_loop, raw_loop, synthetic_data

    report["rss_torch_kib"] = _status_kib("VmRSS")
    cuda = torch.cuda.is_available() and not cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    report.update(torch=torch.__version__, threads=torch.get_num_threads(), device=str(device))

    spec = Spec(**SPECS[model].__dict__)
    if quick:
        spec.samples = QUICK[model]["samples"]
    data = synthetic_data(spec)
    torch.manual_seed(0)
    reference = build_mlp(spec.sizes)  # held to the end: "model creation" is part of the base
    report["rss_base_kib"] = _status_kib("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        if loop == "raw":
            run, _ = raw_loop(spec, data, ddp=False, device=device)
            run(steps)
        elif loop == "accelerator":
            run, _ = framework_loop(spec, data, ddp=False, device=device)
            run(steps)
        elif loop == "trainer":
            from trainer_overhead import trainer_loop

            trainer_loop(spec, data, full=False, root=root, device=device)(steps)  # one fit of `steps` steps
        else:
            raise SystemExit(f"unknown loop {loop!r}")
        if cuda:
            torch.cuda.synchronize(device)
    report["run_s"] = time.perf_counter() - t0
    report["rss_end_kib"] = _status_kib("VmRSS")
    report["hwm_kib"] = _status_kib("VmHWM")  # the child's own view of its peak (the parent reads wait4's)
    report["modules"] = len(sys.modules)
    report["parameters"] = sum(p.numel() for p in reference.parameters())
    report["fabric_lite_loaded"] = "fabric_lite" in sys.modules
    if cuda:
        report["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        report["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
    print(MARK + json.dumps(report), flush=True)


# -- parent: start the children, read their peaks --------------------------------------------------

def run_child(loop: str, model: str, steps: int, quick: bool, cpu: bool, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", CHILD_NAMES[loop], "--models", model,
           "--steps", str(steps)] + (["--quick"] if quick else []) + (["--cpu"] if cpu else [])
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while True:
            # wait4 (not Popen.wait) returns this child's own rusage: ru_maxrss is its peak RSS in KiB.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -9
                out.seek(0)
                raise RuntimeError(f"{loop} / {model}: no result after {timeout:.0f} s\n{out.read()[-4000:]}")
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    lines = [ln for ln in text.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{loop} / {model}: child exited with {proc.returncode}\n{text[-4000:]}")
    report = json.loads(lines[-1][len(MARK):])
    report["peak_kib"] = usage.ru_maxrss
    return report


def mb(kib: float) -> float:
    return kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of a few steps: checks that the script works")
    parser.add_argument("--models", help="comma-separated: tiny, small (default both; tiny with --quick)")
    parser.add_argument("--loops", default=",".join(LOOPS),
                        help=f"comma-separated, from: {', '.join(LOOPS)} (raw is always run: ratios need it)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 300 tiny, 40 small)")
    parser.add_argument("--repeats", type=int, help="rounds of fresh processes (default 5; 1 with --quick)")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is available")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed to one child (default 300)")
    parser.add_argument("--json", type=Path, help="also write every child's report to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    models = [m.strip() for m in (args.models or ("tiny" if args.quick else "tiny,small")).split(",") if m.strip()]
    unknown = [m for m in models if m not in DEFAULT_STEPS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(DEFAULT_STEPS)}")
    if args.child:
        steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)[models[0]]
        child(args.child, models[0], steps, args.quick, args.cpu)
        return

    loops = ["raw"] + [x.strip() for x in args.loops.split(",") if x.strip() and x.strip() != "raw"]
    bad = [x for x in loops if x not in LOOPS]
    if bad:
        parser.error(f"unknown loop(s) {bad}; choose from {', '.join(LOOPS)}")
    repeats = args.repeats or (1 if args.quick else 5)
    if repeats < 1:
        parser.error("--repeats must be >= 1")

    print(f"fabric_lite memory: peak RSS of fresh processes, raw PyTorch loop vs {' vs '.join(loops[1:])} | "
          f"{repeats} round(s){' | QUICK' if args.quick else ''}", flush=True)
    reports: Dict[str, Dict[str, List[dict]]] = {m: {lp: [] for lp in loops} for m in models}
    t0 = time.perf_counter()
    for r in range(repeats):
        for model in models:
            steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)[model]
            for loop in loops if r % 2 == 0 else loops[::-1]:
                reports[model][loop].append(run_child(loop, model, steps, args.quick, args.cpu, args.timeout))
    elapsed = time.perf_counter() - t0

    first = reports[models[0]]["raw"][0]
    cuda = "cuda_max_allocated" in first
    print(f"torch {first['torch']} | device {first['device']} | {first['threads']} thread(s) | "
          f"{elapsed:.0f} s\n")

    def med(model: str, loop: str, key: str) -> float:
        return statistics.median(float(rep[key]) for rep in reports[model][loop])

    summary: Dict[str, Dict[str, dict]] = {}
    print(f"{'model':6} {'loop':13} {'steps':>5} {'torch MB':>9} {'base MB':>8} {'peak MB':>8} {'min..max':>13} "
          f"{'peak-base':>9} {'ratio':>6} {'+MB':>6} {'modules':>7}")
    for model in models:
        raw_peak = med(model, "raw", "peak_kib")
        raw_extra = raw_peak - med(model, "raw", "rss_base_kib")
        for loop in loops:
            reps = reports[model][loop]
            peaks = [rep["peak_kib"] for rep in reps]
            peak, base = med(model, loop, "peak_kib"), med(model, loop, "rss_base_kib")
            extra = peak - base
            row = {
                "steps": reps[0]["steps"], "rss_torch_mb": mb(med(model, loop, "rss_torch_kib")),
                "rss_base_mb": mb(base), "peak_mb": mb(peak), "peak_min_mb": mb(min(peaks)),
                "peak_max_mb": mb(max(peaks)), "peak_over_base_mb": mb(extra),
                "ratio": peak / raw_peak, "extra_vs_raw_mb": mb(extra - raw_extra),
                "modules": int(med(model, loop, "modules")), "fabric_lite_loaded": reps[0]["fabric_lite_loaded"],
                "child_hwm_mb": mb(med(model, loop, "hwm_kib")), "run_s": med(model, loop, "run_s"),
            }
            if cuda:
                row["cuda_max_allocated_mb"] = med(model, loop, "cuda_max_allocated") / 2**20
                row["cuda_max_reserved_mb"] = med(model, loop, "cuda_max_reserved") / 2**20
            summary.setdefault(model, {})[loop] = row
            print(f"{model:6} {loop:13} {row['steps']:5d} {row['rss_torch_mb']:9.1f} {row['rss_base_mb']:8.1f} "
                  f"{row['peak_mb']:8.1f} {row['peak_min_mb']:6.1f}..{row['peak_max_mb']:<6.1f} "
                  f"{row['peak_over_base_mb']:9.1f} {row['ratio']:6.3f} {row['extra_vs_raw_mb']:+6.1f} "
                  f"{row['modules']:7d}")

    if cuda:
        print(f"\n{'model':6} {'loop':13} {'CUDA max allocated MB':>22} {'ratio':>6} {'max reserved MB':>16}")
        for model in models:
            raw_alloc = summary[model]["raw"]["cuda_max_allocated_mb"]
            for loop in loops:
                row = summary[model][loop]
                ratio = row["cuda_max_allocated_mb"] / raw_alloc if raw_alloc else float("nan")
                print(f"{model:6} {loop:13} {row['cuda_max_allocated_mb']:22.1f} {ratio:6.3f} "
                      f"{row['cuda_max_reserved_mb']:16.1f}")
    else:
        print("\nCUDA: not available (or --cpu), so no GPU memory columns: every run trained on the CPU.")

    print(f"\ntarget: peak RSS ratio <= {TARGET:g}")
    for model in models:
        for loop in loops[1:]:
            ratio = summary[model][loop]["ratio"]
            print(f"  {model:6} {loop:13} {ratio:.3f}  {'met' if ratio <= TARGET else 'missed'}")
    if any(summary[m]["raw"]["fabric_lite_loaded"] for m in models):
        print("WARNING: the raw-loop child loaded fabric_lite; its base is not framework-free.")
    print("\nMB = 2^20 bytes. torch / base: RSS after `import torch` and the workload module / after the data and "
          "one model are built.\npeak: ru_maxrss of the child (median over rounds, min..max); ratio = peak / raw "
          "peak; +MB = (peak - base) minus raw's (peak - base).\nmodules: entries in sys.modules at the end of "
          "the run (what the framework imported).")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": reports}, indent=2))


if __name__ == "__main__":
    main()
