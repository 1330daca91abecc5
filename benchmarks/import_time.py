"""What importing fabric_lite adds to `import torch`, measured in fresh interpreters.

Three statements run in new `python -c` processes, interleaved (the order rotates every round so
none always goes first), each N times (default 15):

    import torch
    import torch, fabric_lite
    import torch; from fabric_lite import Accelerator

Two figures per statement:
  wall      the whole process, start to exit. For each round the time of `import torch` in the
            same round is subtracted; the table gives the median, min and max of those differences
            (target: <= 0.15 s). Start-up noise on a shared machine is large next to the difference.
  in-proc   the fabric_lite part alone, timed inside the child with time.perf_counter() after torch
            is imported: the same cost without process start-up noise.

An untimed run of each statement goes first, to warm the OS file cache. Then `python -X importtime`
splits `import fabric_lite.accelerator.accelerator` by module (median of --importtime-runs runs).

Bytecode: the children import a copy of the package made in a temporary directory, whose .pyc
files are compiled once beforehand, so every run loads compiled modules as an installed package
does, and nothing is written into the source tree or the environment. `--no-bytecode-cache` leaves
the copy without .pyc files: every run then compiles fabric_lite from source (what a shell with
PYTHONDONTWRITEBYTECODE=1 gets when the package has no __pycache__).

    python benchmarks/import_time.py
    python benchmarks/import_time.py --repeats 5 --importtime-runs 1      # quicker
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
# (statement as reported, the part after `import torch` that the child times by itself)
VARIANTS: List[Tuple[str, str]] = [
    ("import torch", ""),
    ("import torch, fabric_lite", "import fabric_lite"),
    ("import torch; from fabric_lite import Accelerator", "from fabric_lite import Accelerator"),
]
BASELINE = VARIANTS[0][0]
SPLIT_STATEMENT = "import torch, fabric_lite.accelerator.accelerator"
TARGET_S = 0.15
_IMPORTTIME = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")


def child_code(fabric_part: str) -> str:
    """`import torch`, then the fabric_lite statement timed in-process; prints that time."""
    return ("import torch\nfrom time import perf_counter as _t\n_t0 = _t()\n"
            f"{fabric_part}\nprint(_t() - _t0)\n")


def package_copy(into: Path, compile_bytecode: bool) -> Path:
    """A copy of fabric_lite under `into`; the children import it (and write nothing)."""
    src = into / "src"
    shutil.copytree(ROOT / "fabric_lite", src / "fabric_lite", ignore=shutil.ignore_patterns("__pycache__"))
    if compile_bytecode and not compileall.compile_dir(src / "fabric_lite", quiet=1):
        raise RuntimeError("compiling the copy of fabric_lite failed")
    return src


def child_env(src: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_once(code: str, env: Dict[str, str], cwd: Path) -> Tuple[float, float]:
    """(wall seconds of the whole child, seconds the child measured for its fabric_lite part)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    return wall, float(proc.stdout.strip().splitlines()[-1])


def importtime_once(statement: str, env: Dict[str, str], cwd: Path) -> List[Tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) for each import, in the order `-X importtime` prints them."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], env=env, cwd=cwd,
                          check=True, capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        m = _IMPORTTIME.match(line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)) // 2, m.group(4)))
    return rows


def after_torch(rows: List[Tuple[int, int, int, str]]) -> List[Tuple[int, int, int, str]]:
    """The imports made after `torch` finished: what the fabric_lite part of the statement costs."""
    for i, (_, _, depth, name) in enumerate(rows):
        if name == "torch" and depth == 0:
            return rows[i + 1:]
    raise RuntimeError("`-X importtime` output has no top-level torch entry")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="timed runs of each statement (default 15)")
    parser.add_argument("--importtime-runs", type=int, default=3,
                        help="runs of `python -X importtime` for the per-module split (default 3; 0 skips it)")
    parser.add_argument("--top", type=int, default=8, help="modules listed in the per-module split")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="compile fabric_lite from source on every run instead of loading cached bytecode")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    statements = [s for s, _ in VARIANTS]
    codes = dict(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="import-time-") as tmp:
        src = package_copy(Path(tmp), compile_bytecode=not args.no_bytecode_cache)
        env = child_env(src)
        where = subprocess.run([sys.executable, "-c", "import fabric_lite; print(fabric_lite.__file__)"],
                               env=env, cwd=src, check=True, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(src)):
            raise RuntimeError(f"the children import fabric_lite from {where}, not from the copy in {src}")
        for s in statements:  # warm-up: the OS file cache
            run_once(child_code(codes[s]), env, src)

        wall: Dict[str, List[float]] = {s: [] for s in statements}
        inproc: Dict[str, List[float]] = {s: [] for s in statements}
        added: Dict[str, List[float]] = {s: [] for s in statements[1:]}
        for r in range(args.repeats):
            k = r % len(statements)
            this_round = {s: run_once(child_code(codes[s]), env, src) for s in statements[k:] + statements[:k]}
            for s, (w, i) in this_round.items():
                wall[s].append(w)
                inproc[s].append(i)
            for s in added:
                added[s].append(this_round[s][0] - this_round[BASELINE][0])

        split: Dict[str, List[int]] = defaultdict(list)
        totals: List[int] = []
        for _ in range(args.importtime_runs):
            rows = after_torch(importtime_once(SPLIT_STATEMENT, env, src))
            totals.append(sum(cum for _, cum, depth, _ in rows if depth == 0))
            for self_us, _, _, name in rows:
                split[name].append(self_us)

    import torch  # only for its version string, after the timed children are done

    print(f"import time in fresh interpreters | python {platform.python_version()} | torch {torch.__version__} | "
          f"{args.repeats} interleaved rounds | fabric_lite "
          f"{'compiled from source every run' if args.no_bytecode_cache else 'from cached bytecode'}")
    print()
    w = max(map(len, statements))
    print(f"{'statement':{w}} {'wall median s':>13} {'min':>6} {'max':>6}  {'added wall s: median [min..max]':>33}"
          f"  {'in-proc ms: median [min..max]':>30}")
    for s in statements:
        v = wall[s]
        line = f"{s:{w}} {statistics.median(v):13.3f} {min(v):6.3f} {max(v):6.3f}"
        if s in added:
            a, i = added[s], [x * 1e3 for x in inproc[s]]
            line += f"  {f'{statistics.median(a):+.3f} [{min(a):+.3f}..{max(a):+.3f}]':>33}"
            line += f"  {f'{statistics.median(i):.1f} [{min(i):.1f}..{max(i):.1f}]':>30}"
        print(line)
    print(f"\ntarget: adds <= {TARGET_S:g} s over `import torch`")
    for s in statements[1:]:
        a, i = statistics.median(added[s]), statistics.median(inproc[s])
        print(f"  {s}: wall {a:+.3f} s ({'met' if a <= TARGET_S else 'missed'}), "
              f"in-proc {i * 1e3:.1f} ms ({'met' if i <= TARGET_S else 'missed'})")
    print("added wall = per-round difference to `import torch` in the same round; in-proc = the fabric_lite "
          "statement timed inside the child, after torch.")

    if totals:
        print(f"\n`-X importtime` of `{SPLIT_STATEMENT}`, imports after torch "
              f"(median of {len(totals)} run(s)): {statistics.median(totals) / 1e3:.1f} ms in all")
        heaviest = sorted(split.items(), key=lambda kv: -statistics.median(kv[1]))[: args.top]
        print(f"{'self ms':>8}  module")
        for name, v in heaviest:
            print(f"{statistics.median(v) / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
