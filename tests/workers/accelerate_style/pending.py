"""Accelerate's by_feature examples whose fabric_lite features are being built, one `--feature` a run:
memory / automatic_gradient_accumulation (utils.find_executable_batch_size, with a simulated out-of-memory
error above batch size 8), profiler (ProfileKwargs, accelerator.profile), ddp_comm_hook
(DDPCommunicationHookType, DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)), local_sgd
(fabric_lite.local_sgd.LocalSGD), schedule_free (utils.is_schedulefree_available and a prepared optimizer's
train()/eval()). Each process writes rank<r>.json."""

import argparse
import importlib.util
import os

import torch

from fabric_lite import Accelerator, DistributedType
from fabric_lite.utils import set_seed

from core import CONFIG, build, evaluate, get_dataloaders
from shared import PairClassifier, flat_params, linear_warmup, write_result


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


def memory(accelerator, automatic):
    from fabric_lite.utils import find_executable_batch_size

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
    return result


def profiler(args):
    from fabric_lite.utils import ProfileKwargs

    trace_dir = os.path.join(args.out, "trace")
    handler = ProfileKwargs(record_shapes=True, profile_memory=False, with_flops=False, json_trace_path=trace_dir)
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=[handler])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, 16, 1)
    with accelerator.profile() as prof:
        train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=-1)
    accelerator.print(table)
    accelerator.wait_for_everyone()
    return accelerator, {"has_linear": "aten::linear" in table or "aten::addmm" in table,
                         "trace_files": sorted(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else [],
                         "seen": evaluate(accelerator, model, eval_dataloader)["seen"]}


def ddp_comm_hook(args):
    from fabric_lite.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType("fp16"),
                                               comm_wrapper=DDPCommunicationHookType("no"))
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=[ddp_kwargs])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = build(accelerator, 16, 2)
    train_epochs(accelerator, model, optimizer, train_dataloader, lr_scheduler, epochs=2)
    weights = flat_params(model)
    return accelerator, {"weights": weights.tolist(), "seen": evaluate(accelerator, model, eval_dataloader)["seen"]}


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
    return accelerator, {"differed": differed, "final_spread": float((gathered - gathered[0]).abs().max()),
                         "seen": evaluate(accelerator, model, eval_dataloader)["seen"]}


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
    return accelerator, {"available": available, "expected": importlib.util.find_spec("schedulefree") is not None,
                         "modes": modes, "seen": seen}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--feature", required=True,
                        choices=["memory", "automatic_gradient_accumulation", "profiler", "ddp_comm_hook",
                                 "local_sgd", "schedule_free"])
    args = parser.parse_args()
    if args.feature in ("memory", "automatic_gradient_accumulation"):
        accelerator = Accelerator(cpu=args.cpu)
        result = memory(accelerator, automatic=args.feature == "automatic_gradient_accumulation")
    else:
        accelerator, result = globals()[args.feature](args)
    result.update(rank=accelerator.process_index, world=accelerator.num_processes)
    write_result(args.out, accelerator.process_index, result)
    accelerator.end_training()


if __name__ == "__main__":
    main()
