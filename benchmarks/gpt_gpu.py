"""A GPT-2-small-sized model in bf16 mixed precision on one GPU: raw PyTorch vs Accelerator vs Trainer.

The same model (12 layers, 12 heads, width 768, context 1024, vocabulary 50304: 124M parameters),
the same initial weights, the same random tokens and the same fused AdamW, trained three ways in one
process, timed in interleaved repeats (ABBA order, the GPU synchronized around each repeat):

- raw: `batch.to(device, non_blocking=True)` from a pinned-memory DataLoader, `torch.autocast(bf16)`,
  `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad(set_to_none=True)`;
- accelerator: `Accelerator(mixed_precision="bf16")`, `prepare(model, optimizer, loader)`,
  `accelerator.backward(loss)`;
- trainer: `Trainer(precision="bf16-mixed")` fitting a TrainModule whose `training_step` returns the
  loss and calls `self.log` on it every step (a fresh `fit` of N steps per repeat, its set-up in the time).

Reported per loop: tokens/s, model TFLOP/s and MFU (model FLOPs, 6N + 12·L·T·d per token, over the
GPU's dense bf16 peak), the ratio to raw, peak CUDA memory during a repeat, and Python function calls
per step (cProfile: a run of 2N steps minus a run of N, over N, so a fit's set-up is left out). The loss is computed inside the model, so the forward
returns a scalar (no fp32 copy of the logits in any loop).

    python benchmarks/gpt_gpu.py                     # one GPU, ~2 minutes
    python benchmarks/gpt_gpu.py --compile           # the model under torch.compile in every loop
    python benchmarks/gpt_gpu.py --quick             # smoke run: a 2-layer model, CPU if there is no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import endless, profile_calls  # noqa: E402  (the same helpers as the other benchmarks)

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of torch.cuda.get_device_name().
# The first match wins, so the PCIe and NVL H100s come before the SXM one.
PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989.4e12, "A100": 312e12,
             "L40S": 362.05e12, "A10G": 70e12}


@dataclass
class GPTConfig:
    vocab: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    context: int = 1024
    layers: int = 12
    heads: int = 12
    width: int = 768


QUICK = GPTConfig(vocab=512, context=64, layers=2, heads=2, width=64)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(tokens)` takes (B, T+1) token ids and returns the mean loss."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def flops_per_token(c: GPTConfig, model: nn.Module) -> float:
    """Training FLOPs per token: 6 per weight used in a matrix product (the tied embedding once, as the
    output layer; the position table is a lookup) plus the attention scores and their use, 12·L·T·d."""
    n = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    return 6 * n + 12 * c.layers * c.context * c.width


def build(c: GPTConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPT(c).to(device)


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


def make_loader(c: GPTConfig, batch: int, samples: int, device: torch.device) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, c.vocab, (samples, c.context + 1), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=True, drop_last=True,
                      pin_memory=device.type == "cuda")


Runner = Callable[[int], None]


def raw_loop(c: GPTConfig, batch: int, samples: int, device: torch.device, compile_: bool) -> Runner:
    model = build(c, device)
    if compile_:
        model = torch.compile(model)
    optimizer = make_optimizer(model, device)
    stream = endless(make_loader(c, batch, samples, device))

    def run(n: int) -> None:
        for _ in range(n):
            (tokens,) = next(stream)
            tokens = tokens.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def accelerator_loop(c: GPTConfig, batch: int, samples: int, device: torch.device, compile_: bool) -> Runner:
    from fabric_lite import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
    model = build(c, device)
    if compile_:
        model = torch.compile(model)
    optimizer = make_optimizer(model, device)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(c, batch, samples, device))
    stream = endless(loader)

    def run(n: int) -> None:
        for _ in range(n):
            (tokens,) = next(stream)
            loss = model(tokens)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    return run


def trainer_loop(c: GPTConfig, batch: int, samples: int, device: torch.device, compile_: bool,
                 root: str) -> Runner:
    from fabric_lite import Trainer, TrainModule

    class GPTModule(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            gpt = build(c, device)
            self.gpt = torch.compile(gpt) if compile_ else gpt
            self._optimizer = make_optimizer(self.gpt, device)  # one optimizer (and its state) for every fit

        def training_step(self, b, batch_idx):
            loss = self.gpt(b[0])
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return self._optimizer

    module = GPTModule()
    loader = make_loader(c, batch, samples, device)

    def run(n: int) -> None:
        trainer = Trainer(max_steps=n, accelerator=device.type, devices=1, precision="bf16-mixed",
                          enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=50,
                          num_sanity_val_steps=0, default_root_dir=root)
        trainer.fit(module, loader)

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loops(loops: Dict[str, Runner], steps: int, repeats: int, device: torch.device):
    seconds: Dict[str, List[float]] = {k: [] for k in loops}
    peak: Dict[str, List[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            gc.collect()
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            loops[name](steps)
            sync(device)
            seconds[name].append(time.perf_counter() - start)
            if device.type == "cuda":
                peak[name].append(torch.cuda.max_memory_allocated(device) / 2**30)
    return seconds, peak


def steady_calls_per_step(run: Runner, steps: int, device: torch.device) -> float:
    """Python function calls per step without a run's set-up: calls(2N steps) - calls(N steps), over N
    (a Trainer repeat is a whole fit, whose set-up would otherwise be spread over the window)."""
    def synced(n: int) -> None:
        run(n)
        sync(device)

    sync(device)
    long = sum(profile_calls(synced, 2 * steps).values()) * 2 * steps
    short = sum(profile_calls(synced, steps).values()) * steps
    return (long - short) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repeat (default 30)")
    parser.add_argument("--repeats", type=int, default=4, help="repeats per loop, ABBA order (default 4)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps per loop first (default 8)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--profile-steps", type=int, default=10, help="cProfile window per loop (default 10)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every loop")
    parser.add_argument("--loops", default="raw,accelerator,trainer")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak, where the script does not know it")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, few steps (a smoke run)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = GPTConfig()
    if args.quick:
        c = QUICK
        args.steps, args.repeats, args.warmup, args.batch, args.profile_steps = 3, 2, 1, 4, 2
    elif device.type == "cpu":
        print("No GPU: this benchmark is meant for one (use --quick for a smoke run on the CPU).")
        return
    samples = args.batch * 64
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_BF16.items() if k in name), None) if device.type == "cuda" else None

    builders = {"raw": raw_loop, "accelerator": accelerator_loop, "trainer": trainer_loop}
    wanted = [s.strip() for s in args.loops.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in builders]
    if unknown or "raw" not in wanted:
        parser.error(f"--loops {args.loops!r}: choose among {', '.join(builders)}, raw included")

    with tempfile.TemporaryDirectory() as root:
        loops: Dict[str, Runner] = {}
        for w in wanted:
            extra = (root,) if w == "trainer" else ()
            loops[w] = builders[w](c, args.batch, samples, device, args.compile, *extra)
        with torch.device("meta"):  # shapes only: no memory, no draw from the global generator
            shapes = GPT(c)
        per_token = flops_per_token(c, shapes)
        params = sum(p.numel() for p in shapes.parameters())
        sink = open(os.devnull, "w")
        with contextlib.redirect_stderr(sink):  # the Trainer's start-up lines
            for run in loops.values():
                run(args.warmup)
            sync(device)
            seconds, peaks = time_loops(loops, args.steps, args.repeats, device)
            calls = {k: steady_calls_per_step(run, args.profile_steps, device) for k, run in loops.items()}
        sink.close()

    tokens = args.batch * c.context * args.steps
    print(f"\nGPT {params / 1e6:.0f}M parameters ({c.layers} layers, width {c.width}, context {c.context}), "
          f"batch {args.batch} x {c.context} tokens, bf16 autocast, fused AdamW"
          f"{', torch.compile' if args.compile else ''}; device: {name}; torch {torch.__version__}")
    print(f"{args.repeats} repeats of {args.steps} steps per loop (after {args.warmup} warm-up steps); "
          f"{per_token / 1e9:.3f} GFLOP per token"
          + (f"; MFU against {peak_flops / 1e12:.0f} TFLOP/s" if peak_flops else ""))
    header = f"{'loop':<12} {'tokens/s':>10} {'min..max':>19} {'TFLOP/s':>8} {'MFU':>6} {'ratio':>6} " \
             f"{'peak GiB':>9} {'calls/step':>10}"
    print(header)
    raw_median = statistics.median(seconds["raw"])
    results = {}
    for k in loops:
        med = statistics.median(seconds[k])
        tps = tokens / med
        tflops = tps * per_token / 1e12
        mfu = tps * per_token / peak_flops if peak_flops else None
        peak_gib = statistics.median(peaks[k]) if peaks[k] else None
        results[k] = dict(tokens_per_s=tps, tflops=tflops, mfu=mfu, time_ratio=med / raw_median,
                          seconds=seconds[k], peak_gib=peak_gib, calls_per_step=calls[k])
        span = f"{tokens / max(seconds[k]):.0f}..{tokens / min(seconds[k]):.0f}"
        print(f"{k:<12} {tps:>10.0f} {span:>19} {tflops:>8.1f} "
              f"{(f'{mfu:.1%}' if mfu is not None else '-'):>6} {med / raw_median:>6.3f} "
              f"{(f'{peak_gib:.2f}' if peak_gib is not None else '-'):>9} {calls[k]:>10.0f}")
    print("ratio: median seconds per repeat over raw's (lower is better); peak GiB: "
          "torch.cuda.max_memory_allocated during a repeat (all three models are resident)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            config=asdict(c), batch=args.batch, steps=args.steps, repeats=args.repeats, compile=args.compile,
            device=name, torch=torch.__version__, flops_per_token=per_token, peak_flops=peak_flops,
            date=time.strftime("%Y-%m-%d"), loops=results), indent=2))


if __name__ == "__main__":
    main()
