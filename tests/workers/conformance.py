"""The strategy conformance worker (tests/strategies/test_conformance.py): every case, one strategy, one launch.

`--phase first` runs the numerical and behavioural cases through both doors, writing rank{r}.json after
each case (so a case that breaks leaves the others' results), then the crash phase: a raw-door run saves
state at optimizer step 4 and is abandoned in the middle of the window after step 5; a Trainer run with
step checkpoints (every 4 steps) SIGKILLs this process in the middle of the window after step 5. Every
rank kills itself at the same micro-step, so none can go on to write anything else.

`--phase resume` (a fresh launch) resumes both killed runs from disk (load_state / fit(ckpt_path="last"),
built from another seed so that nothing can come from anywhere else), runs each again uninterrupted from
scratch for the reference, and reports all four sets of weights.

Weights are always read through `accelerator.get_state_dict` (the strategy gathers sharded parameters:
a collective, called on every rank, valid on rank 0). A case's failure is recorded as its traceback.

N-D layouts (`--dp` below the world size): the ranks of one tensor-parallel group read the same batches, so the
global batch is GLOBAL_BATCH over the `--dp` data-parallel ranks. Where the strategy's device mesh has a
tensor-parallel dimension, every model gets tensor parallelism on it (its first Linear column-wise, its last
row-wise) before `prepare` (raw door) or in `configure_model` (Trainer door).
"""

import json
import os
import signal
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common import IndexDataset, StepCounter, make_model, parse, regression_data, write_result
from fabric_lite import Accelerator, Trainer, TrainModule, set_seed
from fabric_lite.callbacks import Callback, ModelCheckpoint

args = parse({
    "--strategy": {"required": True},
    # the strategy's arguments (JSON): given, the worker builds strategy_class(name)(**them) for every door
    "--strategy-kwargs": {"default": "{}"},
    "--dp": {"type": int, "default": None},  # the data-parallel processes (default: every process)
    "--phase": {"required": True, "choices": ["first", "resume"]},
    "--root": {"required": True},
})
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
DP = args.dp or WORLD
STRATEGY_KWARGS = json.loads(args.strategy_kwargs)

# Numerical cases: 64 samples, global batch 8 (per rank 8 / W), 2 epochs of 8 optimizer steps, SGD with momentum.
N_SAMPLES, GLOBAL_BATCH, EPOCHS, LR, MOMENTUM, LOADER_SEED = 64, 8, 2, 0.1, 0.9, 3
CLIP = 0.3  # well below the gradient norms of this problem: clipping acts on most steps
# Kill and resume: 48 samples, global micro-batch 8, accumulation 2: 3 optimizer steps an epoch, 9 in all;
# saved at step 4 (epoch 1, itself mid-epoch), killed mid-window after step 5.
RESUME_SAMPLES, RESUME_EPOCHS, SAVE_STEP, KILL_STEP = 48, 3, 4, 5
assert GLOBAL_BATCH % (2 * DP) == 0, f"the cases need a data-parallel size dividing {GLOBAL_BATCH // 2}, got {DP}"
assert WORLD % DP == 0, f"--dp {DP} does not divide the {WORLD} processes"
PER_RANK = GLOBAL_BATCH // DP

# What the tests build their plain-torch references from: read from here, never repeated there.
SETTINGS = {"n_samples": N_SAMPLES, "global_batch": GLOBAL_BATCH, "epochs": EPOCHS, "lr": LR, "momentum": MOMENTUM,
            "loader_seed": LOADER_SEED, "clip": CLIP, "resume_epochs": RESUME_EPOCHS, "save_step": SAVE_STEP,
            "kill_step": KILL_STEP, "resume_steps_per_epoch": RESUME_SAMPLES // GLOBAL_BATCH // 2}
results = {"strategy": args.strategy, "phase": args.phase, "world": None, "dp": None, "strategy_class": None,
           "settings": SETTINGS, "cases": {}}


def strategy():
    """What `strategy=` gets: the registry name, or a fresh instance of its class with the case's arguments."""
    if not STRATEGY_KWARGS:
        return args.strategy
    from fabric_lite.strategies import strategy_class

    return strategy_class(args.strategy)(**STRATEGY_KWARGS)


def tp_mesh(mesh):
    """The tensor-parallel dimension of torch's DeviceMesh ("tp", Accelerate's name, or "tensor_parallel",
    Lightning's), or None where there is none or it has one process."""
    names = getattr(mesh, "mesh_dim_names", None) or ()  # (None: no mesh; another runtime's mesh: no names)
    for name in ("tp", "tensor_parallel"):
        if name in names and mesh[name].size() > 1:
            return mesh[name]
    return None


def tensor_parallel(model, mesh):
    """Tensor parallelism on the mesh's tp dimension, if it has one: the first Linear column-wise, the last
    row-wise (the activation between them stays sharded). Returns the model."""
    tp = tp_mesh(mesh)
    if tp is None:
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    assert len(linears) == 2, linears
    return parallelize_module(model, tp, {linears[0]: ColwiseParallel(), linears[1]: RowwiseParallel()})


def run_case(name, fn):
    """Run one case, record its result (or its traceback) and write this rank's file at once."""
    try:
        value = fn()
    except Exception:  # recorded for the test that reads it; the other cases still run
        value = {"error": traceback.format_exc()}
        print(f"conformance[{args.strategy}] rank {RANK}: case {name} failed:\n{value['error']}", file=sys.stderr,
              flush=True)
    results["cases"][name] = value
    write_result(args.out, RANK, results)
    return value


def full_weights(acc, model):
    """{name: flat values} of every parameter, gathered by the strategy; valid on rank 0."""
    state = acc.get_state_dict(model)
    return {k.removeprefix("net."): v.detach().float().reshape(-1).tolist() for k, v in state.items()}


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2) holds this rank's shard


def user_optimizer(prepared, cls):
    """The user's own optimizer object inside whatever the strategy wrapped it in."""
    opt = prepared
    for _ in range(6):
        if isinstance(opt, cls):
            return opt
        opt = getattr(opt, "optimizer", None)
    raise AssertionError(f"no {cls.__name__} inside {type(prepared).__name__}")


def optimizer_state(prepared):
    """This rank's state of the user's optimizer (its partition, under ZeRO), in the optimizer's own order.

    Read from `.state` rather than `state_dict()`: ZeRO-3 keys the state by flat partitions that are not
    in the optimizer's param_groups, which `state_dict()` cannot map."""
    opt = user_optimizer(prepared, torch.optim.SGD)
    tensors = [{n: local(t).detach().float().reshape(-1).tolist() for n, t in entry.items() if torch.is_tensor(t)}
               for entry in opt.state.values()]
    groups = [{k: v for k, v in g.items() if isinstance(v, (int, float, bool, str, type(None)))}
              for g in opt.param_groups]
    return {"state": tensors, "groups": groups}


def train_loader(batch_size, n=N_SAMPLES):
    return DataLoader(IndexDataset(n), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(LOADER_SEED))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# -- the raw door ------------------------------------------------------------------------------------------

def raw_run(per_rank_batch, accumulation=1, clip=None, seed=0):
    """Train make_model() for EPOCHS; returns the prepared objects and the gathered sample order per micro-step."""
    acc = Accelerator(strategy=strategy(), gradient_accumulation_steps=accumulation)
    model = tensor_parallel(make_model(seed=seed), acc.torch_device_mesh)
    opt = sgd(model)
    model, opt, loader = acc.prepare(model, opt, train_loader(per_rank_batch))
    results["world"], results["strategy_class"] = acc.num_processes, type(acc.strategy).__name__
    results["dp"] = acc.strategy.dp_size
    seen = []
    for _ in range(EPOCHS):
        for x, idx in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), idx % 3)
                acc.backward(loss)
                if clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)  # DeepSpeed: sets the limit, clips in its step
                opt.step()
                opt.zero_grad()
            seen.append(acc.gather(idx).tolist())
    return acc, model, opt, seen


PROBE = torch.randn(5, 4, generator=torch.Generator().manual_seed(99))


def probe(model):
    with torch.no_grad():
        return model(PROBE.to(next(model.parameters()).device)).float().tolist()


raw = {}


def case_parity():
    acc, model, opt, seen = raw_run(PER_RANK)
    raw["A"] = (acc, model, opt)
    return {"weights": full_weights(acc, model), "seen": seen, "probe_input": PROBE.tolist(), "probe": probe(model)}


def case_accumulation():
    acc, model, _, seen = raw_run(PER_RANK // 2, accumulation=2)
    return {"weights": full_weights(acc, model), "seen": seen}


def case_clipping():
    acc, model, _, _ = raw_run(PER_RANK, clip=CLIP)
    return {"weights": full_weights(acc, model)}


def case_collectives():
    acc = Accelerator(strategy=strategy())
    r, w = acc.process_index, acc.num_processes
    out = {"rank": r, "world": w}
    out["gather"] = acc.gather(torch.full((r + 1, 2), float(r))).tolist()  # first dims differ on purpose
    out["gather_scalar"] = acc.gather(torch.tensor(r)).tolist()
    nested = acc.gather({"a": torch.tensor([r]), "b": torch.tensor([10 * r])})
    out["gather_nested"] = {k: v.tolist() for k, v in nested.items()}
    out["gather_object"] = acc.gather_object([f"rank{r}"])
    out["reduce_sum"] = acc.reduce(torch.tensor([float(r + 1)]), reduction="sum").tolist()
    out["reduce_mean"] = acc.reduce(torch.tensor([float(r + 1)]), reduction="mean").tolist()
    out["pad"] = acc.pad_across_processes(torch.ones(r + 1, 3), dim=0, pad_index=-1).tolist()
    out["pad_first"] = acc.pad_across_processes(torch.ones(2, r + 1), dim=1, pad_first=True).tolist()
    out["broadcast"] = acc.broadcast(torch.tensor([float(r), 5.0]), from_process=w - 1).tolist()
    # 13 samples in batches of 2: 7 batches, so with 2 processes the last step is padded.
    loader = acc.prepare(DataLoader(IndexDataset(13), batch_size=2))
    tensors, objects = [], []
    for _, idx in loader:
        tensors += acc.gather_for_metrics(idx).tolist()
        objects += acc.gather_for_metrics([f"s{i}" for i in idx.tolist()])
    out["for_metrics"], out["for_metrics_objects"] = tensors, objects
    return out


def case_evaluation():
    """The trained model of case_parity over an uneven evaluation set: predictions gathered for metrics."""
    acc, model, _ = raw["A"]
    loader = acc.prepare(DataLoader(IndexDataset(13), batch_size=2))
    model.eval()
    outputs, indices = [], []
    with torch.no_grad():
        for x, idx in loader:
            out, idx = acc.gather_for_metrics((model(x), idx))
            outputs += out.float().tolist()
            indices += idx.tolist()
    model.train()
    return {"outputs": outputs, "indices": indices}


def case_roundtrip():
    """save_state from the run of case_parity, load_state into fresh objects prepared the same way."""
    acc, model, opt = raw["A"]
    path = os.path.join(args.root, "roundtrip")
    acc.save_state(path)
    before = {"weights": full_weights(acc, model), "optimizer": optimizer_state(opt)}
    acc2 = Accelerator(strategy=strategy())
    model2 = tensor_parallel(make_model(seed=5), acc2.torch_device_mesh)  # other initial weights: all from the checkpoint
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR / 7, momentum=MOMENTUM)
    model2, opt2, _ = acc2.prepare(model2, opt2, train_loader(PER_RANK))
    acc2.prepare(DataLoader(IndexDataset(13), batch_size=2))  # as case_evaluation did on the saving side
    acc2.load_state(path)
    after = {"weights": full_weights(acc2, model2), "optimizer": optimizer_state(opt2)}
    # One more step on the same batch in both: momentum buffers and learning rate show in the weights.
    g = torch.Generator().manual_seed(100 + RANK)
    x, y = torch.randn(PER_RANK, 4, generator=g), torch.randint(0, 3, (PER_RANK,), generator=g)
    for a, m, o in ((acc, model, opt), (acc2, model2, opt2)):
        with a.accumulate(m):
            a.backward(F.cross_entropy(m(x.to(a.device)), y.to(a.device)))
            o.step()
            o.zero_grad()
    return {"before": before, "after": after, "continued": full_weights(acc, model),
            "continued_loaded": full_weights(acc2, model2)}


# -- the trainer door --------------------------------------------------------------------------------------

class Classifier(TrainModule):
    def __init__(self, seed=0, reduction="mean"):
        super().__init__()
        self.net = make_model(seed=seed)
        self.reduction = reduction
        self.seen = []

    def configure_model(self):
        tensor_parallel(self.net, self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, idx = batch
        self.seen.append(idx.tolist())
        return F.cross_entropy(self.net(x), idx % 3, reduction=self.reduction)

    def configure_optimizers(self):
        return sgd(self)


class SaveAfterEpoch(Callback):
    def __init__(self, epoch, path):
        self.epoch, self.path = epoch, path

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


class StartStep(Callback):
    def __init__(self):
        self.start = None

    def on_train_start(self, trainer, module):
        self.start = [trainer.global_step, trainer.current_epoch]


def make_trainer(name, **kwargs):
    kwargs.setdefault("max_epochs", EPOCHS)
    return Trainer(strategy=strategy(), default_root_dir=os.path.join(args.root, name), enable_progress_bar=False,
                   enable_checkpointing=False, num_sanity_val_steps=0, log_every_n_steps=1000, **kwargs)


def trainer_run(name, per_rank_batch, seed=0, ckpt_path=None, callbacks=(), **kwargs):
    trainer = make_trainer(name, callbacks=list(callbacks), **kwargs)
    module = Classifier(seed=seed)
    trainer.fit(module, train_loader(per_rank_batch), ckpt_path=ckpt_path)
    return {"weights": full_weights(trainer.accelerator, trainer.model), "seen": module.seen,
            "global_step": trainer.global_step}


def case_trainer_parity():
    return trainer_run("t_parity", PER_RANK, callbacks=[SaveAfterEpoch(0, os.path.join(args.root, "t_saved"))])


def case_trainer_accumulation():
    return trainer_run("t_accum", PER_RANK // 2, accumulate_grad_batches=2)


def case_trainer_clipping():
    return trainer_run("t_clip", PER_RANK, gradient_clip_val=CLIP)


def case_trainer_resume():
    """fit(ckpt_path=...) from the checkpoint case_trainer_parity saved after its first epoch."""
    start = StartStep()
    out = trainer_run("t_resumed", PER_RANK, seed=5, ckpt_path=os.path.join(args.root, "t_saved"), callbacks=[start])
    out["start"] = start.start
    return out


# -- bad input ---------------------------------------------------------------------------------------------

def error_of(fn):
    try:
        fn()
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err)}
    return None


def case_bad_input():
    acc = Accelerator(strategy=strategy())
    model = tensor_parallel(make_model(seed=0), acc.torch_device_mesh)
    model, _ = acc.prepare(model, sgd(model))
    non_scalar = error_of(lambda: acc.backward(model(torch.randn(3, 4).to(acc.device))))  # a (3, 3) "loss"
    per_sample = Classifier(reduction="none")  # training_step returns a (batch,) loss
    trainer_non_scalar = error_of(lambda: make_trainer("t_bad").fit(per_sample, train_loader(PER_RANK)))
    accumulate_zero = error_of(lambda: Trainer(strategy=strategy(), accumulate_grad_batches=0))
    return {"backward_non_scalar": non_scalar, "trainer_non_scalar": trainer_non_scalar,
            "accumulate_zero": accumulate_zero}


# -- killed and resumed ------------------------------------------------------------------------------------

def dropout_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def resume_loader(seed):
    return DataLoader(regression_data(RESUME_SAMPLES), batch_size=PER_RANK, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def raw_build(seed):
    """Shuffled data, dropout, AdamW, a per-step StepLR and accumulation 2: everything that must continue exactly."""
    set_seed(seed)
    acc = Accelerator(strategy=strategy(), gradient_accumulation_steps=2)
    model = tensor_parallel(dropout_net(seed), acc.torch_device_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
    counter = StepCounter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, resume_loader(seed), sched)
    return acc, model, opt, loader, sched, counter


def raw_train(acc, model, opt, loader, sched, counter, save_to=None, abandon_after=None):
    for _ in range(loader.epoch, RESUME_EPOCHS):  # after load_state the loader is at its saved position
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                counter.steps += 1
                if save_to is not None and counter.steps == SAVE_STEP:
                    acc.save_state(save_to)
            elif abandon_after is not None and counter.steps == abandon_after:
                return {"abandoned_at_step": counter.steps, "epoch": loader.epoch}
    return {"finished": counter.steps}


class Regression(TrainModule):
    def __init__(self, seed):
        super().__init__()
        self.net = dropout_net(seed)

    def configure_model(self):
        tensor_parallel(self.net, self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillMidWindow(Callback):
    """SIGKILL this process after the first micro-batch of the window that follows optimizer step KILL_STEP."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == KILL_STEP and batch_idx % 2 == 0:
            # the checkpoint of SAVE_STEP may be written in the background: let it be published first, so that
            # the resume starts where this suite expects (kills during background saves: test_async.py)
            trainer.accelerator.wait_for_checkpoint()
            print(f"conformance: rank {RANK} SIGKILLs itself at step {trainer.global_step}, batch {batch_idx} of "
                  f"epoch {trainer.current_epoch}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def trainer_fit_resumable(root, seed, callbacks, ckpt_path=None):
    set_seed(seed)
    module = Regression(seed)
    trainer = Trainer(strategy=strategy(), max_epochs=RESUME_EPOCHS, accumulate_grad_batches=2,
                      default_root_dir=root,
                      callbacks=[ModelCheckpoint(every_n_train_steps=SAVE_STEP, save_top_k=1), *callbacks],
                      enable_progress_bar=False, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(module, resume_loader(seed), ckpt_path=ckpt_path)
    return trainer


def crash():
    """Never returns: both runs end without finishing, the process by SIGKILL."""
    run_case("raw_crash", lambda: raw_train(*raw_build(seed=1), save_to=os.path.join(args.root, "raw_ckpt"),
                                            abandon_after=KILL_STEP))
    trainer_fit_resumable(os.path.join(args.root, "trainer_run"), seed=1, callbacks=[KillMidWindow()])
    raise SystemExit(f"rank {RANK}: the Trainer run was not killed")


def case_raw_resumed():
    acc, *objs = raw_build(seed=99)  # other weights, RNG and data seed: everything must come from the checkpoint
    acc.load_state(os.path.join(args.root, "raw_ckpt"))
    model, _, loader, _, counter = objs
    restored = {"steps": counter.steps, "epoch": loader.epoch}
    finished = raw_train(acc, *objs)
    resumed = full_weights(acc, model)
    acc, *objs = raw_build(seed=1)
    raw_train(acc, *objs)
    return {"restored": restored, "finished": finished, "resumed": resumed, "uninterrupted": full_weights(acc, objs[0])}


def case_trainer_resumed():
    start = StartStep()
    trainer = trainer_fit_resumable(os.path.join(args.root, "trainer_run"), seed=99, callbacks=[start],
                                    ckpt_path="last")
    resumed = full_weights(trainer.accelerator, trainer.model)
    straight = trainer_fit_resumable(os.path.join(args.root, "trainer_uninterrupted"), seed=1, callbacks=[])
    return {"start": start.start, "global_step": trainer.global_step, "resumed": resumed,
            "uninterrupted": full_weights(straight.accelerator, straight.model),
            "uninterrupted_global_step": straight.global_step}


if args.phase == "first":
    for name, fn in [("parity", case_parity), ("accumulation", case_accumulation), ("clipping", case_clipping),
                     ("collectives", case_collectives), ("evaluation", case_evaluation),
                     ("roundtrip", case_roundtrip), ("trainer_parity", case_trainer_parity),
                     ("trainer_accumulation", case_trainer_accumulation), ("trainer_clipping", case_trainer_clipping),
                     ("trainer_resume", case_trainer_resume), ("bad_input", case_bad_input)]:
        if name in ("evaluation", "roundtrip") and "A" not in raw:
            results["cases"][name] = {"error": "case parity failed: nothing to evaluate or save"}
            continue
        run_case(name, fn)
    crash()
else:
    run_case("raw_resumed", case_raw_resumed)
    run_case("trainer_resumed", case_trainer_resumed)
