"""fp8 (torchao) vs bf16 on one GPU: the same GPT from the same initial weights on the same batches, trained
twice through the Accelerator, `mixed_precision="bf16"` and `mixed_precision="fp8"` (AORecipeKwargs: torchao's
float8 linear layers, the first and last linear layers kept in bf16, bf16 autocast for the rest).

The data is learnable (a fixed random Markov chain: each token has 4 possible successors, so the loss can fall
from ln(vocab) towards ln(4) = 1.39), so that the two loss curves say whether fp8 trains like bf16, not only that
both sit at ln(vocab). Printed: the loss at the start and the mean of the last 20 steps of each run, their
difference, the median time per step (windows of 10 steps between GPU synchronizations, after warm-up) and
the fp8/bf16 time ratio, and which layers fp8 converted.

    python benchmarks/fp8_vs_bf16.py --steps 200             # H100-class GPU: width 2048, 8 layers (~1.5 min)
    python benchmarks/fp8_vs_bf16.py --steps 200 --compile   # both runs under torch.compile (fp8's casts fused)
    python benchmarks/fp8_vs_bf16.py --quick                 # small model; without an fp8 GPU: torchao's emulation on CPU

fp8 needs torchao (`pip install 'fabric-lite[fp8]'`) and a GPU of compute capability 8.9 or newer. Without
torch.compile, torchao's scaling and casting run as separate kernels, so fp8 gains only where the matrix
products dominate (large widths); with --compile they are fused into neighbouring kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_gpu import GPT, GPTConfig  # noqa: E402  (the same model as the bf16 GPU benchmark)

TAIL = 20  # steps averaged for "the end of the curve"
WINDOW = 10  # steps timed between two synchronizations


def markov_tokens(vocab: int, samples: int, length: int, seed: int = 1234, successors: int = 4) -> torch.Tensor:
    """`samples` sequences of `length` tokens from a fixed random Markov chain (each token is followed by one of
    `successors` tokens, uniformly): entropy ln(successors) per token."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, successors), generator=g)
    out = torch.empty(samples, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (samples,), generator=g)
    for i in range(1, length):
        pick = torch.randint(0, successors, (samples,), generator=g)
        out[:, i] = table[out[:, i - 1], pick]
    return out


def fp8_device_problem() -> Optional[str]:
    from fabric_lite.strategies.fp8 import machine_problem, package_problem

    return package_problem("ao") or machine_problem()


def train(config: GPTConfig, tokens: torch.Tensor, steps: int, batch: int, mixed_precision: str,
          compile_: bool = False, cpu: bool = False, emulate: bool = False, lr: float = 1e-3) -> Dict[str, Any]:
    """Train a fresh GPT (seed 0) for `steps` steps on `tokens` (batches in order, wrapping around); return the
    per-step losses, the median seconds per step and the fp8 layers."""
    from fabric_lite import Accelerator
    from fabric_lite.accelerator.precision_handlers import AORecipeKwargs
    from fabric_lite.strategies.fp8 import fp8_layer_names

    handlers = []
    if mixed_precision == "fp8":
        if emulate:  # torchao's fp8 rounding with ordinary kernels, on any device (slow): for the smoke run
            from torchao.float8 import Float8LinearConfig

            handlers.append(AORecipeKwargs(config=Float8LinearConfig(emulate=True, pad_inner_dim=True)))
        else:
            handlers.append(AORecipeKwargs())
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers,
                              dynamo_backend="inductor" if compile_ else None)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=not cpu)
    model, optimizer = accelerator.prepare(model, optimizer)
    layers = fp8_layer_names(accelerator.unwrap_model(model))
    device = accelerator.device
    data = tokens.to(device)
    count = data.shape[0] // batch
    losses: List[torch.Tensor] = []
    window_times: List[float] = []
    warmup = min(max(WINDOW, steps // 10), steps // 2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = None
    for step in range(steps):
        if step >= warmup and (step - warmup) % WINDOW == 0:
            sync()
            now = time.perf_counter()
            if start is not None:
                window_times.append((now - start) / WINDOW)
            start = now
        b = data[(step % count) * batch:(step % count + 1) * batch]
        loss = model(b)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    if start is not None and (steps - warmup) % WINDOW == 0 and steps > warmup:
        window_times.append((time.perf_counter() - start) / WINDOW)
    curve = torch.stack(losses).float().cpu().tolist()
    accelerator.end_training()
    params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    return {"losses": curve, "s_per_step": statistics.median(window_times) if window_times else float("nan"),
            "fp8_layers": layers, "device": str(device), "params": params}


def tail_mean(losses: List[float]) -> float:
    return statistics.fmean(losses[-TAIL:])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in both runs")
    parser.add_argument("--quick", action="store_true", help="a small model (a smoke run); CPU emulation without "
                                                             "an fp8 GPU")
    parser.add_argument("--json", default=None, help="also write the curves and times to this file")
    args = parser.parse_args(argv)

    problem = fp8_device_problem()
    emulate = cpu = False
    if args.quick:
        args.width, args.layers, args.heads, args.context, args.vocab, args.batch = 32, 2, 2, 32, 128, 4
        args.steps = min(args.steps, 30)
        if problem is not None:
            emulate = cpu = True
    elif problem is not None:
        print(f"fp8 cannot run here: {problem}", file=sys.stderr)
        return 2
    config = GPTConfig(vocab=args.vocab, context=args.context, layers=args.layers, heads=args.heads, width=args.width)
    samples = max(args.batch * 64, args.batch)
    tokens = markov_tokens(args.vocab, samples, args.context + 1)

    results = {}
    for mp in ("bf16", "fp8"):
        results[mp] = train(config, tokens, args.steps, args.batch, mp, compile_=args.compile, cpu=cpu,
                            emulate=emulate, lr=args.lr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    bf16, fp8 = results["bf16"], results["fp8"]
    name = torch.cuda.get_device_name() if not cpu and torch.cuda.is_available() else "CPU (fp8 emulated)"
    params = bf16["params"]
    print(f"device: {name}; torch {torch.__version__}; model: width {args.width}, {args.layers} layers, "
          f"{params / 1e6:.1f}M parameters, context {args.context}, batch {args.batch}; {args.steps} steps"
          f"{', torch.compile' if args.compile else ''}")
    print(f"fp8 layers ({len(fp8['fp8_layers'])}): {', '.join(fp8['fp8_layers'][:6])}"
          f"{', ...' if len(fp8['fp8_layers']) > 6 else ''}")
    print(f"{'run':6} {'loss[0]':>9} {'loss last-' + str(TAIL) + ' mean':>20} {'ms/step':>9}")
    for mp, r in results.items():
        print(f"{mp:6} {r['losses'][0]:9.4f} {tail_mean(r['losses']):20.4f} {r['s_per_step'] * 1e3:9.2f}")
    diff = tail_mean(fp8["losses"]) - tail_mean(bf16["losses"])
    ratio = fp8["s_per_step"] / bf16["s_per_step"]
    print(f"loss difference fp8 - bf16 (last-{TAIL} means): {diff:+.4f} ({diff / tail_mean(bf16['losses']):+.2%})")
    print(f"time ratio fp8 / bf16: {ratio:.3f} (speed-up {1 / ratio:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": name, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
