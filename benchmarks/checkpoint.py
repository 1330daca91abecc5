"""Checkpoint save and load throughput: torch.save/torch.load by hand vs Accelerator.save_state/load_state.

One model (a stack of nn.Linear layers, ~100M fp32 parameters by default) with its AdamW state
(one optimizer step taken, so exp_avg and exp_avg_sq exist: 400 MB of weights and 800 MB of
optimizer state at 100M parameters), saved to and loaded from local disk two ways in the same
process, on the same tensors:

  raw          torch.save(model.state_dict(), a); torch.save(optimizer.state_dict(), b)
               model.load_state_dict(torch.load(a, weights_only=True)), the same for the optimizer
  fabric_lite  accelerator.save_state(dir) / accelerator.load_state(dir) after
               model, optimizer = accelerator.prepare(model, optimizer) on a plain Accelerator():
               every file checksummed (in manifest.json), written in a staging directory
               that is published by a move, and verified again on load

Timed repeats alternate between the two (raw, fabric_lite, fabric_lite, raw, ...). The table gives
MB/s (bytes on disk / seconds) and fabric_lite/raw throughput ratios; nothing passes or fails.
After the repeats, cProfile times one save and one load of each side and sorts their own time into
kinds of work (file writes, hashing, torch's record reader/writer, ...) side by side.

    python benchmarks/checkpoint.py               # 100M parameters, 5 repeats: ~1.5 minutes
    python benchmarks/checkpoint.py --quick       # ~5M parameters, 2 repeats: smoke run, ~15 s
    python benchmarks/checkpoint.py --fsync       # both sides wait until their bytes reach the disk
    python benchmarks/checkpoint.py --cold-load   # evict the files from the page cache before each load
    python benchmarks/checkpoint.py --blocked     # time the training thread waits per save: sync vs blocking=False
    python benchmarks/checkpoint.py --blocked --strategy fsdp               # the same, sharded, on 2 processes
    python benchmarks/checkpoint.py --blocked --strategy deepspeed_stage_3  # DeepSpeed ZeRO-3 on 2 processes

Target (from the issue): fabric_lite >= 0.9x raw throughput, save and load.

--blocked measures something else: how long one save holds up the training thread (from the call to
its return), for trainer_overhead.py's tiny MLP (32 -> 64 -> 10, AdamW) and for the --params model
(100M by default), three ways interleaved: raw torch.save of both state dicts, save_state(dir) and
save_state(dir, blocking=False) (the background save is waited for, untimed, before the next round).
It prints blocked-time ratios (goal from the issue: async < 0.1x sync), the CPU seconds, Python calls
and fresh memory of the blocked call (which load does not move), the background write's duration and
the snapshot buffers' size (checkpoint_saver.snapshot_bytes).

--blocked --strategy fsdp|deepspeed_stage_3 (--nproc, default 2) does it for a sharded checkpoint: --nproc
processes (gloo on CPU; one GPU each where there are enough) train the --params model (a stack of Linear
layers, each its own FSDP unit) and save it, interleaved, with save_state(dir) and save_state(dir,
blocking=False), every process timing its own training thread. After each background save the processes keep
training until it is published (every process agreeing, step by step), and the steps per second over that time,
against those of steps with no save running, give the throughput lost while the write runs. Goal (issue 34):
background blocked < 15 % of blocking blocked. The first background save (host buffers allocated, the side
process group started, DCP's plan made) is reported apart.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import json
import math
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from fabric_lite import Accelerator  # noqa: E402

RAW, FRAMEWORK = "raw", "fabric_lite"
MODES = (RAW, FRAMEWORK)
OPS = ("save", "load")
TARGET = 0.9  # fabric_lite / raw throughput
MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the model -------------------------------------------------------------------------------------
def shape_for(params: int) -> Tuple[int, int]:
    """(width, layers) of a stack of Linear(width, width) holding about `params` parameters."""
    width = min(4096, max(64, 2 ** int(math.log2(math.sqrt(max(params, 1) / 4)))))
    layers = max(1, round(params / (width * width + width)))
    return width, layers


def trained_model(params: int) -> Tuple[nn.Module, torch.optim.Optimizer, int]:
    """The model and an AdamW that has taken one step (so its state holds exp_avg and exp_avg_sq)."""
    width, layers = shape_for(params)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # gradients are not part of a checkpoint: free them
    return model, optimizer, sum(p.numel() for p in model.parameters())


class Side:
    """One way of checkpointing: save(dir) and load(dir), and the files a save leaves in dir."""

    def __init__(self, name: str, save: Callable[[Path], None], load: Callable[[Path], None]):
        self.name, self.save, self.load = name, save, load


def raw_side(model: nn.Module, optimizer: torch.optim.Optimizer, fsync: bool) -> Side:
    def save(d: Path) -> None:
        d.mkdir()
        torch.save(model.state_dict(), d / "model.pt")
        torch.save(optimizer.state_dict(), d / "optimizer.pt")
        if fsync:
            for p in (d / "model.pt", d / "optimizer.pt", d):  # the files, then the directory entry
                fsync_path(p)

    def load(d: Path) -> None:
        model.load_state_dict(torch.load(d / "model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))

    return Side(RAW, save, load)


def framework_side(accelerator: Accelerator, fsync: bool) -> Side:
    def save(d: Path) -> None:
        accelerator.save_state(d)
        if fsync:
            os.sync()  # save_state does not fsync; this flushes every dirty page on the machine

    def load(d: Path) -> None:
        accelerator.load_state(d)

    return Side(FRAMEWORK, save, load)


def build_sides(params: int, fsync: bool) -> Tuple[Dict[str, Side], int, Dict[str, int]]:
    model, optimizer, n = trained_model(params)
    accelerator = Accelerator()
    # prepare() wraps the optimizer (and would wrap the model for DDP or mixed precision); the raw
    # side keeps the user's objects, so both sides serialize the very same tensors.
    _prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    sizes = {"weights": sum(p.numel() * p.element_size() for p in model.parameters()), "optimizer_state": state_bytes}
    del prepared_optimizer
    return {RAW: raw_side(model, optimizer, fsync), FRAMEWORK: framework_side(accelerator, fsync)}, n, sizes


# -- files and the page cache ----------------------------------------------------------------------
def files_under(d: Path) -> List[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def bytes_under(d: Path) -> int:
    return sum(p.stat().st_size for p in files_under(d))


def fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(d: Path) -> None:
    """Write the files' pages out and drop them from the page cache (no root needed: posix_fadvise)."""
    for p in files_under(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_fraction(d: Path) -> Optional[float]:
    """Share of the bytes under `d` that sit in the page cache (mincore), or None where that fails."""
    try:
        libc = _libc()
        page = PAGE
        resident = total = 0
        for p in files_under(d):
            size = p.stat().st_size
            if size == 0:
                continue
            pages = (size + page - 1) // page
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(b & 1 for b in bytes(vec))
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
            total += pages
        return resident / total if total else None
    except (OSError, AttributeError):
        return None


# -- timing ----------------------------------------------------------------------------------------
def settle() -> None:
    """Before every timed operation: no garbage, no dirty pages left by the previous one."""
    gc.collect()
    os.sync()


def measured(op: str, fn: Callable[[], None]) -> Dict[str, float]:
    """Wall seconds, the process's user and sys CPU seconds (all threads) and minor page faults of fn()."""
    r0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, r1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {f"{op}_s": wall, f"{op}_user_s": r1.ru_utime - r0.ru_utime, f"{op}_sys_s": r1.ru_stime - r0.ru_stime,
            f"{op}_minflt": r1.ru_minflt - r0.ru_minflt}


def one_round(side: Side, root: Path, cold_load: bool) -> Dict[str, float]:
    d = root / side.name
    if d.exists():
        shutil.rmtree(d)  # each save writes fresh files (and fabric_lite has no old checkpoint to replace)
    settle()
    out = measured("save", lambda: side.save(d))
    out["bytes"] = bytes_under(d)
    if cold_load:
        evict(d)
    settle()
    out["resident_before_load"] = resident_fraction(d)
    out.update(measured("load", lambda: side.load(d)))
    return out


def time_interleaved(sides: Dict[str, Side], root: Path, repeats: int, cold_load: bool) -> Dict[str, List[dict]]:
    runs: Dict[str, List[dict]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in MODES if r % 2 == 0 else MODES[::-1]:
            runs[name].append(one_round(sides[name], root, cold_load))
    return runs


# -- cProfile --------------------------------------------------------------------------------------
def label(key: Tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    path = filename.replace(os.sep, "/")
    for anchor in ("/fabric_lite/", "/torch/", "/fsspec/", "/benchmarks/", "/lib/python"):
        if anchor in path:
            path = path[path.index(anchor) + 1:]
            break
    return f"{path}:{line}({func})"


def profile(fn: Callable[[], None]) -> Tuple[float, dict]:
    settle()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # key -> (primitive calls, calls, tottime, cumtime, callers)
    return wall, {k: v for k, v in stats.items() if "_lsprof.Profiler" not in k[2]}


def top(stats: dict, column: int, n: int) -> List[Tuple[float, int, str]]:
    rows = sorted(stats.items(), key=lambda kv: -kv[1][column])[:n]
    return [(v[column], v[1], label(k)) for k, v in rows]


# Own time (cProfile's tottime) sorted into kinds of work. Own times add up to the profiled wall time,
# so the split is complete whatever the implementation calls. cProfile sees only the calling thread:
# work on a helper thread shows as time waiting for it (lock acquire).
KINDS: List[Tuple[str, Tuple[str, ...]]] = [
    ("file writes (write syscalls into the page cache)", ("<method 'write' of '_io.", "<built-in method posix.write>")),
    ("file reads", ("<method 'read' of '_io.", "<method 'readinto' of '_io.", "<built-in method posix.read>")),
    ("sha256 on the calling thread", ("_hashlib.",)),
    ("handing work to / waiting for a helper thread (hashing there)",
     ("<method 'acquire' of '_thread.", "<method 'put' of '_queue.")),
    ("torch.save records (write_record: CRC32 + copy; to a path it also writes)", ("torch._C.write_record",)),
    ("torch.load records (get_storage_from_record: read/copy into new tensors)", ("torch._C.get_storage_from_record",)),
    ("copies into the model's parameters (copy_)", ("<method 'copy_' of",)),
    ("file system calls (open, close, rename, mkdir, stat, fsync, sync)",
     ("<built-in method io.open>", "<method 'close' of '_io.", "<method '__exit__' of '_io.", "posix.rename",
      "posix.replace", "posix.mkdir", "posix.stat", "posix.lstat", "posix.fsync", "posix.sync", "posix.open",
      "posix.scandir", "posix.listdir", "posix.remove", "posix.unlink", "posix.rmdir")),
]
OTHER = "everything else (Python: pickling, state dicts, fsspec, bookkeeping)"


def split_by_kind(stats: dict) -> Dict[str, float]:
    out = {kind: 0.0 for kind, _ in KINDS}
    out[OTHER] = 0.0
    for key, v in stats.items():
        name = label(key)
        kind = next((k for k, needles in KINDS if any(n in name for n in needles)), OTHER)
        out[kind] += v[2]
    return out


# -- peak memory, one child process per mode -------------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS, Linux >= 4.0
        return True
    except OSError:
        return False


def memory_child(mode: str, params: int, root: Path, fsync: bool) -> None:
    sides, _, _ = build_sides(params, fsync)
    side, d = sides[mode], root / f"mem_{mode}"
    out: Dict[str, Optional[float]] = {}
    for op in OPS:
        settle()
        before = _status_kib("VmRSS")
        if before is None or not _reset_peak():
            out[f"{op}_peak_extra_mb"] = None
            getattr(side, op)(d)
            continue
        getattr(side, op)(d)
        peak = _status_kib("VmHWM")
        out[f"{op}_peak_extra_mb"] = (peak - before) * 1024 / MB if peak is not None else None
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(out))


def peak_memory(params: int, root: Path, fsync: bool) -> Dict[str, Dict[str, Optional[float]]]:
    result = {}
    for mode in MODES:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_memory-child", mode,
               "--params", str(params), "--dir", str(root)] + (["--fsync"] if fsync else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"memory child ({mode}) failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            result[mode] = {f"{op}_peak_extra_mb": None for op in OPS}
            continue
        result[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- report ----------------------------------------------------------------------------------------
def pick_dir(requested: Optional[Path]) -> Path:
    d = requested or Path(tempfile.gettempdir())
    if os.stat(d).st_dev != os.stat(REPO).st_dev:
        print(f"note: {d} is not on the repository's filesystem", file=sys.stderr)
    return d


def filesystem_of(d: Path) -> str:
    try:
        best = ("?", "?", -1)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if str(d.resolve()).startswith(mnt.rstrip("/") + "/") or str(d.resolve()) == mnt:
                    if len(mnt) > best[2]:
                        best = (dev, fstype, len(mnt))
        return f"{best[0]} ({best[1]})"
    except OSError:
        return "?"


def fmt_pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


# -- --blocked: how long one save holds up the training thread -------------------------------------
SYNC, ASYNC = "sync", "async"
BLOCKED_KINDS = (RAW, SYNC, ASYNC)  # torch.save by hand; save_state(dir); save_state(dir, blocking=False)
BLOCKED_GOAL = 0.1  # the goal: blocked(async) < 10 % of blocked(sync); a figure to read, not a check


def tiny_trained_model() -> Tuple[nn.Module, torch.optim.Optimizer, int, str]:
    """The tiny MLP of overhead.py / trainer_overhead.py (32 -> 64 -> 10), AdamW after one step."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from overhead import SPECS, build_mlp

    spec = SPECS["tiny"]
    torch.manual_seed(0)
    model = build_mlp(spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(spec.batch, spec.sizes[0])).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, sum(p.numel() for p in model.parameters()), "MLP " + " -> ".join(map(str, spec.sizes))


class BlockedCase:
    """One model and its AdamW, saved three ways: raw torch.save, save_state blocking and in the background."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, n: int, desc: str) -> None:
        self.name, self.desc, self.n = name, desc, n
        self.accelerator = Accelerator()
        self.accelerator.prepare(model, optimizer)  # the raw side saves the user's objects: the same tensors
        self.raw = raw_side(model, optimizer, fsync=False)

    def call(self, kind: str, d: Path) -> Callable[[], None]:
        if kind == RAW:
            return lambda: self.raw.save(d)
        return lambda: self.accelerator.save_state(str(d), blocking=kind == SYNC)

    def round(self, kind: str, root: Path) -> Dict[str, float]:
        """One timed save of this kind: blocked seconds, CPU and fresh memory of the call; for async, the
        background write (waited for after the timing, so saves never queue)."""
        d = root / f"{self.name}_{kind}"
        if d.exists():
            shutil.rmtree(d)
        settle()
        out = measured("blocked", self.call(kind, d))
        if kind == ASYNC:
            saver = self.accelerator.checkpoint_saver
            record = saver.history[-1]
            self.accelerator.wait_for_checkpoint()
            out["background_s"] = record.finished - (record.started + record.blocked)  # the thread's run
            out["published_after_s"] = record.finished - record.started  # call to checkpoint published
            out["saver_blocked_s"] = record.blocked
            out["snapshot_bytes"] = saver.snapshot_bytes
        out["bytes"] = bytes_under(d)
        shutil.rmtree(d)
        return out

    def calls(self, kind: str, root: Path) -> int:
        """Python and C function calls the training thread makes during one save."""
        d = root / f"{self.name}_{kind}_counted"
        settle()
        n = thread_calls(self.call(kind, d))
        if kind == ASYNC:
            self.accelerator.wait_for_checkpoint()
        shutil.rmtree(d)
        return n

    def profiled(self, kind: str, root: Path) -> dict:
        """cProfile's stats of one save call (from Python 3.12 on they include other threads' calls too)."""
        d = root / f"{self.name}_{kind}_profiled"
        _, stats = profile(self.call(kind, d))
        if kind == ASYNC:
            self.accelerator.wait_for_checkpoint()
        shutil.rmtree(d)
        return stats

    def close(self) -> None:
        self.accelerator.wait_for_checkpoint()
        self.accelerator.checkpoint_saver.close()


def thread_calls(fn: Callable[[], None]) -> int:
    """Python and C function calls made by this thread while fn() runs. sys.setprofile hooks the calling
    thread only (threads started meanwhile are not followed), whereas cProfile sees every thread from
    Python 3.12 on."""
    count = 0

    def hook(frame, event, arg) -> None:
        nonlocal count
        if event == "call" or event == "c_call":
            count += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def med_range(xs: List[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    return f"{statistics.median(xs) * scale:{fmt}} [{min(xs) * scale:{fmt}}..{max(xs) * scale:{fmt}}]"


def measure_blocked(case: BlockedCase, root: Path, repeats: int, warmup: int) -> dict:
    first_async: Optional[Dict[str, float]] = None
    for _ in range(max(warmup, 1)):  # the first background save allocates the snapshot buffers: kept apart
        for kind in BLOCKED_KINDS:
            r = case.round(kind, root)
            if kind == ASYNC and first_async is None:
                first_async = r
    runs: Dict[str, List[dict]] = {kind: [] for kind in BLOCKED_KINDS}
    for r in range(repeats):
        for kind in BLOCKED_KINDS if r % 2 == 0 else BLOCKED_KINDS[::-1]:
            runs[kind].append(case.round(kind, root))
    calls = {kind: case.calls(kind, root) for kind in BLOCKED_KINDS}
    return {"runs": runs, "first_async": first_async, "calls": calls, "async_stats": case.profiled(ASYNC, root)}


def report_blocked(cases: List[BlockedCase], results: Dict[str, dict], top_n: int) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    width = max(len(c.name) for c in cases) + 2
    for case in cases:
        res = results[case.name]
        runs = res["runs"]
        col = {kind: {key: [r[key] for r in runs[kind]] for key in runs[kind][0]} for kind in BLOCKED_KINDS}
        med = {kind: {key: statistics.median(v) for key, v in col[kind].items()} for kind in BLOCKED_KINDS}
        paired = [a / s for a, s in zip(col[ASYNC]["blocked_s"], col[SYNC]["blocked_s"])]
        cpu = {kind: [u + k for u, k in zip(col[kind]["blocked_user_s"], col[kind]["blocked_sys_s"])]
               for kind in BLOCKED_KINDS}
        out[case.name] = {
            "params": case.n, "model": case.desc, "repeats": len(runs[SYNC]),
            "blocked_s": {kind: col[kind]["blocked_s"] for kind in BLOCKED_KINDS},
            "median_blocked_s": {kind: med[kind]["blocked_s"] for kind in BLOCKED_KINDS},
            "async_over_sync": med[ASYNC]["blocked_s"] / med[SYNC]["blocked_s"], "async_over_sync_paired": paired,
            "sync_over_raw": med[SYNC]["blocked_s"] / med[RAW]["blocked_s"],
            "async_over_raw": med[ASYNC]["blocked_s"] / med[RAW]["blocked_s"],
            "first_async_blocked_s": res["first_async"]["blocked_s"],
            "first_async_fault_mb": res["first_async"]["blocked_minflt"] * PAGE / MB,
            "median_cpu_s": {kind: statistics.median(cpu[kind]) for kind in BLOCKED_KINDS},
            "calls": res["calls"],
            "median_fault_mb": {kind: med[kind]["blocked_minflt"] * PAGE / MB for kind in BLOCKED_KINDS},
            "background_s": col[ASYNC]["background_s"], "published_after_s": col[ASYNC]["published_after_s"],
            "saver_blocked_s": col[ASYNC]["saver_blocked_s"],
            "snapshot_bytes": runs[ASYNC][-1]["snapshot_bytes"], "bytes_on_disk": med[SYNC]["bytes"],
        }
        out[case.name]["_col"] = col  # for the tables below; dropped before --json

    print("\nblocked per save: the training thread, from the call to its return; ms, median [min..max]")
    print(f"{'model':<{width}}{'MB on disk':>10} {'raw ms':>22} {'sync ms':>24} {'async ms':>22} "
          f"{'first async ms':>14}")
    for case in cases:
        o, col = out[case.name], out[case.name]["_col"]
        print(f"{case.name:<{width}}{o['bytes_on_disk'] / MB:>10.1f} {med_range(col[RAW]['blocked_s'], 1e3):>22} "
              f"{med_range(col[SYNC]['blocked_s'], 1e3):>24} {med_range(col[ASYNC]['blocked_s'], 1e3):>22} "
              f"{o['first_async_blocked_s'] * 1e3:>14.2f}")
    print(f"\n{'model':<{width}}{'async/sync':>10} {'paired: median [min..max]':>26} {'goal':>6} "
          f"{'sync/raw':>9} {'async/raw':>9}")
    for case in cases:
        o = out[case.name]
        pp = o["async_over_sync_paired"]
        print(f"{case.name:<{width}}{o['async_over_sync']:>10.3f} "
              f"{f'{statistics.median(pp):.3f} [{min(pp):.3f}..{max(pp):.3f}]':>26} {'<' + str(BLOCKED_GOAL):>6} "
              f"{o['sync_over_raw']:>9.3f} {o['async_over_raw']:>9.3f}")

    print("\nwork of the blocked call, which load on the machine does not move (calls, fresh memory) or moves "
          "little (CPU):")
    print(f"{'model':<{width}}{'CPU s raw':>10} {'sync':>7} {'async':>7} {'async/sync':>10}   "
          f"{'calls raw':>9} {'sync':>7} {'async':>7} {'async/sync':>10}   {'faults MB raw':>13} {'sync':>6} "
          f"{'async':>6}")
    for case in cases:
        o = out[case.name]
        c, f, k = o["median_cpu_s"], o["median_fault_mb"], o["calls"]
        print(f"{case.name:<{width}}{c[RAW]:>10.4f} {c[SYNC]:>7.4f} {c[ASYNC]:>7.4f} "
              f"{c[ASYNC] / c[SYNC] if c[SYNC] else float('nan'):>10.3f}   {k[RAW]:>9d} {k[SYNC]:>7d} {k[ASYNC]:>7d} "
              f"{k[ASYNC] / k[SYNC]:>10.3f}   {f[RAW]:>13.1f} {f[SYNC]:>6.1f} {f[ASYNC]:>6.1f}")

    print("\nthe background save (async): its thread's run (write, checksums, publish), ms, median [min..max]")
    print(f"{'model':<{width}}{'background ms':>24} {'published after ms':>24} {'/ sync blocked':>14} "
          f"{'snapshot MB':>11} {'first-save faults MB':>20}")
    for case in cases:
        o, col = out[case.name], out[case.name]["_col"]
        pub = statistics.median(o["published_after_s"]) / o["median_blocked_s"][SYNC]
        print(f"{case.name:<{width}}{med_range(o['background_s'], 1e3):>24} "
              f"{med_range(o['published_after_s'], 1e3):>24} {pub:>14.3f} {o['snapshot_bytes'] / MB:>11.1f} "
              f"{o['first_async_fault_mb']:>20.1f}")

    for case in cases:
        print(f"\ncProfile: one background save_state({case.name}) call -- top {top_n} by own time"
              + (" (Python >= 3.12: the background thread's first moments count too)"
                 if sys.version_info >= (3, 12) else ""))
        for t, n_calls, fn in top(results[case.name]["async_stats"], 2, top_n):
            print(f"{t * 1e3:8.2f} ms {n_calls:7d}  {fn}")

    print("\n" + "\n".join(f"{c.name} = {c.desc} ({c.n / 1e6:.2f}M parameters) + AdamW state" for c in cases))
    print("raw = torch.save(model.state_dict()) and torch.save(optimizer.state_dict()) by hand;\n"
          "sync = save_state(dir); async = save_state(dir, blocking=False): a snapshot into reused host buffers\n"
          "on the training thread, the write on a thread of its own (waited for, untimed, before the next save).\n"
          "Rounds alternate "
          "(raw, sync, async, async, sync, raw, ...), each after gc.collect() and os.sync(); the warm-up\n"
          "rounds are left out, and the first async save (which allocates the snapshot buffers) is shown apart.\n"
          "async/sync = median blocked ms; paired = per-round ratios. CPU s = the process's user+sys seconds\n"
          "during the call (all threads: sync's checksum helper counts); calls = Python and C function calls\n"
          "of the training thread (sys.setprofile, one save); faults MB = minor page faults x page size in the call.\n"
          "background = the save's own thread from its start to the publish; published after = from the call\n"
          "to the publish; snapshot MB = checkpoint_saver.snapshot_bytes (host memory kept between saves).")
    for o in out.values():
        del o["_col"]
    return out


def run_blocked(args: argparse.Namespace, params: int, base: Path) -> None:
    t_all, load_before = time.perf_counter(), os.getloadavg()
    big_repeats = args.repeats or (2 if args.quick else 5)
    tiny_repeats = args.tiny_repeats or (5 if args.quick else 20)
    print(f"fabric_lite checkpoint --blocked: training-thread time per save, raw torch.save vs save_state vs "
          f"save_state(blocking=False) | torch {torch.__version__} | {torch.get_num_threads()} thread(s) | "
          f"interleaved repeats: tiny {tiny_repeats}, large {big_repeats}" + (" | QUICK" if args.quick else ""),
          flush=True)
    results: Dict[str, dict] = {}
    cases: List[BlockedCase] = []
    with tempfile.TemporaryDirectory(prefix="fabric_lite_ckpt_blocked_", dir=base) as tmp:
        root = Path(tmp)
        print(f"writing under {root} on {filesystem_of(root)}", flush=True)
        def large() -> Tuple[nn.Module, torch.optim.Optimizer, int, str]:
            model, optimizer, n = trained_model(params)
            width, layers = shape_for(params)
            return model, optimizer, n, f"{layers} x Linear({width}, {width})"

        for name, build, repeats in (("tiny", tiny_trained_model, tiny_repeats),
                                     (f"{params / 1e6:.0f}M", large, big_repeats)):
            case = BlockedCase(name, *build())
            t0 = time.perf_counter()
            results[name] = measure_blocked(case, root, repeats, args.warmup)
            print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
            case.close()
            cases.append(case)
        summary = report_blocked(cases, results, min(args.top, 6))
    load_after = os.getloadavg()
    print(f"\n(total {time.perf_counter() - t_all:.0f} s; 1-min load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps({"mode": "blocked", "torch": torch.__version__, "models": summary,
                                         "loadavg_before_after": [load_before, load_after]}, indent=2))


# -- --blocked --strategy: sharded checkpoints on several processes ------------------------------------------
SHARDED_GOAL = 0.15  # issue 34: a background sharded save blocks training for < 15 % of a blocking one


def _sharded_accelerator(strategy: str, params: int) -> Tuple[Accelerator, nn.Module, torch.optim.Optimizer, int]:
    from fabric_lite import FSDPStrategy

    width, layers = shape_for(params)
    acc = Accelerator(strategy=FSDPStrategy(auto_wrap_policy={"Linear"}) if strategy == "fsdp" else strategy)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer, n


def sharded_child(args: argparse.Namespace, params: int, root: Path) -> None:
    """One process of --blocked --strategy: its own timings, in rank<r>.json under `root`."""
    acc, model, optimizer, n = _sharded_accelerator(args.strategy, params)
    width, _ = shape_for(params)
    x = torch.randn(8, width, device=acc.device)
    saver = acc.checkpoint_saver

    def train_step() -> None:
        acc.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    def barrier() -> None:
        acc.wait_for_everyone()

    train_step()  # the optimizer's state exists
    baseline = []
    for _ in range(3 if args.quick else 5):
        barrier()
        t = time.perf_counter()
        train_step()
        baseline.append(time.perf_counter() - t)
    step_s = statistics.median(baseline)
    rounds: List[Dict[str, float]] = []
    repeats = args.repeats or (2 if args.quick else 4)
    for i in range(repeats + 1):  # round 0: the first background save, apart
        for kind in ((ASYNC, SYNC) if i % 2 else (SYNC, ASYNC)):
            d = root / f"{kind}_{i}"
            barrier()
            t = time.perf_counter()
            acc.save_state(str(d), blocking=kind == SYNC)
            out: Dict[str, float] = {"round": i, "sync": kind == SYNC, "blocked_s": time.perf_counter() - t}
            if kind == ASYNC:
                steps, t0 = 0, time.perf_counter()
                while True:  # train while the write runs; every process stops at the same step
                    train_step()
                    steps += 1
                    if not saver.busy_anywhere():
                        break
                during = time.perf_counter() - t0
                record = saver.history[-1]
                acc.wait_for_checkpoint()
                out.update(steps_during=steps, during_s=during, write_s=record.finished - record.started - record.blocked,
                           lost=max(0.0, 1 - (steps / during) * step_s), snapshot_mb=saver.snapshot_bytes / MB)
            barrier()
            if acc.is_main_process:
                out["bytes"] = bytes_under(d)
                shutil.rmtree(d)
            barrier()
            rounds.append(out)
    acc.end_training()
    (root / f"rank{acc.process_index}.json").write_text(json.dumps({"params": n, "step_s": step_s,
                                                                    "rounds": rounds}))


def run_blocked_sharded(args: argparse.Namespace, params: int, base: Path) -> None:
    import socket

    width, layers = shape_for(params)
    print(f"fabric_lite checkpoint --blocked --strategy {args.strategy}: training-thread time per save on "
          f"{args.nproc} processes, save_state vs save_state(blocking=False) | torch {torch.__version__} | "
          f"{layers} x Linear({width}, {width})" + (" | QUICK" if args.quick else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="fabric_lite_ckpt_sharded_", dir=base) as tmp:
        root = Path(tmp)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for rank in range(args.nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                       LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
                env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
            cmd = [sys.executable, __file__, "--blocked", "--strategy", args.strategy, "--params", str(params),
                   "--_sharded-child", str(root)] + (["--quick"] if args.quick else []) + \
                  (["--repeats", str(args.repeats)] if args.repeats else [])
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a benchmark process failed: exit codes {codes}")
        ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    # per round, a save holds training up for as long as its slowest process is held
    rounds = [[r["rounds"][i] for r in ranks] for i in range(len(ranks[0]["rounds"]))]
    first = next(max(x["blocked_s"] for x in rnd) for rnd in rounds if rnd[0]["round"] == 0 and not rnd[0]["sync"])
    sync = [max(x["blocked_s"] for x in rnd) for rnd in rounds if rnd[0]["round"] > 0 and rnd[0]["sync"]]
    bg = [rnd for rnd in rounds if rnd[0]["round"] > 0 and not rnd[0]["sync"]]
    blocked = [max(x["blocked_s"] for x in rnd) for rnd in bg]
    write = [max(x["write_s"] for x in rnd) for rnd in bg]
    lost = [statistics.mean(x["lost"] for x in rnd) for rnd in bg]
    step_s = max(r["step_s"] for r in ranks)
    ratio = statistics.median(blocked) / statistics.median(sync)
    size = next(x.get("bytes", 0) for rnd in bg for x in rnd if "bytes" in x)
    print(f"\n{ranks[0]['params'] / 1e6:.1f}M parameters, {size / MB:.0f} MB on disk per checkpoint; training step "
          f"{step_s * 1e3:.0f} ms; ms, median [min..max] over {len(sync)} round(s), the slowest process of each")
    print(f"  blocking save_state:          {med_range(sync, 1e3)}")
    print(f"  save_state(blocking=False):   {med_range(blocked, 1e3)}   (first one: {first * 1e3:.0f})")
    print(f"  background write:             {med_range(write, 1e3)}")
    print(f"  blocked, background / blocking: {ratio * 100:.1f} %  (goal < {SHARDED_GOAL * 100:.0f} %: "
          f"{'met' if ratio < SHARDED_GOAL else 'not met'})")
    print(f"  throughput lost while the write runs: {statistics.median(lost) * 100:.1f} % "
          f"(steps/s during the write vs without; {statistics.median([rnd[0]['steps_during'] for rnd in bg])} "
          f"step(s) per write)")
    print(f"  host snapshot buffers per process: {max(x['snapshot_mb'] for rnd in bg for x in rnd):.0f} MB")
    if args.json:
        args.json.write_text(json.dumps({"mode": "blocked_sharded", "strategy": args.strategy, "nproc": args.nproc,
                                         "ratio": ratio, "sync_s": sync, "background_s": blocked, "first_s": first,
                                         "write_s": write, "lost": lost, "step_s": step_s, "ranks": ranks}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, help="model parameters (default 100_000_000; 5_000_000 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed save+load repeats of each side (default 5; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed save+load rounds of each side first (default 1)")
    parser.add_argument("--quick", action="store_true", help="small model, 2 repeats: checks that the script works")
    parser.add_argument("--fsync", action="store_true",
                        help="saves end when the bytes are on disk: raw fsyncs its two files and the directory, "
                             "fabric_lite calls os.sync() after save_state (both inside the timing)")
    parser.add_argument("--cold-load", action="store_true",
                        help="before each timed load, drop that checkpoint's files from the page cache "
                             "(fsync + posix_fadvise DONTNEED, untimed)")
    parser.add_argument("--dir", type=Path, help="where to write (default: the system temp directory)")
    parser.add_argument("--top", type=int, default=8, help="functions listed per cProfile table (default 8)")
    parser.add_argument("--profile-raw", action="store_true",
                        help="also list raw's top functions (its split by kind is always printed)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--blocked", action="store_true",
                        help="instead: the training thread's time per save, raw torch.save vs save_state vs "
                             "save_state(blocking=False), for the tiny MLP and the --params model "
                             "(--repeats applies to the latter)")
    parser.add_argument("--tiny-repeats", type=int,
                        help="with --blocked: interleaved repeats for the tiny MLP (default 20; 5 with --quick)")
    parser.add_argument("--strategy", choices=("fsdp", "deepspeed_stage_3", "deepspeed_stage_2"),
                        help="with --blocked: a sharded checkpoint of this strategy on --nproc processes")
    parser.add_argument("--nproc", type=int, default=2, help="with --strategy: processes (default 2)")
    parser.add_argument("--_sharded-child", dest="sharded_child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_memory-child", dest="memory_child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    params = args.params or (5_000_000 if args.quick else 100_000_000)
    repeats = args.repeats or (2 if args.quick else 5)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    base = pick_dir(args.dir)

    if args.memory_child:
        memory_child(args.memory_child, params, base, args.fsync)
        return
    if args.sharded_child:
        sharded_child(args, params, args.sharded_child)
        return
    if args.strategy and not args.blocked:
        parser.error("--strategy applies to --blocked")
    if args.blocked:
        if args.fsync or args.cold_load:
            parser.error("--blocked times the call to save_state only: --fsync and --cold-load do not apply")
        if args.strategy:
            run_blocked_sharded(args, params, base)
            return
        run_blocked(args, params, base)
        return

    t_all, load_before = time.perf_counter(), os.getloadavg()
    sides, n, sizes = build_sides(params, args.fsync)
    width, layers = shape_for(params)
    print(f"fabric_lite checkpoint throughput: raw torch.save/torch.load vs Accelerator.save_state/load_state | "
          f"torch {torch.__version__} | {n / 1e6:.1f}M params ({layers} x Linear({width}, {width})): "
          f"{sizes['weights'] / MB:.0f} MB weights + {sizes['optimizer_state'] / MB:.0f} MB AdamW state | "
          f"{repeats} interleaved repeats" + (" | --fsync" if args.fsync else "") +
          (" | --cold-load" if args.cold_load else "") + (" | QUICK" if args.quick else ""), flush=True)

    with tempfile.TemporaryDirectory(prefix="fabric_lite_ckpt_bench_", dir=base) as tmp:
        root = Path(tmp)
        print(f"writing under {root} on {filesystem_of(root)}", flush=True)
        for _ in range(args.warmup):
            for name in MODES:
                one_round(sides[name], root, args.cold_load)
        t0 = time.perf_counter()
        runs = time_interleaved(sides, root, repeats, args.cold_load)
        timing_s = time.perf_counter() - t0
        profiles: Dict[str, Dict[str, Tuple[float, dict]]] = {}

        # where the time goes: one save and one load of each side under cProfile, run as a timed round is
        for name in MODES:
            d = root / name
            if d.exists():
                shutil.rmtree(d)
            profiles[name] = {"save": profile(lambda: sides[name].save(d))}
            if args.cold_load:
                evict(d)
            profiles[name]["load"] = profile(lambda: sides[name].load(d))
        for d in root.iterdir():
            shutil.rmtree(d)
        memory = None if args.no_memory else peak_memory(params, root, args.fsync)

    # -- figures
    results: Dict[str, dict] = {"params": n, "width": width, "layers": layers, "repeats": repeats,
                                "fsync": args.fsync, "cold_load": args.cold_load, "torch": torch.__version__,
                                "threads": torch.get_num_threads(), "sizes": sizes, "timing_seconds": timing_s,
                                "runs": runs, "ops": {}}
    print()
    print(f"{'op':4} {'side':12} {'MB on disk':>10} {'median MB/s':>11} {'min':>7} {'max':>7} "
          f"{'median s':>9} {'user s':>6} {'sys s':>6} {'faults MB':>9} {'in cache':>8}")
    for op in OPS:
        for name in MODES:
            rs = runs[name]
            mbps = [r["bytes"] / MB / r[f"{op}_s"] for r in rs]
            secs = [r[f"{op}_s"] for r in rs]
            users, syss = [r[f"{op}_user_s"] for r in rs], [r[f"{op}_sys_s"] for r in rs]
            cpus = [u + k for u, k in zip(users, syss)]
            faults = [r[f"{op}_minflt"] * PAGE / MB for r in rs]
            cached = [r["resident_before_load"] for r in rs]
            cache_s = "-" if op == "save" else (fmt_pct(statistics.median(cached)) if None not in cached else "n/a")
            results["ops"].setdefault(op, {})[name] = {
                "mb_per_s": mbps, "seconds": secs, "median_mb_per_s": statistics.median(mbps),
                "median_s": statistics.median(secs), "cpu_s": cpus, "median_cpu_s": statistics.median(cpus),
                "median_user_s": statistics.median(users), "median_sys_s": statistics.median(syss),
                "median_fault_mb": statistics.median(faults), "bytes": statistics.median(r["bytes"] for r in rs)}
            print(f"{op:4} {name:12} {rs[0]['bytes'] / MB:10.1f} {statistics.median(mbps):11.0f} {min(mbps):7.0f} "
                  f"{max(mbps):7.0f} {statistics.median(secs):9.3f} {statistics.median(users):6.2f} "
                  f"{statistics.median(syss):6.2f} {statistics.median(faults):9.0f} {cache_s:>8}")
    print()
    print(f"{'op':4} {'ratio':>6} {'of bests':>8} {'paired: median [min..max]':>26} {'CPU ratio':>9} {'target':>7}")
    for op in OPS:
        fw, raw = results["ops"][op][FRAMEWORK], results["ops"][op][RAW]
        paired = [f / r for f, r in zip(fw["mb_per_s"], raw["mb_per_s"])]
        ratio = fw["median_mb_per_s"] / raw["median_mb_per_s"]
        cpu_ratio = fw["median_cpu_s"] / raw["median_cpu_s"]
        results["ops"][op].update(ratio=ratio, ratio_of_bests=max(fw["mb_per_s"]) / max(raw["mb_per_s"]),
                                  ratio_paired=paired, cpu_ratio=cpu_ratio)
        verdict = "met" if ratio >= TARGET else "not met"
        pp = f"{statistics.median(paired):.3f} [{min(paired):.3f}..{max(paired):.3f}]"
        print(f"{op:4} {ratio:6.3f} {results['ops'][op]['ratio_of_bests']:8.3f} {pp:>26} {cpu_ratio:9.2f} "
              f"{'>=' + str(TARGET):>7} {verdict}")
    print("\nratio = median(fabric_lite MB/s) / median(raw MB/s); of bests = the same with each side's fastest\n"
          "repeat; paired = per-repeat ratios of back-to-back runs. MB = 10^6 bytes on disk (each side's own files).\n"
          "user s, sys s = the process's CPU seconds (all threads; sys = the kernel: page-cache copies, page faults),\n"
          "medians. faults MB = minor page faults x page size: memory the operation touched for the first time\n"
          "(buffers, new tensors); it does not move with load. in cache = share of the files in the page cache\n"
          "just before the load. CPU ratio = median (user+sys) fabric_lite / raw (a cost: lower is better).\n"
          "Times include writing into the page cache" + (" and waiting for the disk (--fsync)" if args.fsync else
                                                        ", not waiting for the disk (see --fsync)") + ".")

    if memory is not None:
        results["peak_extra_memory_mb"] = memory
        print("\npeak extra RSS during one operation (child process per side; VmHWM - VmRSS before)")
        print(f"{'side':12} {'save MB':>8} {'load MB':>8}")
        for name in MODES:
            m = memory[name]
            cells = ["n/a" if m.get(f"{op}_peak_extra_mb") is None else f"{m[f'{op}_peak_extra_mb']:.0f}" for op in OPS]
            print(f"{name:12} {cells[0]:>8} {cells[1]:>8}")

    results["profile"] = {}
    for name in (MODES if args.profile_raw else (FRAMEWORK,)):
        for op in OPS:
            wall, stats = profiles[name][op]
            print(f"\ncProfile: one {name} {op} ({wall:.3f} s wall) -- top {args.top} by cumulative time")
            print(f"{'cum s':>8} {'calls':>7}  function")
            for t, calls, fn in top(stats, 3, args.top):
                print(f"{t:8.3f} {calls:7d}  {fn}")
            print(f"top {args.top} by own time")
            for t, calls, fn in top(stats, 2, args.top):
                print(f"{t:8.3f} {calls:7d}  {fn}")
    for op in OPS:
        walls = {name: profiles[name][op][0] for name in MODES}
        splits = {name: split_by_kind(profiles[name][op][1]) for name in MODES}
        print(f"\n{op}, profiled once each: own seconds by kind of work "
              f"(raw {walls[RAW]:.3f} s, fabric_lite {walls[FRAMEWORK]:.3f} s wall)")
        print(f"{'raw':>7} {'fabric_lite':>11} {'extra':>7}  kind")
        for kind in [k for k, _ in KINDS] + [OTHER]:
            r, f = splits[RAW][kind], splits[FRAMEWORK][kind]
            if r >= 0.0005 or f >= 0.0005:
                print(f"{r:7.3f} {f:11.3f} {f - r:+7.3f}  {kind}")
        for name in MODES:
            results["profile"].setdefault(name, {})[op] = {
                "wall_s": walls[name], "own_seconds_by_kind": splits[name],
                "top_cumulative": top(profiles[name][op][1], 3, args.top),
                "top_own": top(profiles[name][op][1], 2, args.top)}
    print("(cProfile times the calling thread only: a helper thread's work shows as waiting for it; the user s\n"
          " and sys s columns above count every thread)")

    load_after = os.getloadavg()
    results["loadavg_before_after"] = [load_before, load_after]
    print(f"\n(total {time.perf_counter() - t_all:.0f} s; 1-min load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
