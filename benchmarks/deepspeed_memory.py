"""Per-process memory of DDP vs DeepSpeed ZeRO stages 1, 2, 3 (and offload) on 2 processes: what ZeRO saves.

For each strategy a fresh 2-process job (torchrun, gloo on CPU) prepares the same MLP (~50M parameters by
default) with AdamW through `Accelerator(strategy=...)`, trains 3 steps, and each rank reports:

- parameters: bytes of model parameters this process holds (at ZeRO-3 its partition only);
- optimizer: bytes of optimizer state this process holds: Adam's two moments, plus the fp32 master copy
  of the parameters where the engine keeps one apart from the model (ZeRO partitions both);
- peak RSS of the process (everything: torch, gradients, communication buffers).

    .venv/bin/python benchmarks/deepspeed_memory.py                      # 50M parameters, 5 strategies
    .venv/bin/python benchmarks/deepspeed_memory.py --params 5000000 --strategies ddp,deepspeed_stage_3

Memory counts are exact byte counts of live tensors (deterministic); RSS is what the OS reports.
Needs deepspeed (pip install 'fabric-lite[deepspeed]').
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
MB = 1e6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def child(strategy: str, params: int, out: Path) -> None:
    import torch

    from fabric_lite import Accelerator

    width = max(64, int((params / 3) ** 0.5))  # three width x width layers
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    acc = Accelerator(strategy=strategy)
    data = torch.utils.data.TensorDataset(torch.randn(24, width))
    model, optimizer, loader = acc.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
    for (x,) in loader:
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    module = acc.unwrap_model(model)
    model_params = list(module.parameters())
    held = [getattr(p, "ds_tensor", p) for p in model_params]  # ZeRO-3 keeps a partition in p.ds_tensor
    engine_opt = optimizer.optimizer
    base = getattr(engine_opt, "optimizer", engine_opt)  # the torch optimizer inside DeepSpeed's wrapper
    model_ptrs = {t.untyped_storage().data_ptr() for t in held}
    masters = [p for g in base.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in model_ptrs]
    moments = [t for state in base.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    result = {
        "strategy": strategy, "rank": acc.process_index, "total_params": sum(p.ds_numel if hasattr(p, "ds_numel")
                                                                              else p.numel() for p in model_params),
        "param_bytes": tensor_bytes(held), "optimizer_bytes": tensor_bytes(moments) + tensor_bytes(masters),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    (out / f"{strategy}_rank{acc.process_index}.json").write_text(json.dumps(result))
    acc.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000, help="model size (default 50M)")
    parser.add_argument("--strategies", default="ddp,deepspeed_stage_1,deepspeed_stage_2,deepspeed_stage_3,"
                                                "deepspeed_stage_3_offload")
    parser.add_argument("--quick", action="store_true", help="2M parameters, DDP and ZeRO-3 only")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.params, args.out)
        return
    if args.quick:
        args.params, args.strategies = 2_000_000, "ddp,deepspeed_stage_3"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), str(HERE), "--child", strategy,
                   "--params", str(args.params), "--out", tmp]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                sys.exit(f"{strategy} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
            rows.extend(json.loads((Path(tmp) / f"{strategy}_rank{r}.json").read_text()) for r in (0, 1))
    ddp = {r["rank"]: r for r in rows if r["strategy"] == "ddp"}
    print(f"\n{rows[0]['total_params'] / 1e6:.1f}M parameters, AdamW, fp32, 2 processes (gloo, CPU); per process:")
    print(f"{'strategy':28s} {'rank':>4s} {'params MB':>10s} {'optimizer MB':>13s} {'vs DDP':>7s} {'peak RSS MB':>12s}")
    for r in rows:
        base = ddp.get(r["rank"])
        ratio = f"{r['optimizer_bytes'] / base['optimizer_bytes']:.2f}" if base else "-"
        print(f"{r['strategy']:28s} {r['rank']:4d} {r['param_bytes'] / MB:10.1f} {r['optimizer_bytes'] / MB:13.1f} "
              f"{ratio:>7s} {r['peak_rss'] / MB:12.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
