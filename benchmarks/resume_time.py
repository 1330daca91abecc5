"""Time to resume: from a SIGKILL to the first new optimizer step, split into its parts.

A training script (the raw door: `Accelerator`, `prepare`, a hand-written loop) trains a stack of
`nn.Linear` (~100M fp32 parameters by default: 6 x Linear(4096, 4096)) with AdamW on a map-style dataset
and saves a checkpoint with `save_state` (blocking) at step `--save-at`. The benchmark polls for the
checkpoint's `manifest.json` at its final place; once it is there (the checkpoint is published) the
whole process tree is SIGKILLed while it trains on, and the same script is launched again at once
with `--resume`: one process as `python resume_time.py ...`, two as
`python -m fabric_lite.cli launch --nproc-per-node 2 resume_time.py ...` (DDP over gloo).

The resumed script writes wall-clock timestamps (`time.time()`, one machine) and the benchmark
subtracts them, per process (rank 0's figures are printed; "first step" is the last rank's):

  process start    the kill -> the script's first line (interpreter start; with 2 processes the
                   launcher's own start, its imports and its spawning of the workers)
  import           `import torch` and `from fabric_lite import Accelerator`
  rendezvous       `Accelerator()` (with 2 processes: the process group, gloo)
  build + prepare  the model, AdamW and the loader built, then `accelerator.prepare`
  read + verify    inside `load_state`: the manifest and every file read and checked against its
                   checksum (time spent in `read_manifest` and `load_file`, measured by wrapping them
                   from outside; the checksum itself runs on a helper thread while torch.load parses,
                   its own time is shown beside the table)
  apply            the rest of `load_state`: fit checks, `load_state_dict` of every object, RNGs
  loader position  `load_state` returned -> the first batch (and how many dataset items were loaded
                   for it: a loader that replays data it could restore loads more than one batch)
  first step       forward, backward, `optimizer.step()` of that batch (the step after it is timed too,
                   for comparison: the first writes AdamW's state, 2x the model, for the first time)

Beside the table: `load_state`'s CPU seconds (`time.process_time()`, every thread of the process: figures that
the load of other work on the machine moves much less than wall time) and the memory it touched for the first
time (minor page faults), the calls (below) and the dataset items loaded to reach the first batch.

Each configuration (1 process / 2 processes, the checkpoint on the local disk / on an S3 server) runs
its repeats as kill -> resume -> kill -> resume ...: the first resume follows the kill of the run that
saved, each later one the kill of the previous resumed run (which trains on after its first step). The
table gives the median and range of each part and names the largest. S3 is moto's server
(`ThreadedMotoServer`, in this process, on 127.0.0.1) reached through s3fs, as the tests use it; without
moto or s3fs those configurations are skipped with a note. The last resume of each configuration also
counts, once its figures are taken, the Python function calls of a second `load_state` in that process (`sys.setprofile`: calls and C
calls), a figure load on the machine does not move. Nothing here passes or fails.

    python benchmarks/resume_time.py             # 100M parameters, 4 configurations, 3 repeats: ~4 min
    python benchmarks/resume_time.py --quick     # ~5M parameters, 1 process, local disk, 1 repeat: ~10 s
    python benchmarks/resume_time.py --quick --configs 1-local,1-s3   # and the S3 path (~20 s)
    python benchmarks/resume_time.py --configs 1-local,2-local --repeats 5
"""

import time

_T0 = time.time()  # the resumed script's first line (before any import but time)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
CONFIGS = {"1-local": (1, "local"), "2-local": (2, "local"), "1-s3": (1, "s3"), "2-s3": (2, "s3")}
LABELS = {"1-local": "1 process, local disk", "2-local": "2 processes, local disk",
          "1-s3": "1 process, S3 (moto)", "2-s3": "2 processes, S3 (moto)"}
# (part, from timestamp, to timestamp)
PARTS = [("process start", "killed", "start"), ("import", "start", "imported"),
         ("rendezvous", "imported", "rendezvous"), ("build + prepare", "rendezvous", "prepared"),
         ("read + verify", None, None), ("apply", None, None),
         ("loader position", "loaded", "first_batch"), ("first step", "first_batch", "stepped")]
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")
RUNNING: List[subprocess.Popen] = []  # launched and not yet killed: killed when the benchmark stops


def shape_for(params: int) -> Tuple[int, int]:
    """(width, layers) of a stack of Linear(width, width) holding about `params` parameters."""
    width = min(4096, max(64, 2 ** int(math.log2(math.sqrt(max(params, 1) / 4)))))
    return width, max(1, round(params / (width * width + width)))


# -- the training script (child processes) --------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    stamps: Dict[str, float] = {"start": _T0}
    import torch
    from torch import nn

    from fabric_lite import Accelerator

    stamps["imported"] = time.time()
    accelerator = Accelerator()
    stamps["rendezvous"] = time.time()
    rank = accelerator.process_index

    class Items(torch.utils.data.Dataset):
        """A map-style dataset that counts the items it hands out (a replayed skip would load more)."""

        def __init__(self, n: int, width: int) -> None:
            self.n, self.width, self.loaded = n, width, 0

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> Any:
            self.loaded += 1
            g = torch.Generator().manual_seed(i)
            return torch.randn(self.width, generator=g), torch.randn(self.width, generator=g)

    torch.manual_seed(0)
    width, layers = shape_for(args.params)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = Items(args.batch * 10_000, width)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stamps["prepared"] = time.time()

    def step(batch: Any) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    report: Dict[str, Any] = {"rank": rank, "world": accelerator.num_processes}
    if args.resume:
        import resource

        timing = _TimingHooks()
        cpu, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.time()
        accelerator.load_state(args.url)
        stamps["loaded"] = time.time()
        report.update(load_cpu_s=time.process_time() - cpu,
                      load_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        timing.remove()
        report.update(load_s=stamps["loaded"] - t, read_s=timing.read_s, checksum_s=timing.checksum_s)
    else:
        stamps["loaded"] = time.time()
    dataset.loaded = 0
    batches = iter(loader)
    first = next(batches)
    stamps["first_batch"] = time.time()
    report["items_for_first_batch"] = dataset.loaded
    step(first)
    stamps["stepped"] = time.time()
    report["stamps"] = stamps
    t = time.time()
    step(next(batches))  # the next one, for comparison: what a step costs once its memory is in place
    report["second_step_s"] = time.time() - t
    if args.resume:
        if args.count_calls:
            report["load_state_calls"] = _count_calls(lambda: accelerator.load_state(args.url))
        _write_json(f"{args.report}.{rank}", report)
    done, deadline = 1, time.time() + 900  # a safety net: never outlive a benchmark that died
    while time.time() < deadline and os.getppid() != 1:  # train on until killed
        for batch in batches:
            step(batch)
            done += 1
            if not args.resume and done == args.save_at:
                accelerator.save_state(args.url)  # blocking: returns once the checkpoint is published
            if time.time() > deadline or os.getppid() == 1:
                break
        batches = iter(loader)


class _TimingHooks:
    """Time spent in `read_manifest`/`load_file` (the reading phase of load_state) and in `checksum_of` (on the
    checksum thread), by wrapping the module attributes load_state looks them up through."""

    def __init__(self) -> None:
        import threading

        from fabric_lite.checkpoint import checksums, files, restore

        self.read_s = 0.0
        self.checksum_s = 0.0
        self._lock = threading.Lock()
        self._undo: List[Tuple[Any, str, Any]] = []
        self._wrap(restore, "load_file", "read_s")
        self._wrap(restore, "load_files", "read_s")
        self._wrap(files, "read_manifest", "read_s")
        self._wrap(checksums, "checksum_of", "checksum_s")

    def _wrap(self, module: Any, name: str, into: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with self._lock:
                    setattr(self, into, getattr(self, into) + time.perf_counter() - t)

        self._undo.append((module, name, original))
        setattr(module, name, timed)

    def remove(self) -> None:
        for module, name, original in self._undo:
            setattr(module, name, original)


def _count_calls(fn: Any) -> int:
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


# -- the benchmark ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> List[int]:
    """`pid` and every process below it (from /proc: torch's launcher starts its workers in new sessions)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def kill_tree(proc: subprocess.Popen) -> float:
    """SIGKILL the launched process and all its descendants at once; the time of the kill."""
    pids = descendants(proc.pid)
    killed = time.time()
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    if proc in RUNNING:
        RUNNING.remove(proc)
    return killed


class Run:
    def __init__(self, args: argparse.Namespace, nproc: int, url: str, env: Dict[str, str], work: Path) -> None:
        self.args, self.nproc, self.url, self.env, self.work = args, nproc, url, env, work

    def launch(self, resume: bool, report: str = "", count_calls: bool = False) -> subprocess.Popen:
        child_args = [str(SCRIPT), "--child", "--url", self.url, "--params", str(self.args.params),
                      "--batch", str(self.args.batch), "--save-at", str(self.args.save_at)]
        if resume:
            child_args += ["--resume", "--report", report] + (["--count-calls"] if count_calls else [])
        if self.nproc == 1:
            cmd = [sys.executable] + child_args
        else:
            cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", str(self.nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + child_args
        env = dict(self.env, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // self.nproc)))
        log = open(self.work / f"log-{uuid.uuid4().hex[:6]}.txt", "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        RUNNING.append(proc)
        return proc

    def wait_for(self, proc: subprocess.Popen, ready: Any, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: the script exited ({proc.returncode}) first; see the logs in {self.work}")
            if time.time() > deadline:
                kill_tree(proc)
                raise RuntimeError(f"{what}: nothing after {timeout:.0f} s; see the logs in {self.work}")
            time.sleep(0.01)


def published(url: str) -> Any:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    manifest = path.rstrip("/") + "/manifest.json"

    def check() -> bool:
        fs.invalidate_cache()
        return bool(fs.exists(manifest))

    return check


def run_config(args: argparse.Namespace, key: str, base_url: str, env: Dict[str, str], work: Path) -> List[Dict[str, Any]]:
    nproc, _ = CONFIGS[key]
    url = f"{base_url}/{key}-{uuid.uuid4().hex[:6]}/checkpoint_0"
    run = Run(args, nproc, url, env, work)
    proc = run.launch(resume=False)
    run.wait_for(proc, published(url), f"{key}: training until the checkpoint is published", args.timeout)
    killed = kill_tree(proc)
    results = []
    for r in range(args.repeats):
        report = str(work / f"report-{key}-{r}")
        # the last resume also counts the calls of a second load_state, after its figures were taken
        proc = run.launch(resume=True, report=report, count_calls=r == args.repeats - 1)
        files = [f"{report}.{rank}" for rank in range(nproc)]
        run.wait_for(proc, lambda: all(os.path.exists(f) for f in files), f"{key}: resume {r}", args.timeout)
        ranks = []
        for f in files:
            with open(f) as fh:
                ranks.append(json.load(fh))
        new_kill = kill_tree(proc)
        for rep in ranks:
            rep["stamps"]["killed"] = killed
        results.append({"ranks": ranks})
        killed = new_kill
    size = checkpoint_bytes(url)
    for res in results:
        res["bytes"] = size
    return results


def checkpoint_bytes(url: str) -> int:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return sum(fs.size(p) for p in fs.find(path))


def parts_of(ranks: List[Dict[str, Any]]) -> Dict[str, float]:
    rep = ranks[0]
    s = rep["stamps"]
    out = {}
    for name, a, b in PARTS:
        if a is not None:
            out[name] = s[b] - s[a]
    out["read + verify"] = rep["read_s"]
    out["apply"] = rep["load_s"] - rep["read_s"]
    out["total"] = max(r["stamps"]["stepped"] for r in ranks) - s["killed"]
    out["checksum thread"] = rep["checksum_s"]
    out["second step"] = rep.get("second_step_s", float("nan"))
    out["load cpu"] = rep.get("load_cpu_s", float("nan"))
    out["load faults"] = rep.get("load_faults", float("nan"))
    return out


def print_table(key: str, results: List[Dict[str, Any]], batch: int) -> Dict[str, Any]:
    timed = results
    calls = results[-1]["ranks"][0].get("load_state_calls")
    per = [parts_of(r["ranks"]) for r in timed]
    names = [p for p, _, _ in PARTS]
    med = {n: statistics.median(p[n] for p in per) for n in names + ["total", "checksum thread", "second step", "load cpu", "load faults"]}
    largest = max(names, key=lambda n: med[n])
    items = sorted({r["ranks"][0]["items_for_first_batch"] for r in timed})
    print(f"\n{LABELS[key]}: {timed[0]['bytes'] / MB:.1f} MB checkpoint, {len(timed)} resume(s), s (rank 0)")
    print(f"{'part':<18}{'median s':>10}{'min..max':>16}{'share':>8}")
    for n in names:
        values = [p[n] for p in per]
        print(f"{n:<18}{med[n]:>10.3f}{f'{min(values):.3f}..{max(values):.3f}':>16}{med[n] / med['total']:>8.0%}")
    totals = [p["total"] for p in per]
    print(f"{'kill -> step done':<18}{med['total']:>10.3f}{f'{min(totals):.3f}..{max(totals):.3f}':>16}")
    print(f"largest part: {largest} ({med[largest]:.3f} s, {med[largest] / med['total']:.0%})")
    print(f"the step after the first: {med['second step']:.3f} s (the first touches the optimizer state's memory "
          f"for the first time)")
    print(f"checksum threads (inside read + verify, overlapping it): {med['checksum thread']:.3f} s; "
          f"dataset items loaded for the first batch: {items} (a batch is {batch})")
    print(f"load_state's CPU seconds (all threads of the process, load-independent within noise): {med['load cpu']:.3f}; "
          f"memory touched for the first time: {med['load faults'] * PAGE / MB:.0f} MB")
    if calls is not None:
        print(f"Python calls of one load_state (a second one in the resumed process): {calls}")
    return {"key": key, "median": med, "largest": largest, "calls": calls, "items": items,
            "runs": per, "bytes": timed[0]["bytes"]}


def start_s3(env: Dict[str, str]) -> Tuple[Optional[Any], str]:
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as err:
        return None, f"S3 configurations skipped: {err.name} is not installed (pip install moto[server] s3fs)"
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    missing = str(Path(tempfile.gettempdir()) / "no-aws-config")
    env.update(S3_ENV, AWS_ENDPOINT_URL=endpoint, AWS_CONFIG_FILE=missing, AWS_SHARED_CREDENTIALS_FILE=missing)
    env.pop("AWS_PROFILE", None)
    env.pop("AWS_ENDPOINT_URL_S3", None)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    os.environ.pop("AWS_PROFILE", None)
    bucket = f"resume-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return server, f"s3://{bucket}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~5M parameters, 1 process on the local disk, 1 repeat")
    p.add_argument("--params", type=int, default=None, help="model parameters (default 100_000_000)")
    p.add_argument("--repeats", type=int, default=None, help="resumes per configuration (default 3)")
    p.add_argument("--configs", default=None, help="comma-separated of " + ",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--save-at", type=int, default=3, help="the step whose checkpoint is resumed from")
    p.add_argument("--dir", default=None, help="local checkpoint directory (default: the system temp directory)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each launch")
    p.add_argument("--json", default=None, help="write the figures to this file")
    # the training script's own flags
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count-calls", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    args.params = args.params or (5_000_000 if args.quick else 100_000_000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    keys = (args.configs or ("1-local" if args.quick else ",".join(CONFIGS))).split(",")
    width, layers = shape_for(args.params)
    print(f"resume time: {layers} x Linear({width}, {width}) = {layers * (width * width + width) / 1e6:.1f}M "
          f"parameters + AdamW, batch {args.batch}, checkpoint of step {args.save_at}, {args.repeats} resume(s) "
          f"per configuration, {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.2f}")
    work = Path(tempfile.mkdtemp(prefix="resume_time-", dir=args.dir))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    server, s3_url = (None, "")
    if any(CONFIGS[k][1] == "s3" for k in keys):
        server, s3_url = start_s3(env)
        if server is None:
            print(s3_url)
            keys = [k for k in keys if CONFIGS[k][1] != "s3"]
    summary = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for key in keys:
            base = s3_url if CONFIGS[key][1] == "s3" else str(work / "ckpt")
            summary.append(print_table(key, run_config(args, key, base, env, work), args.batch))
    finally:
        for proc in list(RUNNING):
            kill_tree(proc)
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'configuration':<26}{'kill -> step s':>15}  largest part")
    for s in summary:
        m = s["median"]
        print(f"{LABELS[s['key']]:<26}{m['total']:>15.3f}  {s['largest']} {m[s['largest']]:.3f} s "
              f"({m[s['largest']] / m['total']:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "configs": summary}, f, indent=1)


if __name__ == "__main__":
    main()
