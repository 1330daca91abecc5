"""DDP communication hooks asked for with DistributedDataParallelKwargs, on 1 or 2 processes (run by ddp_features.py).

1. Every hook trains the same small regression; each run is compared (by the test) with a plain-torch loop that
   takes every step on the global batch at once, which is what DDP's averaged gradients equal.
2. A training function shaped like Accelerate's `examples/by_feature/ddp_comm_hook.py`: the same API calls in the
   same order (hook types from the command line, the kwargs handler, Accelerator(cpu=..., mixed_precision=...,
   kwargs_handlers=...), prepare of five objects, accumulate, gather_for_metrics).
"""

import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accelerate_example_parts import Classifier, get_dataloaders, warmup_then_linear_decay
from fabric_lite import Accelerator, set_seed
from fabric_lite.accelerator.configs import DDPCommunicationHookType, DistributedDataParallelKwargs

H = DDPCommunicationHookType
POWER = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}
# name -> DistributedDataParallelKwargs fields (members and plain strings both)
VARIANTS = {
    "no": {},
    "fp16": {"comm_hook": H.FP16},
    "bf16": {"comm_hook": "bf16"},
    "power_sgd": {"comm_hook": H.POWER_SGD, "comm_state_option": POWER},
    "power_sgd+fp16": {"comm_hook": "power_sgd", "comm_wrapper": H.FP16, "comm_state_option": POWER},
    "power_sgd+bf16": {"comm_hook": "power_sgd", "comm_wrapper": "bf16", "comm_state_option": POWER},
}
N, BATCH, EPOCHS, LR = 64, 4, 2, 0.05


def regression():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g)
    w = torch.randn(4, 3, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(N, 3, generator=g))


def make_model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).tolist()


def plain_reference(world):
    """Plain torch, one process: every step on the W consecutive per-process batches at once."""
    model, data = make_model(), regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(EPOCHS):
        for x, y in DataLoader(data, batch_size=BATCH * world):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return flat(model)


def train(fields):
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**fields)])
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(regression(), batch_size=BATCH))
    losses = []
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    state_of = getattr(accelerator.strategy, "comm_hook_state", None)  # (DDPStrategy's; none on one process)
    state = state_of(model) if state_of is not None else None
    hook = {"type": type(state).__name__ if state is not None else None}
    if state is not None:
        hook.update(iter=state.iter, numel_compressed=int(state.compression_stats()[1]),
                    error_feedback=len(state.error_dict), rank=state.matrix_approximation_rank)
    return {"weights": flat(accelerator.unwrap_model(model)), "losses": losses, "state": hook,
            "model_type": type(model).__name__, "strategy": type(accelerator.strategy).__name__,
            "handler_hook": str(accelerator.ddp_handler.comm_hook) if hasattr(accelerator, "ddp_handler") else None}, \
        accelerator


# -- shaped like Accelerate's by_feature/ddp_comm_hook.py --------------------------------------------------------

def training_function(config, args):
    hook_type = DDPCommunicationHookType(args.ddp_comm_hook)
    wrapper_type = DDPCommunicationHookType(args.ddp_comm_wrapper)
    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=hook_type, comm_wrapper=wrapper_type)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision, kwargs_handlers=[ddp_kwargs])
    lr, num_epochs, seed, batch_size = config["lr"], int(config["num_epochs"]), int(config["seed"]), int(config["batch_size"])
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = Classifier()
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = warmup_then_linear_decay(optimizer, 4, len(train_dataloader) * num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accuracies = []
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            with accelerator.accumulate(model):
                output = model(**batch)
                loss = output.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            seen += references.numel()
        accuracies.append(correct / seen)
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / seen})
    return {"accuracies": accuracies, "evaluated": seen, "weights": flat(accelerator.unwrap_model(model)),
            "hook": str(ddp_kwargs.comm_hook), "wrapper": str(ddp_kwargs.comm_wrapper),
            "distributed_type": str(accelerator.distributed_type), "mixed_precision": accelerator.mixed_precision}


def run(args):
    """Every variant, the plain reference and the example-shaped run; returns (result, accelerator)."""
    runs, accelerator = {}, None
    for name, fields in VARIANTS.items():
        runs[name], accelerator = train(fields)
    assert not any(math.isnan(v) for r in runs.values() for v in r["weights"])
    return {"runs": runs, "reference": plain_reference(accelerator.num_processes), "world": accelerator.num_processes,
            "example": training_function({"lr": 3e-3, "num_epochs": 3, "seed": 42, "batch_size": 8}, args)}, accelerator
