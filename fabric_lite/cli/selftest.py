"""`fabric-lite test`: the checks each worker runs, started by `fabric-lite launch -m fabric_lite.cli.selftest`.

Every rank runs every check; rank 0 prints one verdict line per check (a check fails when it
failed on any rank) and every rank exits 1 if anything failed, so the launcher reports it.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import InitProcessGroupKwargs

# A broken collective would otherwise wait for gloo's default 30 minutes.
_TIMEOUT = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))


class _Indexed(Dataset):
    """Sample i is (features, label, i): gathered indices say which samples a step saw."""

    def __init__(self, n: int, dim: int = 4) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# -- the checks: each returns a short detail for the verdict line, or raises ----------------------

def check_gather(acc: Accelerator, workdir: str) -> str:
    r, w = acc.process_index, acc.num_processes
    got = acc.gather(torch.tensor([r, r * 10], device=acc.device)).cpu().tolist()
    _expect(got == [v for k in range(w) for v in (k, k * 10)], f"gather gave {got}")
    objects = acc.gather_object([f"rank{r}"])
    _expect(objects == [f"rank{k}" for k in range(w)], f"gather_object gave {objects}")
    return f"{w} tensors and objects in rank order"


def check_reduce(acc: Accelerator, workdir: str) -> str:
    w = acc.num_processes
    value = torch.tensor([float(acc.process_index + 1)], device=acc.device)
    total = acc.reduce(value.clone()).cpu().item()
    mean = acc.reduce(value.clone(), reduction="mean").cpu().item()
    _expect(total == w * (w + 1) / 2, f"sum gave {total}")
    _expect(abs(mean - (w + 1) / 2) < 1e-6, f"mean gave {mean}")
    return f"sum {total:g}, mean {mean:g}"


def check_broadcast(acc: Accelerator, workdir: str) -> str:
    last = acc.num_processes - 1
    got = acc.broadcast(torch.tensor([float(acc.process_index), 5.0], device=acc.device), from_process=last)
    _expect(got.cpu().tolist() == [float(last), 5.0], f"broadcast gave {got.tolist()}")
    return f"from process {last}"


def check_pad_across_processes(acc: Accelerator, workdir: str) -> str:
    r, w = acc.process_index, acc.num_processes
    padded = acc.pad_across_processes(torch.ones(r + 1, 3, device=acc.device), dim=0, pad_index=-1).cpu()
    expected = torch.cat([torch.ones(r + 1, 3), torch.full((w - r - 1, 3), -1.0)])
    _expect(torch.equal(padded, expected), f"rank {r} got shape {tuple(padded.shape)}: {padded.tolist()}")
    return f"rows 1..{w} padded to {w}"


def check_gather_for_metrics(acc: Accelerator, workdir: str) -> str:
    n = 4 * acc.num_processes + 1  # never divides evenly: the padding must be dropped
    loader = acc.prepare(DataLoader(_Indexed(n), batch_size=2))
    seen: List[int] = []
    for _, _, idx in loader:
        seen += acc.gather_for_metrics(idx).cpu().tolist()
    _expect(sorted(seen) == list(range(n)), f"saw {sorted(seen)} instead of 0..{n - 1} once each")
    return f"{n} samples, each counted once"


def check_wait_for_everyone(acc: Accelerator, workdir: str) -> str:
    marker = os.path.join(workdir, "barrier-marker")
    if acc.is_main_process:
        time.sleep(0.3)
        with open(marker, "w") as f:
            f.write("written before the barrier")
    acc.wait_for_everyone()
    _expect(os.path.exists(marker), f"rank {acc.process_index} passed the barrier before rank 0 wrote")
    acc.wait_for_everyone()
    return "every process waited for the main one"


def _train(acc: Accelerator, batch: int, epochs: int = 2) -> Dict[str, Any]:
    w = acc.num_processes
    dataset = _Indexed(8 * w * batch)
    model = _model()
    # the one-process run on the full global batch (rank 0 only), on the same device
    reference = copy.deepcopy(model).to(acc.device)
    features, labels = dataset.x.to(acc.device), dataset.y.to(acc.device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    epochs_seen: List[List[int]] = []
    for _ in range(epochs):
        seen: List[int] = []
        for x, y, idx in loader:
            optimizer.zero_grad()
            acc.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            step = acc.gather(idx).cpu()
            seen += step.tolist()
            if acc.is_main_process:
                ref_opt.zero_grad()
                rows = step.to(acc.device)
                F.cross_entropy(reference(features[rows]), labels[rows]).backward()
                ref_opt.step()
        epochs_seen.append(seen)
    return {"model": model, "optimizer": optimizer, "loader": loader, "reference": reference,
            "seen": epochs_seen, "n": len(dataset)}


def check_training_parity(acc: Accelerator, workdir: str, state: Dict[str, Any]) -> str:
    # fp32 whatever the config says: the claim is exact up to float summation order
    train_acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=1, kwargs_handlers=[_TIMEOUT])
    w, batch = train_acc.num_processes, 4
    run = _train(train_acc, batch)
    state.update(run, accelerator=train_acc)
    for epoch, seen in enumerate(run["seen"]):
        _expect(sorted(seen) == list(range(run["n"])), f"epoch {epoch} did not see every sample exactly once")
    mine = _flat(train_acc.unwrap_model(run["model"]))
    everyone = train_acc.gather(mine.to(train_acc.device).unsqueeze(0)).cpu()
    _expect(all(torch.equal(everyone[0], row) for row in everyone), "the processes ended with different weights")
    diff = torch.zeros(1, device=train_acc.device)
    if train_acc.is_main_process:
        diff += (mine - _flat(run["reference"])).abs().max().item()  # both flattened on the CPU
    diff = train_acc.broadcast(diff, from_process=0).item()
    _expect(diff <= 1e-6, f"{w} processes x batch {batch} differ from 1 process x batch {w * batch} by {diff:.2e}")
    return f"{w} x batch {batch} == 1 x batch {w * batch} (max diff {diff:.1e}), {len(run['seen'][0]) // (w * batch)} steps/epoch"


def check_checkpoint_round_trip(acc: Accelerator, workdir: str, state: Dict[str, Any]) -> str:
    _expect("accelerator" in state, "needs the trained model of the training check, which did not get that far")
    train_acc, model, optimizer = state["accelerator"], state["model"], state["optimizer"]
    path = os.path.join(workdir, "checkpoint")
    train_acc.save_state(path)
    weights = _flat(train_acc.unwrap_model(model))
    momentum = [optimizer.state[p]["momentum_buffer"].detach().clone() for p in train_acc.unwrap_model(model).parameters()]
    after_save = torch.rand(4)
    # change everything the checkpoint holds: weights, optimizer state, random state
    x, y, _ = next(iter(state["loader"]))
    optimizer.zero_grad()
    train_acc.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    torch.rand(100)
    _expect(not torch.equal(weights, _flat(train_acc.unwrap_model(model))), "the extra step changed nothing")
    train_acc.load_state(path)
    _expect(torch.equal(weights, _flat(train_acc.unwrap_model(model))), "weights differ after load_state")
    for p, saved in zip(train_acc.unwrap_model(model).parameters(), momentum):
        _expect(torch.equal(optimizer.state[p]["momentum_buffer"], saved), "optimizer state differs after load_state")
    _expect(torch.equal(torch.rand(4), after_save), "random state differs after load_state")
    train_acc.wait_for_everyone()
    return "weights, optimizer state and random state restored exactly"


CHECKS: List[Tuple[str, Callable[..., str], bool]] = [
    ("gather", check_gather, False),
    ("reduce", check_reduce, False),
    ("broadcast", check_broadcast, False),
    ("pad_across_processes", check_pad_across_processes, False),
    ("gather_for_metrics", check_gather_for_metrics, False),
    ("wait_for_everyone", check_wait_for_everyone, False),
    ("ddp training parity", check_training_parity, True),
    ("checkpoint round-trip", check_checkpoint_round_trip, True),
]


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_lite.cli.selftest")
    parser.add_argument("--workdir", required=True, help="a directory every process can write to")
    args = parser.parse_args(argv)
    acc = Accelerator(kwargs_handlers=[_TIMEOUT])
    if acc.is_main_process:
        print(f"fabric-lite test: {acc.num_processes} process(es), {type(acc.strategy).__name__}, "
              f"device {acc.device.type}, backend {_backend()}, mixed precision {acc.mixed_precision}", flush=True)
    state: Dict[str, Any] = {}
    failed = False
    for name, check, stateful in CHECKS:
        try:
            detail, ok = (check(acc, args.workdir, state) if stateful else check(acc, args.workdir)), True
        except Exception as err:  # a verdict, not a crash: the other checks still run
            detail, ok = f"{type(err).__name__}: {err}", False
            if not isinstance(err, AssertionError):
                traceback.print_exc()
        verdicts = acc.gather_object([(ok, detail)])  # a check fails when it failed on any rank
        bad = [(rank, d) for rank, (good, d) in enumerate(verdicts) if not good]
        failed = failed or bool(bad)
        if acc.is_main_process:
            if bad:
                print(f"FAIL  {name}: " + "; ".join(f"rank {rank}: {d}" for rank, d in bad), flush=True)
            else:
                print(f"ok    {name}: {detail}", flush=True)
    acc.wait_for_everyone()  # a failing rank that left early would get rank 0 killed mid-report
    acc.end_training()
    return 1 if failed else 0


def _backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else "none (one process)"


if __name__ == "__main__":
    raise SystemExit(main())
