"""What fabric_lite's XLA strategy costs per training step, next to the same loop written with torch_xla by hand.

Both loops train the same MLP (64 -> 256 -> 256 -> 10, batch 64, same initial weights, SGD with momentum,
cross-entropy) on one XLA device, in the same process, from the same synthetic data in a CPU DataLoader
that shuffles with its own seeded generator. The prepared loader draws epoch e's order from seed + e; the
raw loop reseeds its generator the same way at each epoch start (as DistributedSampler.set_epoch does), so
both loops see the same batches in the same order:

  raw          model.to(torch_xla.device()); per batch: x, y = x.to(device), y.to(device), forward,
               loss.backward(), optimizer.step(), optimizer.zero_grad(), torch_xla.sync().
  accelerator  Accelerator(accelerator="tpu"), model, optimizer, loader = prepare(model, optimizer, loader),
               accelerator.backward(loss), optimizer.step(), optimizer.zero_grad(). The strategy marks a
               step (torch_xla.sync()) after each optimizer step and at each batch the prepared loader hands
               over, and moves the batch with .to(device).

torch_xla runs a step's graph asynchronously at the step marker, so every run of N steps ends by reading
its last loss (.item()): a timed repeat holds all of its work and none of the next one's. The first steps
compile the graphs (the first SGD step, without momentum buffers, is a graph of its own), so both loops
warm up before timing. Timed repeats alternate between the loops (raw, accelerator, accelerator, raw,
...) as in overhead.py, then each loop trains a cProfile window of whole epochs to count function calls
per step, the figure that load on the machine does not move. Last, the script compares the two models'
final weights (both trained the same number of steps on the same batches).

Needs torch_xla, which runs only next to the torch of its own version: run it with the XLA environment's
Python (`make venv-xla`). PJRT_DEVICE defaults to CPU (XLA's CPU device) when it is not set.

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_overhead.py              # ~1 minute on 2 cores
    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_overhead.py --quick      # smoke run, a few seconds
    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_overhead.py --profile-diff   # what the extra calls are
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla loads: XLA's CPU device unless told otherwise

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (  # noqa: E402  (the same helpers as the other benchmarks)
    FRAMEWORK, RAW, build_mlp, endless, fmt_s, is_python, print_diff, profile_calls, time_interleaved,
)

Runner = Callable[[int], None]  # run(n): n training steps, then the last loss read back (all work done)


@dataclass
class Spec:
    sizes: Tuple[int, ...] = (64, 256, 256, 10)
    batch: int = 64
    samples: int = 4096  # 64 batches an epoch
    steps: int = 300  # timed steps per repeat
    warmup: int = 20  # untimed steps per loop before the first repeat (graph compilation)
    lr: float = 0.01
    momentum: float = 0.9


QUICK = dict(steps=10, warmup=5, samples=1024)
DATA_SEED = 1234  # the synthetic data
ORDER_SEED = 5678  # each loop's DataLoader shuffles with its own generator seeded with this


def synthetic_data(spec: Spec) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(spec.samples, spec.sizes[0], generator=g)
    y = torch.randint(0, spec.sizes[-1], (spec.samples,), generator=g)
    return x, y


def make_loader(spec: Spec, data: Tuple[torch.Tensor, torch.Tensor]) -> DataLoader:
    return DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True,
                      generator=torch.Generator().manual_seed(ORDER_SEED))


def make_model_and_optimizer(spec: Spec) -> Tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_mlp(spec.sizes)
    return model, torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)


def raw_loop(spec: Spec, data: Tuple[torch.Tensor, torch.Tensor], torch_xla: Any) -> Tuple[Runner, int, nn.Module]:
    """The loop as written with torch_xla alone: one step marker per step."""
    device = torch_xla.device()
    torch.manual_seed(0)
    model = build_mlp(spec.sizes).to(device)  # the optimizer is built on the XLA parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    loader = make_loader(spec, data)
    generator = loader.generator
    # Each epoch's order drawn from seed + epoch (as DistributedSampler.set_epoch does): the order the prepared
    # loader draws from a DataLoader given a seeded generator, so both loops see the same batches.
    stream = endless(loader, lambda epoch: generator.manual_seed(ORDER_SEED + epoch))
    sync = torch_xla.sync

    def run(n: int) -> None:
        loss = None
        for _ in range(n):
            x, y = next(stream)
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync()
        if loss is not None:
            loss.item()  # waits for the last step's graph

    return run, len(loader), model


def framework_loop(spec: Spec, data: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[Runner, int, nn.Module, Any]:
    """The same loop through the Accelerator on XLA: prepare(model, optimizer, loader) and backward(loss)."""
    from fabric_lite import Accelerator

    accelerator = Accelerator(accelerator="tpu")
    model, optimizer = make_model_and_optimizer(spec)
    loader = make_loader(spec, data)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.device.type != "xla":
        raise RuntimeError(f"expected the Accelerator on an XLA device, got {accelerator.device}")

    stream = endless(loader)  # the prepared loader moves to the next epoch's order by itself

    def run(n: int) -> None:
        loss = None
        for _ in range(n):
            x, y = next(stream)
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()  # the strategy marks the step here
            optimizer.zero_grad()
        if loss is not None:
            loss.item()  # waits for the last step's graph

    return run, len(loader), model, accelerator


def weights_difference(a: nn.Module, b: nn.Module) -> Tuple[float, int]:
    """Max |a - b| over all parameters (read back to the CPU), and the number of parameters compared."""
    sa = {k: v.detach().cpu() for k, v in a.state_dict().items()}
    sb = {k: v.detach().cpu() for k, v in b.state_dict().items()}
    if sa.keys() != sb.keys():
        raise RuntimeError(f"the two models differ in their parameters: {sorted(sa)} vs {sorted(sb)}")
    diff = max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)
    return diff, sum(v.numel() for v in sa.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps only: checks that the script works")
    parser.add_argument("--steps", type=int, help="timed steps per repeat (default 300; 10 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each loop (default 7; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps per loop before timing (default 20; 5 with --quick)")
    parser.add_argument("--profile-epochs", type=int, default=2,
                        help="epochs in the cProfile window that counts calls per step (default 2)")
    parser.add_argument("--profile-diff", action="store_true",
                        help="print the functions behind the extra calls per step")
    parser.add_argument("--top", type=int, default=25, help="rows in the --profile-diff listing")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    try:
        import torch_xla
        import torch_xla.runtime as xr
    except (ImportError, OSError) as err:
        print(f"torch_xla is not importable here ({type(err).__name__}: {err}): run `make venv-xla` and start this "
              f"script with .venv-xla/bin/python (PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_overhead.py).")
        return

    repeats = args.repeats or (3 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    spec = Spec()
    if args.quick:
        for k, v in QUICK.items():
            setattr(spec, k, v)
    if args.steps:
        spec.steps = args.steps
    if args.warmup is not None:
        spec.warmup = args.warmup

    data = synthetic_data(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch_xla's start-up notices are not part of a step
        raw_run, raw_epoch, raw_model = raw_loop(spec, data, torch_xla)
        fw_run, fw_epoch, fw_model, accelerator = framework_loop(spec, data)
    if raw_epoch != fw_epoch:
        raise RuntimeError(f"loaders differ in length ({raw_epoch} vs {fw_epoch} batches per epoch)")
    device = torch_xla.device()
    print(f"fabric_lite XLA overhead: raw torch_xla loop vs Accelerator(accelerator='tpu') | torch {torch.__version__} "
          f"| torch_xla {torch_xla.__version__} | {device} (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}, "
          f"{xr.global_runtime_device_count()} device(s)) | strategy {type(accelerator.strategy).__name__} | "
          f"MLP {'->'.join(map(str, spec.sizes))}, batch {spec.batch} | {repeats} interleaved repeats of "
          f"{spec.steps} steps" + (" | QUICK" if args.quick else ""), flush=True)

    loops: Dict[str, Runner] = {RAW: raw_run, FRAMEWORK: fw_run}
    t0 = time.perf_counter()
    for run in loops.values():
        run(spec.warmup)  # compiles the graphs (first step, then the steps with momentum buffers)
    warmup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    per_step = time_interleaved(loops, spec.steps, repeats, ddp=False)
    timing_s = time.perf_counter() - t0

    # Whole epochs, so every window holds the same number of epoch starts in both loops.
    window = max(1, args.profile_epochs) * raw_epoch
    calls = {name: profile_calls(run, window) for name, run in loops.items()}

    # Both loops trained warm-up + repeats x steps + window steps on the same batches from the same weights.
    trained_steps = spec.warmup + repeats * spec.steps + window
    diff, n_params = weights_difference(raw_model, fw_model)

    med = {n: statistics.median(v) for n, v in per_step.items()}
    paired = [f / r for f, r in zip(per_step[FRAMEWORK], per_step[RAW])]
    total = {n: sum(c.values()) for n, c in calls.items()}
    python = {n: sum(v for k, v in c.items() if is_python(k)) for n, c in calls.items()}
    result = {
        "model": "->".join(map(str, spec.sizes)), "batch": spec.batch, "steps_per_repeat": spec.steps,
        "repeats": repeats, "warmup_steps": spec.warmup, "device": str(device),
        "pjrt_device": os.environ.get("PJRT_DEVICE"), "torch": torch.__version__,
        "torch_xla": torch_xla.__version__, "seconds_per_step": per_step, "median": med,
        "ratio_median": med[FRAMEWORK] / med[RAW],
        "ratio_min": min(per_step[FRAMEWORK]) / min(per_step[RAW]),
        "ratio_paired_median": statistics.median(paired), "ratio_paired_min": min(paired),
        "ratio_paired_max": max(paired),
        "calls_per_step": total, "python_calls_per_step": python,
        "calls_ratio": total[FRAMEWORK] / total[RAW],
        "python_calls_ratio": python[FRAMEWORK] / python[RAW], "profile_window_steps": window,
        "trained_steps": trained_steps, "weights_max_abs_diff": diff, "parameters": n_params,
        "warmup_seconds": warmup_s, "timing_seconds": timing_s,
    }
    if args.profile_diff:
        print_diff("xla", calls[RAW], calls[FRAMEWORK], args.top)

    print()
    print(f"{'loop':12} {'median s/step':>13} {'min':>10} {'max':>10} {'calls/step':>11} {'python fn':>10}")
    for n in (RAW, FRAMEWORK):
        v = per_step[n]
        print(f"{n:12} {fmt_s(med[n]):>13} {fmt_s(min(v)):>10} {fmt_s(max(v)):>10} "
              f"{total[n]:11.1f} {python[n]:10.1f}")
    print()
    print(f"{'time ratio':>10} {'of mins':>7} {'paired: median [min..max]':>26} {'calls ratio':>11} "
          f"{'+calls/step':>11} {'python fn ratio':>15} {'+python fn':>10}")
    paired_s = (f"{result['ratio_paired_median']:.3f} "
                f"[{result['ratio_paired_min']:.3f}..{result['ratio_paired_max']:.3f}]")
    print(f"{result['ratio_median']:10.3f} {result['ratio_min']:7.3f} {paired_s:>26} {result['calls_ratio']:11.3f} "
          f"{total[FRAMEWORK] - total[RAW]:11.1f} {result['python_calls_ratio']:15.3f} "
          f"{python[FRAMEWORK] - python[RAW]:10.1f}")
    print(f"\nfinal weights after {trained_steps} steps each: max |raw - accelerator| = {diff:.3g} "
          f"over {n_params} parameters")
    print("\ntime ratio = median(accelerator s/step) / median(raw s/step); of mins = the same with each\n"
          "loop's fastest repeat; paired = per-repeat ratios of back-to-back runs.\n"
          "calls/step = function calls cProfile sees per step (Python and C); python fn = Python functions only.\n"
          f"warm-up (graph compilation, {spec.warmup} steps per loop): {warmup_s:.1f} s; "
          f"timed repeats: {timing_s:.1f} s.")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
