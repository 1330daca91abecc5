"""What importing fabric_lite adds to `import torch`, measured in fresh interpreters.

Three statements run in new `python -c` processes, interleaved (the order rotates every round so
none always goes first), each N times (default 15):

    import torch
    import torch, fabric_lite
    import torch; from fabric_lite import Accelerator

For each round the time of `import torch` is subtracted from the other two; the table gives the
median, min and max of those differences (target: <= 0.15 s). An untimed run of each statement
goes first, to warm the OS file cache and write bytecode caches.

Bytecode: the children import a copy of the package made in a temporary directory, whose .pyc
files are compiled once beforehand, so every run loads compiled modules as an installed package
does, and nothing is written into the source tree or the environment. `--no-bytecode-cache` leaves
the copy without .pyc files: every run then compiles fabric_lite from source (what a shell with
PYTHONDONTWRITEBYTECODE=1 gets when the package has no __pycache__).

Then, in-process, `python -X importtime` splits the Accelerator import by module (median of
`--importtime-runs` runs): the cost with no process start-up noise, and where it goes.

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
BASELINE = "import torch"
STATEMENTS = [
    BASELINE,
    "import torch, fabric_lite",
    "import torch; from fabric_lite import Accelerator",
]
TARGET_S = 0.15
_IMPORTTIME = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")


def package_copy(into: Path, compile_bytecode: bool) -> Path:
    """A copy of fabric_lite under `into`; the children import it (and write nothing)."""
    src = into / "src"
    shutil.copytree(ROOT / "fabric_lite", src / "fabric_lite", ignore=shutil.ignore_patterns("__pycache__"))
    if compile_bytecode:
        ok = compileall.compile_dir(src / "fabric_lite", quiet=1)
        if not ok:
            raise RuntimeError("compiling the copy of fabric_lite failed")
    return src


def child_env(src: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_once(statement: str, env: Dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], env=env, cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run_once_output(statement: str, env: Dict[str, str], cwd: Path) -> str:
    return subprocess.run([sys.executable, "-c", statement], env=env, cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


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
    parser.add_argument("--importtime-runs", type=int, default=5,
                        help="runs of `python -X importtime` for the per-module split (default 5; 0 skips it)")
    parser.add_argument("--top", type=int, default=8, help="modules listed in the per-module split")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="compile every module on every run instead of loading cached bytecode")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    with tempfile.TemporaryDirectory(prefix="import-time-") as tmp:
        src = package_copy(Path(tmp), compile_bytecode=not args.no_bytecode_cache)
        env = child_env(src)
        where = run_once_output("import fabric_lite; print(fabric_lite.__file__)", env, src)
        if not where.startswith(str(src)):
            raise RuntimeError(f"the children import fabric_lite from {where}, not from the copy in {src}")
        for statement in STATEMENTS:  # warm-up: the OS file cache
            run_once(statement, env, src)

        times: Dict[str, List[float]] = {s: [] for s in STATEMENTS}
        added: Dict[str, List[float]] = {s: [] for s in STATEMENTS[1:]}
        for r in range(args.repeats):
            k = r % len(STATEMENTS)
            this_round = {s: run_once(s, env, src) for s in STATEMENTS[k:] + STATEMENTS[:k]}
            for s, t in this_round.items():
                times[s].append(t)
            for s in added:
                added[s].append(this_round[s] - this_round[BASELINE])

        split: Dict[str, List[int]] = defaultdict(list)
        totals: List[int] = []
        for _ in range(args.importtime_runs):
            rows = after_torch(importtime_once(STATEMENTS[-1], env, src))
            totals.append(sum(cum for _, cum, depth, _ in rows if depth == 0))
            for self_us, _, _, name in rows:
                split[name].append(self_us)

    import torch  # only for its version string, after the timed children are done

    print(f"import time in fresh interpreters | python {platform.python_version()} | torch {torch.__version__} | "
          f"{args.repeats} interleaved rounds | fabric_lite {'compiled from source every run' if args.no_bytecode_cache else 'from cached bytecode'}")
    print()
    width = max(map(len, STATEMENTS))
    print(f"{'statement':{width}} {'median s':>9} {'min s':>7} {'max s':>7}   {'added over import torch (s)':>28}")
    for s in STATEMENTS:
        v = times[s]
        line = f"{s:{width}} {statistics.median(v):9.3f} {min(v):7.3f} {max(v):7.3f}"
        if s in added:
            a = added[s]
            line += f"   median {statistics.median(a):+.3f} [{min(a):+.3f}..{max(a):+.3f}]"
            line += f"  target <= {TARGET_S:g}: {'met' if statistics.median(a) <= TARGET_S else 'missed'}"
        print(line)
    print("\nadded = per-round difference to `import torch` in the same round: median [min..max].")

    if totals:
        print(f"\n`-X importtime` for `{STATEMENTS[-1]}`, imports after torch "
              f"(median of {len(totals)} run(s)): {statistics.median(totals) / 1e3:.1f} ms in all")
        heaviest = sorted(split.items(), key=lambda kv: -statistics.median(kv[1]))[: args.top]
        print(f"{'self ms':>8}  module")
        for name, v in heaviest:
            print(f"{statistics.median(v) / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
