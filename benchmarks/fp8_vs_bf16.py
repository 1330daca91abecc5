"""fp8 (torchao) vs bf16 on one GPU: the same GPT from the same initial weights on the same batches, trained
twice through the Accelerator, `mixed_precision="bf16"` and `mixed_precision="fp8"` (AORecipeKwargs: torchao's
float8 linear layers, the first and last linear layers kept in bf16, bf16 autocast for the rest).

The data is a fixed random Markov chain: each token is followed by one of 4 distinct tokens, uniformly, so the
cross-entropy of the next token can fall from ln(vocab) to ln(4) = 1.386 and no lower. Every batch is freshly
drawn (no sequence is seen twice, unless --samples makes the data set smaller), so the training loss is also
the loss on unseen data and ln(4) is a true floor: a loss below it means the model sees the token it predicts.
(With a small data set cycled for several epochs a large model memorizes the random choices and its loss
falls below ln(4): that measures memorization, not whether fp8 trains like bf16.) The optimizer is GPT's usual
one: AdamW (betas 0.9, 0.95, weight decay 0.1), a linear warm-up then a cosine decay to a tenth of the peak
learning rate, the gradient norm clipped to 1.

Printed: the floor, the loss at the start and the mean of the last 20 steps of each run with its excess over the
floor, their difference, the median time per step (windows of 10 steps between GPU synchronizations, after
warm-up), the fp8/bf16 time ratio, and which layers fp8 converted.

    python benchmarks/fp8_vs_bf16.py --steps 200             # H100-class GPU: width 2048, 8 layers (~1 min)
    python benchmarks/fp8_vs_bf16.py --steps 200 --compile   # both runs under torch.compile (fp8's casts fused)
    python benchmarks/fp8_vs_bf16.py --quick                 # small model; without an fp8 GPU: torchao's emulation on CPU

fp8 needs torchao (`pip install 'fabric-lite[fp8]'`) and a GPU of compute capability 8.9 or newer. Without
torch.compile, torchao's scaling and casting run as separate kernels, so fp8 gains only where the matrix
products dominate (large widths); with --compile they are fused into neighbouring kernels.
"""

from __future__ import annotations

import argparse
import json
import math
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
SUCCESSORS = 4
FLOOR = math.log(SUCCESSORS)  # the entropy of the next token: no model can average below it on unseen data


def markov_chain(vocab: int, successors: int = SUCCESSORS, seed: int = 1234) -> torch.Tensor:
    """A (vocab, successors) table: row t lists the `successors` distinct tokens that may follow t."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, successors), generator=g)
    while True:  # redraw the rows that repeat a token, so each successor has probability exactly 1/successors
        repeats = (table.sort(dim=1).values.diff(dim=1) == 0).any(dim=1)
        if not repeats.any():
            return table
        table[repeats] = torch.randint(0, vocab, (int(repeats.sum()), successors), generator=g)


def markov_tokens(table: torch.Tensor, samples: int, length: int, seed: int = 0) -> torch.Tensor:
    """`samples` sequences of `length` tokens walking the chain `table` (a uniform first token, then each next
    token uniformly among the current one's successors): entropy ln(successors) per predicted token."""
    vocab, successors = table.shape
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(samples, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (samples,), generator=g)
    picks = torch.randint(0, successors, (samples, length), generator=g)
    for i in range(1, length):
        out[:, i] = table[out[:, i - 1], picks[:, i]]
    return out


def fp8_device_problem() -> Optional[str]:
    from fabric_lite.strategies.fp8 import machine_problem, package_problem

    return package_problem("ao") or machine_problem()


def lr_factor(step: int, steps: int, warmup: int, decay: bool = True) -> float:
    """Linear warm-up over `warmup` steps, then a cosine decay to 0.1 at the last step (or none: `decay` False)."""
    if step < warmup:
        return (step + 1) / warmup
    if not decay:
        return 1.0
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(config: GPTConfig, tokens: torch.Tensor, steps: int, batch: int, mixed_precision: str,
          compile_: bool = False, cpu: bool = False, emulate: bool = False, lr: float = 6e-4,
          warmup: Optional[int] = None, clip: float = 1.0, seed: int = 0, beta2: float = 0.95,
          decay: bool = True) -> Dict[str, Any]:
    """Train a fresh GPT (weights from `seed`) for `steps` steps on `tokens`, batch i = rows i*batch ..
    (i+1)*batch - 1, wrapping around only if `tokens` has fewer than steps*batch rows; return the per-step
    losses, the median seconds per step and the fp8 layers. `warmup` defaults to a tenth of the steps."""
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
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, beta2), weight_decay=0.1, fused=not cpu)
    warmup = max(1, steps // 10) if warmup is None else max(1, warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup, decay))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    layers = fp8_layer_names(accelerator.unwrap_model(model))
    device = accelerator.device
    data = tokens.to(device)
    count = data.shape[0] // batch
    losses: List[torch.Tensor] = []
    window_times: List[float] = []
    timed_from = min(max(WINDOW, steps // 10), steps // 2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = None
    for step in range(steps):
        if step >= timed_from and (step - timed_from) % WINDOW == 0:
            sync()
            now = time.perf_counter()
            if start is not None:
                window_times.append((now - start) / WINDOW)
            start = now
        b = data[(step % count) * batch:(step % count + 1) * batch]
        loss = model(b)
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync()
    if start is not None and (steps - timed_from) % WINDOW == 0 and steps > timed_from:
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
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: a tenth of --steps)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip, 0 for none (default 1)")
    parser.add_argument("--beta2", type=float, default=0.95, help="AdamW's second beta (default 0.95)")
    parser.add_argument("--constant-lr", action="store_true", help="no decay after the warm-up")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sequences drawn (the chain and the "
                                                            "initial weights stay the same; default 0)")
    parser.add_argument("--samples", type=int, default=None,
                        help="sequences in the data set, cycled (default: steps x batch, every batch fresh)")
    parser.add_argument("--runs", default="bf16,fp8", help="which runs, in order (default bf16,fp8)")
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
        args.lr = max(args.lr, 3e-3)
        if problem is not None:
            emulate = cpu = True
    elif problem is not None and "fp8" in args.runs:
        print(f"fp8 cannot run here: {problem}", file=sys.stderr)
        return 2
    config = GPTConfig(vocab=args.vocab, context=args.context, layers=args.layers, heads=args.heads, width=args.width)
    samples = args.samples or args.steps * args.batch
    tokens = markov_tokens(markov_chain(args.vocab), samples, args.context + 1, seed=args.seed)

    results = {}
    for mp in [r.strip() for r in args.runs.split(",") if r.strip()]:
        results[mp] = train(config, tokens, args.steps, args.batch, mp, compile_=args.compile, cpu=cpu,
                            emulate=emulate, lr=args.lr, warmup=args.warmup, clip=args.clip, beta2=args.beta2,
                            decay=not args.constant_lr)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    first = next(iter(results.values()))
    name = torch.cuda.get_device_name() if not cpu and torch.cuda.is_available() else \
        "CPU (fp8 emulated)" if emulate else "CPU"
    epochs = args.steps * args.batch / samples
    print(f"device: {name}; torch {torch.__version__}; model: width {args.width}, {args.layers} layers, "
          f"{first['params'] / 1e6:.1f}M parameters, context {args.context}, batch {args.batch}; {args.steps} steps"
          f"{', torch.compile' if args.compile else ''}; {'constant' if args.constant_lr else 'peak'} lr {args.lr:g}, "
          f"warm-up {args.warmup if args.warmup is not None else max(1, args.steps // 10)}, clip {args.clip:g}, "
          f"beta2 {args.beta2:g}, data seed {args.seed}")
    print(f"data: {samples} sequences ({'each seen once' if epochs <= 1 else f'{epochs:.1f} passes'}); "
          f"floor ln({SUCCESSORS}) = {FLOOR:.4f} (ln(vocab) = {math.log(args.vocab):.4f})")
    if "fp8" in results:
        fp8_layers = results["fp8"]["fp8_layers"]
        print(f"fp8 layers ({len(fp8_layers)}): {', '.join(fp8_layers[:6])}{', ...' if len(fp8_layers) > 6 else ''}")
    print(f"{'run':6} {'loss[0]':>9} {'last-' + str(TAIL) + ' mean':>13} {'- floor':>8} {'ms/step':>9}")
    for mp, r in results.items():
        tail = tail_mean(r["losses"])
        note = "  BELOW THE FLOOR: memorized (data seen again) or the target leaks" if tail < FLOOR - 0.01 else ""
        print(f"{mp:6} {r['losses'][0]:9.4f} {tail:13.4f} {tail - FLOOR:+8.4f} {r['s_per_step'] * 1e3:9.2f}{note}")
    if "bf16" in results and "fp8" in results:
        bf16, fp8 = results["bf16"], results["fp8"]
        diff = tail_mean(fp8["losses"]) - tail_mean(bf16["losses"])
        ratio = fp8["s_per_step"] / bf16["s_per_step"]
        print(f"loss difference fp8 - bf16 (last-{TAIL} means): {diff:+.4f} ({diff / tail_mean(bf16['losses']):+.2%})")
        print(f"time ratio fp8 / bf16: {ratio:.3f} (speed-up {1 / ratio:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": name, "floor": FLOOR, **results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
