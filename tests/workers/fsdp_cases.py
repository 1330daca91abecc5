"""FSDP2 worker (tests/strategies/test_fsdp.py). One `--phase` per launch:

- `train`: FSDP against DDP on the same data in the same processes (fp32, accumulation, clipping), bf16 and
  fp16 policies, meta-device init + full weights scattered from rank 0, tied weights, activation
  checkpointing, an optimizer that already stepped;
- `save`: train 3 optimizer steps of an epoch with `--strategy`, `save_state(--ckpt)`, then finish the epoch;
  reports the weights and optimizer state at the save and the sample indices seen before and after it;
- `load`: a fresh run (other seed) with `--strategy` on any number of processes: `load_state(--ckpt)`, report
  the weights and optimizer state, then finish the epoch from the restored position (indices seen).
"""

import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from common import IndexDataset, parse, write_result
from fsdp_model import Block, make
from fabric_lite import Accelerator, FSDPStrategy, set_seed

args = parse({
    "--phase": {"required": True},
    "--strategy": {"default": "fsdp"},
    "--kind": {"default": "sharded"},
    "--ckpt": {"default": None},
    "--width": {"type": int, "default": 16},
})


class Tied(nn.Module):
    """A weight used inside a block and by a layer outside it (as tied input and output embeddings)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = Block(4)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.body.fc.weight

    def forward(self, x):
        return self.out(self.body(x))


def strategy(name, **kwargs):
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={"Block"}, **kwargs)
    return name


def data(n=48):
    return DataLoader(IndexDataset(n), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))


def loss_of(model, x):
    return (model(x) - x[:, :3]).pow(2).mean()


def full(acc, model):
    """{name: flat list} of the whole weights (gathered by the strategy), on rank 0."""
    return {k: v.reshape(-1).tolist() for k, v in acc.get_state_dict(model).items()}


def full_optimizer(opt):
    sd = opt.state_dict()
    return {f"{i}.{k}": (v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else v)
            for i, entry in sd.get("state", {}).items() for k, v in entry.items()}


def run(name, precision="no", accumulation=2, clip=0.5, steps=6, **kwargs):
    acc = Accelerator(strategy=strategy(name, **kwargs), gradient_accumulation_steps=accumulation,
                      mixed_precision=precision)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built on the unsharded model: prepare re-points it
    opt, model, loader = acc.prepare(opt, model, data())
    norms = []
    for i, (x, _) in enumerate(loader):
        if i == steps * accumulation:
            break
        with acc.accumulate(model):
            acc.backward(loss_of(model, x))
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return acc, model, opt, norms


def phase_train():
    out = {}
    ddp_acc, ddp_model, _, ddp_norms = run("ddp")
    ref = full(ddp_acc, ddp_model)
    acc, model, opt, norms = run("fsdp")
    out["fp32"] = {"ddp": ref, "fsdp": full(acc, model), "ddp_norms": ddp_norms, "fsdp_norms": norms,
                   "sharded": [type(p).__name__ for p in model.parameters()],
                   "local_rows": [p.to_local().shape[0] for p in model.parameters()]}
    acc, model, opt, _ = run("fsdp", precision="bf16")
    out["bf16"] = {"weights": full(acc, model), "master": sorted({str(p.dtype) for p in model.parameters()}),
                   "state": sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim()})}
    with warnings.catch_warnings():  # ShardedGradScaler's DTensor found_inf warns once per process
        warnings.simplefilter("ignore")
        acc, model, opt, _ = run("fsdp", precision="fp16")
        out["fp16"] = {"weights": full(acc, model), "scaler": type(acc.scaler).__name__,
                       "skipped": opt.step_was_skipped}
    acc, model, _, _ = run("fsdp", activation_checkpointing=True)
    out["checkpointed"] = {"weights": full(acc, model), "recomputed": acc.strategy.plans[-1]["recomputed"]}

    # meta-device init: nothing allocated until prepare; then the reference weights scattered from rank 0
    acc = Accelerator(strategy=strategy("fsdp"))
    with acc.init_module():
        model = make()
    on_meta = all(p.is_meta for p in model.parameters())
    model = acc.prepare(model)
    materialized = not any(p.to_local().is_meta for p in model.parameters())
    initial = full(acc, model)  # reset_parameters on whole-size stand-ins: the values of a whole build
    acc.load_model_weights(model, make(seed=5).state_dict() if acc.is_main_process else {})
    out["meta"] = {"built_on_meta": on_meta, "materialized": materialized, "initial": initial, "weights": full(acc, model),
                   "reference": {k: v.reshape(-1).tolist() for k, v in make().state_dict().items()},
                   "loaded_reference": {k: v.reshape(-1).tolist() for k, v in make(seed=5).state_dict().items()}}
    bad = make(width=8).state_dict()
    try:
        acc.load_model_weights(model, bad)
        out["meta"]["bad_weights"] = None
    except ValueError as err:
        out["meta"]["bad_weights"] = str(err)

    # tied weights stay in one group (the root's), and train as DDP does
    results = {}
    for name in ("ddp", "fsdp"):
        acc = Accelerator(strategy=FSDPStrategy(auto_wrap_policy={"Block"}) if name == "fsdp" else "ddp")
        model = Tied()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        g = torch.Generator().manual_seed(acc.process_index)
        for _ in range(3):
            acc.backward(model(torch.randn(4, 4, generator=g)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        results[name] = full(acc, model)
        if name == "fsdp":
            results["kept_whole"] = acc.strategy.plans[-1]["kept_whole"]
            results["still_tied"] = model.out.weight is model.body.fc.weight
    out["tied"] = results

    # an optimizer that stepped on the unsharded model cannot follow it onto the shards
    acc = Accelerator(strategy=strategy("fsdp"))
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    loss_of(model, torch.randn(2, 4)).backward()
    opt.step()
    try:
        acc.prepare(model, opt)
        out["stepped_optimizer"] = None
    except ValueError as err:
        out["stepped_optimizer"] = str(err)
    out.update(review_cases())
    return out


def review_cases():
    """Edge cases: per-rank initial weights, a partly-meta model, nested no_sync, load errors that must
    reach every rank, partially populated and frozen optimizer state through a sharded checkpoint."""
    import os
    import tempfile

    out = {}
    rank = int(os.environ.get("RANK", 0))
    # every process starts from rank 0's weights, whatever each built (as DDP broadcasts them)
    acc = Accelerator(strategy=strategy("fsdp"))
    model = acc.prepare(make(seed=rank))
    weights = full(acc, model)  # (a collective: every rank)
    out["rank0_weights"] = max_abs(weights, make(seed=0)) if acc.is_main_process else None

    # a pretrained part built for real and a new head on the meta device: only the head is initialized
    acc = Accelerator(strategy=strategy("fsdp"))
    pretrained = make(seed=9)
    with acc.init_module(empty_init=True):
        head = nn.Linear(3, 2)
    model = acc.prepare(nn.Sequential(pretrained, head))
    weights = full(acc, model)
    if acc.is_main_process:
        out["pretrained_kept"] = max_abs({k[2:]: v for k, v in weights.items() if k.startswith("0.")}, make(seed=9))
        out["head_initialized"] = not any(v != v for v in weights["1.weight"]) and any(weights["1.weight"])

    # nested no_sync: the inner one must not switch synchronization back on for the rest of the outer one
    acc = Accelerator(strategy=strategy("fsdp"))
    model = acc.prepare(make())
    x = torch.randn(4, 4)
    with acc.no_sync(model):
        with acc.no_sync(model):
            pass
        acc.backward(loss_of(model, x))
        inside = [p.grad is None for p in model.parameters()]
    acc.backward(loss_of(model, x))
    out["nested_no_sync"] = {"no_grad_inside": all(inside), "grad_after": all(p.grad is not None for p in model.parameters())}

    # errors that only rank 0 meets reach every rank (no hang), and nothing meta is loaded into
    try:
        acc.load_model_weights(model, "/nonexistent/weights.safetensors")
        out["missing_weights"] = None
    except ValueError as err:
        out["missing_weights"] = str(err)
    with acc.init_module():
        on_meta = make()
    try:
        meta_strategy = Accelerator(strategy=strategy("fsdp")).strategy
        meta_strategy.checkpoint_format.load_module_state_dict(on_meta, make().state_dict())
        out["meta_target"] = None
    except ValueError as err:
        out["meta_target"] = str(err)

    # optimizer state through a sharded checkpoint when the loading run has frozen parameters, or already
    # has state for some parameters only, or another optimizer configuration (nothing made up stays)
    folder = acc.strategy.collectives.broadcast_object(tempfile.mkdtemp(prefix="fsdp-optim-") if acc.is_main_process else None)
    acc = Accelerator(strategy=strategy("fsdp"))
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for _ in range(2):
        acc.backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
    acc.save_state(f"{folder}/ckpt")
    saved = full_optimizer(opt)
    results = {}
    for case in ("frozen", "partial", "amsgrad"):
        acc = Accelerator(strategy=strategy("fsdp"))
        model = make(seed=4)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=case == "amsgrad")
        model, opt = acc.prepare(model, opt)
        if case == "partial":  # a step that gives only the first layer state
            for p in list(model.parameters())[2:]:
                p.requires_grad_(False)
            acc.backward(loss_of(model, x))
            opt.step()
            opt.zero_grad()
        if case in ("frozen", "partial"):
            for p in list(model.parameters())[2:]:
                p.requires_grad_(case == "partial")
        before = full_optimizer(opt)
        try:
            acc.load_state(f"{folder}/ckpt")
            now = full_optimizer(opt)  # (a collective: every rank)
            results[case] = {"equal": now == saved if acc.is_main_process else None}
        except Exception as err:  # noqa: BLE001 (reported)
            results[case] = {"error": f"{type(err).__name__}: {err}", "unchanged": full_optimizer(opt) == before}
    out["optimizer_cases"] = results
    return out


def max_abs(weights, model):
    return max((torch.tensor(weights[k]) - v.reshape(-1)).abs().max().item() for k, v in model.state_dict().items())


def phase_save():
    set_seed(0)
    acc = Accelerator(strategy=strategy(args.strategy, state_dict_type=args.kind) if args.strategy == "fsdp"
                      else args.strategy)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, data())
    before, after, out = [], [], {}
    for i, (x, index) in enumerate(loader):
        acc.backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
        (before if i < 3 else after).extend(acc.gather_for_metrics(index).tolist())
        if i == 2:
            acc.save_state(args.ckpt)
            out = {"weights": full(acc, model), "optimizer": full_optimizer(opt)}
    out.update(before=before, after=after)
    return out


def phase_load():
    set_seed(1)  # another seed: everything must come from the checkpoint
    acc = Accelerator(strategy=strategy(args.strategy) if args.strategy == "fsdp" else args.strategy)
    model = make(seed=1, width=args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, data())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            acc.load_state(args.ckpt)
        except Exception as err:  # noqa: BLE001 (reported to the test)
            return {"error": f"{type(err).__name__}: {err}"}
    out = {"weights": full(acc, model), "optimizer": full_optimizer(opt),
           "warnings": [str(w.message) for w in caught]}
    seen = []
    for x, index in loader:
        acc.backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
        seen.extend(acc.gather_for_metrics(index).tolist())
    out["after"] = seen
    return out


result = {"train": phase_train, "save": phase_save, "load": phase_load}[args.phase]()
acc = Accelerator()
write_result(args.out, acc.process_index, result)
acc.end_training()
print(f"fsdp worker rank {acc.process_index}: {args.phase} done", file=sys.stderr)
