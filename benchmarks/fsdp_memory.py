"""Per-process memory and step time of DDP vs FSDP2 (strategy="fsdp") on 2 and 4 processes, and what
meta-device initialization saves at start-up.

The model is a stack of residual blocks, LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d) (~50M
parameters by default), trained on a fixed random batch with MSE loss and AdamW, in fp32. Each
configuration is a fresh N-process job (torchrun, gloo on CPU, one thread per process):

- ddp        `Accelerator(strategy="ddp")`;
- fsdp       `Accelerator(strategy=FSDPStrategy(auto_wrap_policy={"Block"}))`: every block gets its own
             fully_shard, the root one more. The model is built whole in every process, then sharded;
- fsdp meta  the same strategy, the model built under `torch.device("meta")`: prepare() gives each
             process storage for its own shards only and calls reset_parameters(). Trains 3 steps only.

Each process reports:

- parameters: bytes of model parameters it holds (under FSDP the local shards of the DTensors);
- optimizer: bytes of AdamW state it holds after 3 steps (the two moments; local shards under FSDP);
- peak RSS (ru_maxrss) right after `import torch` and fabric_lite ("imports"), right after prepare()
  ("after prepare": start-up, before any step), and at the end of the run ("peak");
- seconds per step over the timed steps after the 3 warm-up steps (not for "fsdp meta"). A step is
  forward, `backward`, `optimizer.step()`, `zero_grad()`; each rank times its own steps, the table gives
  the median over steps of the slowest rank's time for that step (max over ranks, then median);
- calls per step: the function calls cProfile sees on rank 0 over a few more steps (as overhead.py
  counts them: Python functions and the C functions they call; "python fn" is the Python part, the
  count a sys.setprofile hook sees as 'call' events). Does not depend on load.

Byte figures are the largest over the ranks (FSDP shards a tensor's first dimension in N chunks, so the
last rank can hold a little less); RSS figures too.

    .venv/bin/python benchmarks/fsdp_memory.py                         # ~50M parameters, 2 and 4 processes
    .venv/bin/python benchmarks/fsdp_memory.py --quick                 # ~2M parameters, 2 processes (~30 s)
    .venv/bin/python benchmarks/fsdp_memory.py --params 10000000 --nprocs 2 --steps 10

Byte counts are exact sizes of live tensors (deterministic); RSS is what the OS reports. The script
starts 4 processes even on a 2-core machine: memory per process does not depend on the cores, but
step times at 4 processes on 2 cores are oversubscribed and do not mean much (nor does their ratio).

Peak RSS is not the same thing as what a process holds. FSDP allocates and frees each block's gathered
parameters and gradients every step; glibc's malloc raises its mmap threshold after the first large
frees and from then on keeps buffers of that size in its heap, where freed memory stays resident, so
the RSS of an FSDP process grows over its first steps. `--malloc-mmap-threshold 131072` fixes the
threshold (MALLOC_MMAP_THRESHOLD_) in the processes, so large buffers are mapped and unmapped each
time; compare the peak RSS columns with and without it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
MB = 1e6
CONFIGS = ("ddp", "fsdp", "fsdp_meta")
WARMUP = 3  # steps before the byte counts (so AdamW state exists) and before the timed steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def shape(params: int, layers: int) -> int:
    """The width d that gives a stack of `layers` blocks about `params` parameters (8 d^2 each)."""
    return max(16, round((params / (8 * layers)) ** 0.5 / 16) * 16)


def child(config: str, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing
    from fabric_lite import Accelerator, FSDPStrategy

    rss_imports = max_rss()

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def local_bytes(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, DTensor):
                t = t.to_local()
            total += t.numel() * t.element_size()
        return total

    width = shape(args.params, args.layers)
    strategy = "ddp" if config == "ddp" else FSDPStrategy(auto_wrap_policy={"Block"})
    acc = Accelerator(strategy=strategy, cpu=True)
    torch.manual_seed(0)
    if config == "fsdp_meta":
        with torch.device("meta"):
            model = nn.Sequential(*[Block(width) for _ in range(args.layers)])
        total_params = sum(p.numel() for p in model.parameters())
        model = acc.prepare(model)  # each process materializes its shards only
        optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))  # after: meta params cannot step
    else:
        model = nn.Sequential(*[Block(width) for _ in range(args.layers)])
        total_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = acc.prepare(model, optimizer)
    rss_prepared = max_rss()

    g = torch.Generator().manual_seed(1000 + acc.process_index)
    x, y = torch.randn(args.batch, width, generator=g), torch.randn(args.batch, width, generator=g)

    def forward_backward() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        return loss

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def run(n: int) -> None:
        for _ in range(n):
            forward_backward()
            update()

    run(WARMUP - 1)
    last_loss = forward_backward().item()  # kept in the JSON: a meta-initialized model trains as well
    update()
    param_bytes = local_bytes(model.parameters())
    moments = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    optimizer_bytes = local_bytes(moments)
    step_s, calls, python_calls, update_calls = [], None, None, None
    if config != "fsdp_meta":
        for _ in range(args.steps):
            start = time.perf_counter()
            run(1)
            step_s.append(time.perf_counter() - start)
        if acc.process_index == 0:
            from overhead import is_python, profile_calls  # this folder is on sys.path (the script's own)

            counted = {"forward_backward": Counter(), "update": Counter()}  # function -> calls, per phase
            for _ in range(args.profile_steps):  # the two halves of a step profiled apart, step after step
                counted["forward_backward"].update(profile_calls(lambda n: forward_backward(), 1))
                counted["update"].update(profile_calls(lambda n: update(), 1))
            every = counted["forward_backward"] + counted["update"]
            calls = sum(every.values()) / args.profile_steps
            python_calls = sum(v for k, v in every.items() if is_python(k)) / args.profile_steps
            update_calls = sum(counted["update"].values()) / args.profile_steps
        else:
            run(args.profile_steps)
    result = {
        "config": config, "rank": acc.process_index, "world": acc.num_processes, "total_params": total_params,
        "width": width, "param_bytes": param_bytes, "optimizer_bytes": optimizer_bytes, "loss": last_loss,
        "rss_imports": rss_imports, "rss_prepared": rss_prepared, "rss_peak": max_rss(), "step_s": step_s,
        "calls_per_step": calls, "python_calls_per_step": python_calls, "update_calls_per_step": update_calls,
    }
    (args.out / f"{config}_rank{acc.process_index}.json").write_text(json.dumps(result))
    acc.end_training()


def launch(config: str, nprocs: int, args: argparse.Namespace, out: Path) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(HERE), "--child", config, "--out", str(out),
           "--params", str(args.params), "--layers", str(args.layers), "--batch", str(args.batch),
           "--steps", str(args.steps), "--profile-steps", str(args.profile_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)  # glibc: see the module docstring
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{config} on {nprocs} processes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return [json.loads((out / f"{config}_rank{r}.json").read_text()) for r in range(nprocs)]


def summarize(ranks: list) -> dict:
    row = {k: max(r[k] for r in ranks) for k in ("param_bytes", "optimizer_bytes", "rss_imports", "rss_prepared",
                                                  "rss_peak")}
    row["held"] = row["param_bytes"] + row["optimizer_bytes"]
    steps = list(zip(*(r["step_s"] for r in ranks)))
    row["step_s"] = statistics.median(max(s) for s in steps) if steps else None
    rank0 = next(r for r in ranks if r["rank"] == 0)
    row.update(config=rank0["config"], world=rank0["world"], total_params=rank0["total_params"],
               width=rank0["width"], calls=rank0["calls_per_step"], python_calls=rank0["python_calls_per_step"],
               update_calls=rank0["update_calls_per_step"], loss=rank0["loss"])
    return row


def print_table(rows: dict, args: argparse.Namespace) -> None:
    ddp, n = rows["ddp"], rows["ddp"]["world"]
    print(f"\n{ddp['total_params'] / 1e6:.1f}M parameters ({args.layers} blocks, width {ddp['width']}), AdamW, fp32, "
          f"{n} processes (gloo, CPU, 1 thread each), batch {args.batch} per process"
          + (f", MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold is not None else "")
          + "; per process, max over ranks:")
    print(f"{'config':10s} {'params MB':>9s} {'optim MB':>9s} {'p+o MB':>8s} {'vs DDP':>6s} {'imports MB':>10s} "
          f"{'after prepare MB':>16s} {'peak RSS MB':>11s} {'s/step':>7s} {'vs DDP':>6s} {'calls/step':>10s} "
          f"{'python fn':>9s} {'opt calls':>9s}")
    for name, r in rows.items():
        held = f"{r['held'] / ddp['held']:.2f}"
        step = f"{r['step_s']:.4f}" if r["step_s"] is not None else "-"
        step_ratio = f"{r['step_s'] / ddp['step_s']:.2f}" if r["step_s"] is not None else "-"
        calls = f"{r['calls']:.0f}" if r["calls"] is not None else "-"
        python = f"{r['python_calls']:.0f}" if r["python_calls"] is not None else "-"
        update = f"{r['update_calls']:.0f}" if r["update_calls"] is not None else "-"
        print(f"{name.replace('_', ' '):10s} {r['param_bytes'] / MB:9.1f} {r['optimizer_bytes'] / MB:9.1f} "
              f"{r['held'] / MB:8.1f} {held:>6s} {r['rss_imports'] / MB:10.1f} {r['rss_prepared'] / MB:16.1f} "
              f"{r['rss_peak'] / MB:11.1f} {step:>7s} {step_ratio:>6s} {calls:>10s} {python:>9s} {update:>9s}")
    fsdp = rows["fsdp"]
    print(f"fsdp/ddp: parameters + optimizer state {fsdp['held'] / ddp['held']:.3f} (1/N = {1 / n:.3f}); "
          f"s/step {fsdp['step_s'] / ddp['step_s']:.2f}; calls/step {fsdp['calls'] / ddp['calls']:.2f} "
          f"(python fn {fsdp['python_calls'] / ddp['python_calls']:.2f})"
          + (f"  [{n} processes on {os.cpu_count()} cores: step times oversubscribed]" if n > (os.cpu_count() or 1)
             else ""))
    if "fsdp_meta" in rows:
        meta, base = rows["fsdp_meta"], rows["fsdp"]["rss_imports"]
        above = (meta["rss_prepared"] - base) / (fsdp["rss_prepared"] - base)
        print(f"start-up under FSDP, peak RSS after prepare: whole model {fsdp['rss_prepared'] / MB:.1f} MB, meta "
              f"{meta['rss_prepared'] / MB:.1f} MB: meta/whole {meta['rss_prepared'] / fsdp['rss_prepared']:.3f} "
              f"(target <= 0.6); above the imports ({base / MB:.1f} MB): {(fsdp['rss_prepared'] - base) / MB:.1f} vs "
              f"{(meta['rss_prepared'] - base) / MB:.1f} MB, {above:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000, help="model size (default 50M)")
    parser.add_argument("--layers", type=int, default=8, help="blocks in the stack (default 8)")
    parser.add_argument("--batch", type=int, default=32, help="rows of the random batch per process (default 32)")
    parser.add_argument("--nprocs", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"default {','.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up (default 20)")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps rank 0 counts calls over (default 3)")
    parser.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ in the processes (e.g. 131072; default: unset)")
    parser.add_argument("--quick", action="store_true", help="~2M parameters, 2 processes, 5 timed steps")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return
    if args.quick:
        args.params, args.nprocs, args.steps, args.profile_steps = 2_000_000, "2", 5, 2
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "ddp" not in configs or "fsdp" not in configs:
        parser.error(f"--configs: ddp and fsdp are needed (the ratios), fsdp_meta is optional; got {configs}")
    tables = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for nprocs in (int(n) for n in args.nprocs.split(",")):
            rows = {}
            for config in configs:
                out = Path(tmp) / f"{config}_{nprocs}"
                out.mkdir()
                rows[config] = summarize(launch(config, nprocs, args, out))
            print_table(rows, args)
            tables[nprocs] = rows
    print(f"\nMB = 10^6 bytes. imports / after prepare / peak RSS: ru_maxrss after `import torch` and fabric_lite, "
          f"right after\nprepare() (before any step), at the end. s/step: median over {args.steps} steps of the "
          f"slowest rank's step time. calls/step:\ncProfile on rank 0 over {args.profile_steps} steps (Python "
          f"and C functions; python fn: Python functions only; opt calls: those in\noptimizer.step() and zero_grad()). "
          f"{time.perf_counter() - started:.0f} s in all.")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1))


if __name__ == "__main__":
    main()
