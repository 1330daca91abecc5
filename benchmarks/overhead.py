"""What the Accelerator costs per training step, next to the same loop written in plain PyTorch.

Both loops train the same MLP (same initial weights, same data, AdamW, cross-entropy, a
TensorDataset in a shuffling DataLoader) in the same process. Timed repeats alternate between
them (raw, framework, framework, raw, ...) so that load on the machine hits both alike; the
table gives seconds per step and the framework/raw ratio of the medians. The raw loop moves each
batch with `.to(device)` as a device-agnostic loop does; in the other loop the prepared loader
places batches. With --ddp the raw loop is DistributedDataParallel with a DistributedSampler over
gloo, set up by hand; the Accelerator joins the same process group.

Wall-clock time on a shared machine is noisy, so the table also gives a figure that load does not
move: function calls per training step (Python functions and the C functions they call, as counted
by cProfile) over a window of whole epochs, for each loop.

    python benchmarks/overhead.py                          # one process: tiny and small MLP
    python benchmarks/overhead.py --quick                  # smoke run, a few seconds
    python benchmarks/overhead.py --profile-diff           # also: which functions the extra calls are
    torchrun --nproc-per-node 2 benchmarks/overhead.py --ddp   # 2 processes: DDP by hand vs Accelerator

Models:
  tiny   32 -> 64 -> 10, batch 32: the step is a few hundred microseconds, so any per-step
         Python in the framework shows (target: Accelerator/raw <= 1.03).
  small  512 -> 2048 -> 2048 -> 10, batch 256: compute-bound; the framework should vanish in the
         noise (target: <= 1.01).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# fabric_lite is imported where the Accelerator loop is built: memory.py's raw-loop child imports this
# module for its workload and must not load the framework.

RAW, FRAMEWORK = "raw", "accelerator"


@dataclass
class Spec:
    sizes: Tuple[int, ...]
    batch: int
    samples: int
    steps: int  # timed steps per repeat
    warmup: int  # untimed steps per loop before the first repeat
    target: float  # the project's goal for the framework/raw time ratio


SPECS: Dict[str, Spec] = {
    "tiny": Spec(sizes=(32, 64, 10), batch=32, samples=4096, steps=1000, warmup=100, target=1.03),
    "small": Spec(sizes=(512, 2048, 2048, 10), batch=256, samples=4096, steps=16, warmup=3, target=1.01),
}
DDP_SMALL_STEPS = 8  # one thread per process makes a DDP step ~2x longer: keeps the run under 2 minutes
QUICK = {"tiny": dict(steps=40, warmup=10, samples=1024), "small": dict(steps=2, warmup=1, samples=1024)}


def build_mlp(sizes: Tuple[int, ...]) -> nn.Module:
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def synthetic_data(spec: Spec) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(spec.samples, spec.sizes[0], generator=g)
    y = torch.randint(0, spec.sizes[-1], (spec.samples,), generator=g)
    return x, y


Runner = Callable[[int], None]  # run(n): n training steps


def endless(loader: Iterable, set_epoch: Optional[Callable[[int], None]] = None) -> Iterator:
    """Batches from epoch after epoch (one helper for both loops, so it counts alike in both)."""
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def raw_loop(spec: Spec, data: Tuple[torch.Tensor, torch.Tensor], ddp: bool,
             device: Optional[torch.device] = None) -> Tuple[Runner, int]:
    """The loop as written without a framework (DDP and DistributedSampler set up by hand).

    `device` defaults to the CPU; memory.py passes the GPU when it measures CUDA memory.
    """
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    model: nn.Module = build_mlp(spec.sizes).to(device)
    if ddp:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = TensorDataset(*data)
    sampler = None
    if ddp:
        sampler = DistributedSampler(
            dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0
        )
        loader = DataLoader(dataset, batch_size=spec.batch, sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=spec.batch, shuffle=True)

    stream = endless(loader, sampler.set_epoch if sampler is not None else None)

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(stream)
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

    return run, len(loader)


def framework_loop(spec: Spec, data: Tuple[torch.Tensor, torch.Tensor], ddp: bool,
                   device: Optional[torch.device] = None) -> Tuple[Runner, int]:
    """The same loop through the Accelerator: prepare(model, optimizer, loader) and backward(loss).

    On the CPU unless `device` is a GPU, like the raw loop (the Accelerator alone would pick a GPU)."""
    from fabric_lite import Accelerator

    accelerator = Accelerator(cpu=device is None or device.type == "cpu")
    torch.manual_seed(0)
    model = build_mlp(spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if ddp and not isinstance(model, DistributedDataParallel):
        raise RuntimeError(f"expected the Accelerator to wrap the model in DDP, got {type(model).__name__}")

    stream = endless(loader)  # the prepared loader moves to the next epoch's order by itself

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(stream)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()

    return run, len(loader)


def barrier(ddp: bool) -> None:
    if ddp:
        dist.barrier()


def time_interleaved(loops: Dict[str, Runner], steps: int, repeats: int, ddp: bool) -> Dict[str, List[float]]:
    """Seconds per step of each repeat; the order alternates (ABBA...) so drift hits both loops alike."""
    names = list(loops)
    per_step: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            gc.collect()
            barrier(ddp)
            start = time.perf_counter()
            loops[name](steps)
            barrier(ddp)  # a DDP step is done when every rank is done
            per_step[name].append((time.perf_counter() - start) / steps)
    return per_step


def _is_profiler_itself(key: Tuple[str, int, str]) -> bool:
    return "_lsprof.Profiler" in key[2]


def profile_calls(run: Runner, steps: int) -> Dict[Tuple[str, int, str], float]:
    """Calls per step of every function seen by cProfile while `run` trains `steps` steps."""
    profiler = cProfile.Profile()
    profiler.enable()
    run(steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # key -> (primitive calls, total calls, tottime, cumtime, callers)
    return {k: v[1] / steps for k, v in stats.items() if not _is_profiler_itself(k)}


def is_python(key: Tuple[str, int, str]) -> bool:
    return key[0] != "~"  # cProfile files C functions (builtins, torch ops) under "~"


def label(key: Tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    path = filename.replace(os.sep, "/")
    for anchor in ("/fabric_lite/", "/torch/", "/benchmarks/", "/lib/python"):
        if anchor in path:
            path = path[path.index(anchor) + 1:]
            break
    return f"{path}:{line}({func})"


def print_diff(mode: str, raw: Dict, fw: Dict, top: int, name: str = "Accelerator", short: str = "accel") -> None:
    keys = set(raw) | set(fw)
    rows = [(fw.get(k, 0.0) - raw.get(k, 0.0), raw.get(k, 0.0), fw.get(k, 0.0), k) for k in keys]
    extra = sorted((r for r in rows if r[0] > 1e-9), key=lambda r: (-r[0], label(r[3])))
    fewer = sorted((r for r in rows if r[0] < -1e-9), key=lambda r: (r[0], label(r[3])))
    print(f"\n{mode}: functions called more often per step by the {name} loop than by the raw loop")
    print(f"{'+calls/step':>11} {'raw':>8} {short:>8}  function")
    for d, r, f, k in extra[:top]:
        print(f"{d:11.3f} {r:8.3f} {f:8.3f}  {label(k)}")
    if len(extra) > top:
        rest = sum(r[0] for r in extra[top:])
        print(f"{rest:11.3f} {'':8} {'':8}  ... {len(extra) - top} more functions")
    if fewer:
        print(f"{mode}: functions the raw loop calls more often")
        for d, r, f, k in fewer[:top]:
            print(f"{d:11.3f} {r:8.3f} {f:8.3f}  {label(k)}")


def fmt_s(x: float) -> str:
    return f"{x:.4g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both loops train (default cpu; cuda: one process only)")
    parser.add_argument("--ddp", action="store_true",
                        help="2-process run; start with torchrun --nproc-per-node 2 (gloo on CPU)")
    parser.add_argument("--quick", action="store_true", help="a few steps only: checks that the script works")
    parser.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small (default both)")
    parser.add_argument("--steps", type=int, help="timed steps per repeat for the tiny MLP (default 1000)")
    parser.add_argument("--small-steps", type=int,
                        help="timed steps per repeat for the small MLP (default 16; 8 with --ddp)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each loop (default 7; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps per loop before timing (default 100 / 3)")
    parser.add_argument("--profile-epochs", type=int, default=2,
                        help="epochs in the cProfile window that counts calls per step (default 2)")
    parser.add_argument("--profile-diff", action="store_true",
                        help="print the functions behind the extra calls per step")
    parser.add_argument("--top", type=int, default=25, help="rows in the --profile-diff listing")
    parser.add_argument("--json", type=Path, help="also write the figures to this file (rank 0)")
    args = parser.parse_args()
    if args.device == "cuda" and (args.ddp or not torch.cuda.is_available()):
        parser.error("--device cuda needs a visible GPU and one process (the DDP set-up here is gloo on the CPU)")

    if args.ddp:
        if "WORLD_SIZE" not in os.environ:
            parser.error("--ddp needs a launcher: torchrun --nproc-per-node 2 benchmarks/overhead.py --ddp")
        # One process group for both loops; the Accelerator finds it and joins it.
        dist.init_process_group("gloo")
    rank0 = not args.ddp or dist.get_rank() == 0
    world = dist.get_world_size() if args.ddp else 1
    repeats = args.repeats or (3 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats must be >= 1")

    def say(*a) -> None:
        if rank0:
            print(*a, flush=True)

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(SPECS)}")

    say(f"fabric_lite overhead: raw PyTorch loop vs Accelerator | torch {torch.__version__} | "
        f"{world} process(es) x {torch.get_num_threads()} thread(s) | {repeats} interleaved repeats"
        + (" | QUICK" if args.quick else ""))

    results: Dict[str, dict] = {}
    for mode in names:
        spec = Spec(**SPECS[mode].__dict__)
        if args.quick:
            for k, v in QUICK[mode].items():
                setattr(spec, k, v)
        if mode == "tiny" and args.steps:
            spec.steps = args.steps
        if mode == "small" and args.small_steps:
            spec.steps = args.small_steps
        elif mode == "small" and args.ddp and not args.quick:
            spec.steps = DDP_SMALL_STEPS
        if args.warmup is not None:
            spec.warmup = args.warmup
        data = synthetic_data(spec)
        device = torch.device(args.device)
        raw_run, raw_epoch = raw_loop(spec, data, args.ddp, device)
        fw_run, fw_epoch = framework_loop(spec, data, args.ddp, device)
        if raw_epoch != fw_epoch:
            raise RuntimeError(f"{mode}: loaders differ in length ({raw_epoch} vs {fw_epoch} batches per epoch)")
        loops = {RAW: raw_run, FRAMEWORK: fw_run}
        for run in loops.values():
            run(spec.warmup)

        t0 = time.perf_counter()
        per_step = time_interleaved(loops, spec.steps, repeats, args.ddp)
        timing_s = time.perf_counter() - t0

        # Whole epochs, so every window holds the same number of epoch starts in both loops.
        window = max(1, args.profile_epochs) * raw_epoch
        barrier(args.ddp)
        calls = {name: profile_calls(run, window) for name, run in loops.items()}
        barrier(args.ddp)

        med = {n: statistics.median(v) for n, v in per_step.items()}
        paired = [f / r for f, r in zip(per_step[FRAMEWORK], per_step[RAW])]
        total = {n: sum(c.values()) for n, c in calls.items()}
        python = {n: sum(v for k, v in c.items() if is_python(k)) for n, c in calls.items()}
        results[mode] = {
            "model": "->".join(map(str, spec.sizes)), "batch": spec.batch, "steps_per_repeat": spec.steps,
            "repeats": repeats, "processes": world, "threads": torch.get_num_threads(),
            "seconds_per_step": per_step, "median": med,
            "ratio_median": med[FRAMEWORK] / med[RAW],
            "ratio_min": min(per_step[FRAMEWORK]) / min(per_step[RAW]),
            "ratio_paired_median": statistics.median(paired), "ratio_paired_min": min(paired),
            "ratio_paired_max": max(paired),
            "calls_per_step": total, "python_calls_per_step": python,
            "calls_ratio": total[FRAMEWORK] / total[RAW], "profile_window_steps": window,
            "target": spec.target, "timing_seconds": timing_s,
        }
        if args.profile_diff and rank0:
            print_diff(mode, calls[RAW], calls[FRAMEWORK], args.top)

    if rank0:
        print()
        print(f"{'model':6} {'loop':12} {'median s/step':>13} {'min':>10} {'max':>10} "
              f"{'calls/step':>11} {'python fn':>10}")
        for mode, r in results.items():
            for n in (RAW, FRAMEWORK):
                v = r["seconds_per_step"][n]
                print(f"{mode:6} {n:12} {fmt_s(r['median'][n]):>13} {fmt_s(min(v)):>10} {fmt_s(max(v)):>10} "
                      f"{r['calls_per_step'][n]:11.1f} {r['python_calls_per_step'][n]:10.1f}")
        print()
        print(f"{'model':6} {'time ratio':>10} {'of mins':>7} {'paired: median [min..max]':>26} {'calls ratio':>11} "
              f"{'+calls/step':>11} {'target':>7}")
        for mode, r in results.items():
            extra = r["calls_per_step"][FRAMEWORK] - r["calls_per_step"][RAW]
            verdict = "met" if r["ratio_median"] <= r["target"] else "missed"
            paired = f"{r['ratio_paired_median']:.3f} [{r['ratio_paired_min']:.3f}..{r['ratio_paired_max']:.3f}]"
            print(f"{mode:6} {r['ratio_median']:10.3f} {r['ratio_min']:7.3f} {paired:>26} "
                  f"{r['calls_ratio']:11.3f} {extra:11.1f} {'<=' + format(r['target'], 'g'):>7} {verdict}")
        print("\ntime ratio = median(accelerator s/step) / median(raw s/step); of mins = the same with each\n"
              "loop's fastest repeat; paired = per-repeat ratios of back-to-back runs.\n"
              "calls/step = function calls cProfile sees per step (Python and C); python fn = Python functions only.")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))

    if args.ddp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
