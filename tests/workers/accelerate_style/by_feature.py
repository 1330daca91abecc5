"""Accelerate's by_feature examples that make an Accelerator of their own, one function a script, each
ending with end_training as a script does (shared.end_training: at the end of the process): memory / automatic_gradient_accumulation
(utils.find_executable_batch_size, with a simulated out-of-memory error above batch size 8), profiler
(ProfileKwargs(record_shapes, profile_memory, with_flops, output_trace_dir), `with accelerator.profile() as
prof` around each epoch's training, prof.key_averages().table(...)), ddp_comm_hook (DDPCommunicationHookType,
DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)), local_sgd (fabric_lite.local_sgd.LocalSGD),
schedule_free (utils.is_schedulefree_available and a prepared optimizer's train()/eval())."""

import collections
import importlib.util
import json
import os

import torch

from fabric_lite import Accelerator, DistributedType
from fabric_lite.utils import set_seed

from core import CONFIG, build, evaluate, get_dataloaders
from shared import PairClassifier, end_training, flat_params


def train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler, epochs=1, each_step=None):
    for _ in range(epochs):
        model.train()
        for batch in train_dataloader:
            batch.to(accelerator.device)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                if each_step is not None:
                    each_step()


def memory(args, automatic=False):
    from fabric_lite.utils import find_executable_batch_size

    accelerator = Accelerator(cpu=args.cpu)
    tried = []
    observed_batch_size = 16

    @find_executable_batch_size(starting_batch_size=observed_batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator
        tried.append(batch_size)
        if automatic:
            accelerator.gradient_accumulation_steps = observed_batch_size // batch_size
        accelerator.free_memory()
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(
            accelerator, batch_size, 1, accelerator.gradient_accumulation_steps)
        if batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler)
        return flat_params(model), evaluate(accelerator, model, eval_dataloader)

    weights, metric = inner_training_loop()
    result = {"tried": tried, "seen": metric["seen"], "steps": accelerator.gradient_accumulation_steps}
    if automatic:  # the accumulated batch of 8 x 2 equals the batch of 16 it stands for
        accelerator.gradient_accumulation_steps = 1
        accelerator.free_memory()
        model, optimizer, train_dataloader, _, lr_scheduler = build(accelerator, 16, 1)
        train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler)
        result["diff_to_batch_16"] = float((flat_params(model) - weights).abs().max())
    end_training(accelerator)
    return result


def automatic_gradient_accumulation(args):
    return memory(args, automatic=True)


def trace_summary(path):
    """What one process's Chrome trace holds: how many optimizer steps and all-reduces it recorded, and
    whether the matrix products carry their input shapes (record_shapes)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = collections.Counter(e.get("name") for e in events)
    addmm = [e for e in events if e.get("name") == "aten::addmm"]
    return {"optimizer_steps": names["Optimizer.step#AdamW.step"],
            "all_reduces": sum(n for name, n in names.items() if "all_reduce" in str(name)),
            "addmm_shapes": bool(addmm) and all(e.get("args", {}).get("Input Dims") for e in addmm)}


def profiler(args, num_epochs=2):
    """by_feature/profiler.py: the profile block around each epoch's training; its table printed once."""
    from fabric_lite.utils import ProfileKwargs

    trace_dir = os.path.join(args.out, "trace")
    profile_kwargs = ProfileKwargs(record_shapes=True, profile_memory=True, with_flops=True,
                                   output_trace_dir=trace_dir)
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=[profile_kwargs])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, 16, num_epochs)
    epochs = []
    for epoch in range(num_epochs):
        model.train()
        with accelerator.profile() as prof:
            for step, batch in enumerate(train_dataloader):
                batch.to(accelerator.device)
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cpu_time_total" if args.cpu else "self_cuda_time_total",
                               row_limit=-1)
        accelerator.print(table)
        by_name = {e.key: e for e in averages}
        epochs.append({
            "table_columns": [c for c in ("CPU Mem", "FLOPs", "# of Calls") if c in table],
            "table_has_addmm": "aten::addmm" in table,
            "averaged_steps": by_name["Optimizer.step#AdamW.step"].count if "Optimizer.step#AdamW.step" in by_name
            else 0,
            "addmm_flops": by_name["aten::addmm"].flops if "aten::addmm" in by_name else 0,
            "memory_recorded": any(e.cpu_memory_usage != 0 for e in averages),
            # every process has written its trace when the block ends (it waits for the others)
            "trace_files": sorted(os.listdir(trace_dir)),
            "trace": trace_summary(os.path.join(trace_dir, f"profile_{accelerator.process_index}.json")),
            "seen": evaluate(accelerator, model, eval_dataloader)["seen"],
        })
    result = {"epochs": epochs, "steps_per_epoch": len(train_dataloader)}
    end_training(accelerator)
    return result


def ddp_comm_hook(args):
    from fabric_lite.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType("fp16"),
                                               comm_wrapper=DDPCommunicationHookType("no"))
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=[ddp_kwargs])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, 16, 2)
    train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler, epochs=2)
    weights = flat_params(model)
    set_seed(CONFIG["seed"])
    initial = flat_params(PairClassifier())
    result = {"weights": weights.tolist(), "moved": float((weights - initial).abs().max()),
              "seen": evaluate(accelerator, model, eval_dataloader)["seen"]}
    end_training(accelerator)
    return result


def local_sgd(args):
    from fabric_lite.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=1)
    assert accelerator.distributed_type in [DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU]
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, 8, 1)
    differed = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=True) as sgd:
        def each_step():
            sgd.step()
            # between averagings the processes train on their own: their weights part
            gathered = accelerator.gather(flat_params(model).float().unsqueeze(0))
            differed.append(float((gathered - gathered[0]).abs().max()))
        train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler, each_step=each_step)
    gathered = accelerator.gather(flat_params(model).float().unsqueeze(0))
    result = {"differed": differed, "final_spread": float((gathered - gathered[0]).abs().max()),
              "seen": evaluate(accelerator, model, eval_dataloader)["seen"]}
    end_training(accelerator)
    return result


class ModalSGD(torch.optim.SGD):
    """An optimizer with train()/eval() modes, as schedule-free optimizers have; step() refuses eval mode."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.mode = "train"

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"

    def step(self, closure=None):
        if self.mode != "train":
            raise RuntimeError("step() in eval mode")
        return super().step(closure)


def schedule_free(args):
    from fabric_lite.utils import is_schedulefree_available

    available = is_schedulefree_available()
    accelerator = Accelerator(cpu=args.cpu)
    set_seed(CONFIG["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, 16)
    model = PairClassifier().to(accelerator.device)
    optimizer = ModalSGD(model.parameters(), lr=0.1)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    modes = []
    for _ in range(2):
        model.train()
        optimizer.train()
        modes.append(optimizer.optimizer.mode if hasattr(optimizer, "optimizer") else optimizer.mode)
        for batch in train_dataloader:
            batch.to(accelerator.device)
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        optimizer.eval()
        modes.append(optimizer.optimizer.mode if hasattr(optimizer, "optimizer") else optimizer.mode)
        seen = evaluate(accelerator, model, eval_dataloader)["seen"]
    result = {"available": available, "expected": importlib.util.find_spec("schedulefree") is not None,
              "modes": modes, "seen": seen}
    end_training(accelerator)
    return result


FEATURES = {f.__name__: f for f in (memory, automatic_gradient_accumulation, profiler, ddp_comm_hook, local_sgd,
                                    schedule_free)}
