"""fabric_lite next to its peers: the tiny-MLP workload of overhead.py through Hugging Face Accelerate,
Lightning Fabric and the Lightning Trainer, side by side with fabric_lite and the raw PyTorch loop.

Every loop trains the same MLP (same initial weights, same data in a shuffling DataLoader, AdamW,
cross-entropy) in one process, on the CPU (the script hides GPUs, so every library picks the CPU).
Two kinds of loop:

  step loops   built once, then timed step after step: the raw loop (overhead.py), fabric_lite's
               Accelerator (overhead.py), `accelerate.Accelerator` (prepare + backward) and
               `lightning.fabric.Fabric` (setup + setup_dataloaders + backward).
  fresh fits   every repeat is a new Trainer and a `fit` of N steps, set-up included, as in
               trainer_overhead.py: fabric_lite's Trainer bare and the Lightning Trainer with the same
               things switched off (no logger, progress bar, checkpoints, model summary or sanity
               check). Both modules call `self.log("train/loss", loss, prog_bar=True)` every step.

Timed repeats alternate in ABBA order over all loops; ratios are to the raw loop's median. Calls per
step come from cProfile: over 4 epochs of steps for a step loop; for a fit, as the difference between
a fit of 5 epochs and one of 1 epoch, over the 4 epochs between (so set-up is left out, and reported
apart as "set-up calls"). "set-up s" is the median wall time of building the loop and training one
step (for a fit: a 1-step fit).

Peers that are not installed are named and skipped; the rest still runs. Install them in a separate
environment (see benchmarks/README.md), not in the project's own.

    python benchmarks/peers.py            # ~1.5 minutes with both peers
    python benchmarks/peers.py --quick    # smoke run
"""

from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch loads: the comparison is on the CPU for every library

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from overhead import (  # noqa: E402
    QUICK, SPECS, Spec, build_mlp, endless, framework_loop, is_python, profile_calls, raw_loop, synthetic_data,
    time_interleaved,
)
from trainer_overhead import trainer_loop  # noqa: E402

Runner = Callable[[int], None]
STEP, FIT = "step loop", "fresh fit"


@dataclass
class Loop:
    name: str
    kind: str  # STEP or FIT
    build: Callable[[], Runner]  # STEP: builds the loop (once); FIT: returns run(n), a fresh fit of n steps


def version(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def quiet():
    """Banners, tips and warnings of the libraries are not part of a step: keep them off the table."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


# -- the peers' loops ----------------------------------------------------------------------------

def hf_accelerate_loop(spec: Spec, data) -> Runner:
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = build_mlp(spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stream = endless(loader)

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(stream)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()

    return run


def lightning_fabric_loop(spec: Spec, data) -> Runner:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    torch.manual_seed(0)
    model = build_mlp(spec.sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True))
    stream = endless(loader)

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(stream)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()

    return run


def lightning_trainer_loop(spec: Spec, data, root: str) -> Runner:
    import lightning.pytorch as pl

    class LitTiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = build_mlp(spec.sizes)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def run(n: int) -> None:
        with quiet():
            trainer = pl.Trainer(max_steps=n, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 log_every_n_steps=10**9, default_root_dir=root)
            loader = DataLoader(TensorDataset(*data), batch_size=spec.batch, shuffle=True)
            trainer.fit(LitTiny(), loader)

    return run


# -- measuring -----------------------------------------------------------------------------------

def total_calls(run: Runner, steps: int) -> Tuple[float, float]:
    """(all calls, Python-function calls) that cProfile counts while `run` trains `steps` steps."""
    with quiet():
        per_step = profile_calls(run, steps)
    return (sum(per_step.values()) * steps, sum(v for k, v in per_step.items() if is_python(k)) * steps)


def cpu_name() -> str:
    """The processor's model name, for the record (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "?"
    except Exception:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps only: checks that the script works")
    parser.add_argument("--model", default="tiny", choices=sorted(SPECS), help="workload of overhead.py (default tiny)")
    parser.add_argument("--steps", type=int, help="timed steps per repeat (default 2000 tiny, 16 small)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each loop (default 5; 2 with --quick)")
    parser.add_argument("--setup-repeats", type=int, default=3, help="runs behind the set-up s column (default 3)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    spec = Spec(**SPECS[args.model].__dict__)
    if args.quick:
        for k, v in QUICK[args.model].items():
            setattr(spec, k, v)
    steps = args.steps or spec.steps * (2 if args.model == "tiny" and not args.quick else 1)
    repeats = args.repeats or (2 if args.quick else 5)
    data = synthetic_data(spec)
    epoch = -(-spec.samples // spec.batch)

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "fabric_lite": f"{version('fabric-lite') or 'checkout'} @ {git_commit()}",
                "accelerate": version("accelerate"), "lightning": version("lightning")}
    have_accelerate = versions["accelerate"] is not None and importable("accelerate")
    have_lightning = versions["lightning"] is not None and importable("lightning.pytorch")
    # After the imports: Lightning sets its loggers' levels when it is imported. Its banners ("GPU available")
    # go to handlers that hold the original stderr, which redirect_stderr cannot catch.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)

    print(f"fabric_lite vs peers | {args.model} MLP {'->'.join(map(str, spec.sizes))}, batch {spec.batch} | CPU, "
          f"{torch.get_num_threads()} thread(s) | {repeats} interleaved repeats of {steps} steps"
          f"{' | QUICK' if args.quick else ''}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    missing = [(n, pip) for n, pip, ok in (("Hugging Face Accelerate", "accelerate", have_accelerate),
                                          ("Lightning (Fabric and Trainer)", "lightning", have_lightning)) if not ok]
    for name, pip in missing:
        print(f"NOT INSTALLED: {name} -- its rows are skipped (pip install {pip}, in a separate environment)")
    print(flush=True)

    with tempfile.TemporaryDirectory() as root:
        loops: List[Loop] = [
            Loop("raw", STEP, lambda: raw_loop(spec, data, ddp=False)[0]),
            Loop("fabric_lite Accelerator", STEP, lambda: framework_loop(spec, data, ddp=False)[0]),
        ]
        if have_accelerate:
            loops.append(Loop("HF Accelerate Accelerator", STEP, lambda: hf_accelerate_loop(spec, data)))
        if have_lightning:
            loops.append(Loop("Lightning Fabric", STEP, lambda: lightning_fabric_loop(spec, data)))
        loops.append(Loop("fabric_lite Trainer bare", FIT, lambda: trainer_loop(spec, data, False, f"{root}/fl")))
        if have_lightning:
            loops.append(Loop("Lightning Trainer bare", FIT, lambda: lightning_trainer_loop(spec, data, f"{root}/pl")))

        with quiet():
            runners = {loop.name: loop.build() for loop in loops}
            for run in runners.values():
                run(min(spec.warmup, steps))  # warm-up (a fit: one untimed fit)
            per_step = time_interleaved(runners, steps, repeats, ddp=False)

        # Calls per step; for fits without their set-up (see the docstring).
        window = 4 * epoch
        calls: Dict[str, Dict[str, float]] = {}
        for loop in loops:
            run = runners[loop.name]
            if loop.kind == STEP:
                c, p = total_calls(run, window)
                calls[loop.name] = {"calls_per_step": c / window, "python_per_step": p / window}
            else:
                c1, p1 = total_calls(run, epoch)
                c5, p5 = total_calls(run, epoch + window)
                per, py = (c5 - c1) / window, (p5 - p1) / window
                calls[loop.name] = {"calls_per_step": per, "python_per_step": py, "setup_calls": c1 - per * epoch}

        setup_s: Dict[str, float] = {}
        for loop in loops:
            times = []
            for _ in range(max(1, args.setup_repeats)):
                with quiet():
                    t0 = time.perf_counter()
                    run = loop.build() if loop.kind == STEP else runners[loop.name]
                    run(1)
                    times.append(time.perf_counter() - t0)
            setup_s[loop.name] = statistics.median(times)

    med = {n: statistics.median(v) for n, v in per_step.items()}
    raw_calls = calls["raw"]["calls_per_step"]
    results: Dict[str, dict] = {}
    for loop in loops:
        v = per_step[loop.name]
        paired = [a / b for a, b in zip(v, per_step["raw"])]
        results[loop.name] = {
            "kind": loop.kind, "seconds_per_step": v, "median": med[loop.name],
            "ratio_median": med[loop.name] / med["raw"], "ratio_min": min(v) / min(per_step["raw"]),
            "ratio_paired_median": statistics.median(paired), "setup_s": setup_s[loop.name],
            "calls_ratio": calls[loop.name]["calls_per_step"] / raw_calls, **calls[loop.name],
        }

    print(f"{'loop':<27}{'kind':<11}{'median s/step':>14}{'min':>10}{'max':>10}{'ratio':>7}{'of mins':>8}"
          f"{'paired':>7}{'calls/step':>11}{'python fn':>10}{'calls ratio':>12}{'set-up s':>9}{'set-up calls':>13}")
    for name, r in results.items():
        v = r["seconds_per_step"]
        setup_calls = f"{r['setup_calls']:13.0f}" if "setup_calls" in r else f"{'':13}"
        print(f"{name:<27}{r['kind']:<11}{r['median']:>14.6f}{min(v):>10.6f}{max(v):>10.6f}{r['ratio_median']:>7.3f}"
              f"{r['ratio_min']:>8.3f}{r['ratio_paired_median']:>7.3f}{r['calls_per_step']:>11.1f}"
              f"{r['python_per_step']:>10.1f}{r['calls_ratio']:>12.3f}{r['setup_s']:>9.4f}{setup_calls}")
    print(f"\nratio = median s/step over raw's; of mins = fastest repeat over raw's fastest; paired = median of the "
          f"per-repeat ratios.\nA fresh fit's s/step includes its set-up (one fit of {steps} steps per repeat); its "
          f"calls/step leave set-up out (fit of {epoch + window} steps minus fit of {epoch}).\nset-up s = build the "
          f"loop and train 1 step (a fit: a 1-step fit), median of {max(1, args.setup_repeats)}.")
    if missing:
        print("Skipped (not installed): " + ", ".join(name for name, _ in missing))
    if args.json:
        machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                   "system": platform.platform()}
        args.json.write_text(json.dumps({"versions": versions, "model": args.model, "steps_per_repeat": steps,
                                         "repeats": repeats, "quick": args.quick, "machine": machine,
                                         "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:]),
                                         "date": time.strftime("%Y-%m-%d", time.gmtime()), "loops": results},
                                        indent=2))


if __name__ == "__main__":
    main()
