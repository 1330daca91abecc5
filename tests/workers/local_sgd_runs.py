"""LocalSGD on 1 or 2 processes (run by ddp_features.py).

1. Training with `fabric_lite.local_sgd.LocalSGD` (with and without gradient accumulation) next to a plain-torch
   loop written by hand: each process steps on its own batches with no gradient all-reduce, and every K steps the
   parameters are averaged with torch.distributed (and once more at the end of each epoch's block). The weights
   after every step are reported for both.
2. A training function shaped like Accelerate's `examples/by_feature/local_sgd.py`: the same calls in the same order
   (Accelerator with gradient_accumulation_steps, the distributed_type check, prepare of five objects, a LocalSGD
   block per epoch around accumulate, local_sgd.step() after each optimizer step, gather_for_metrics).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from accelerate_example_parts import Classifier, get_dataloaders, warmup_then_linear_decay
from fabric_lite import Accelerator, DistributedType, set_seed
from fabric_lite.local_sgd import LocalSGD

N, BATCH, EPOCHS = 64, 4, 2
RUNS = {"k3": {"local_sgd_steps": 3, "accumulation": 1}, "k4_accum2": {"local_sgd_steps": 4, "accumulation": 2}}


def regression():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(4, 3, generator=g)))


def make_model():
    torch.manual_seed(13)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).tolist()


def with_accelerator(local_sgd_steps, accumulation):
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(regression(), batch_size=BATCH))
    after_each_step = []
    for _ in range(EPOCHS):
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps) as local_sgd:
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(F.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()
                after_each_step.append(flat(model.module if hasattr(model, "module") else model))
    final = flat(accelerator.unwrap_model(model))
    # Out of the block DDP all-reduces gradients again: one window on different data per process, equal gradients.
    x = torch.full((2, 4), float(accelerator.process_index + 1))
    for _ in range(accumulation):
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            grads = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]).tolist()
            optimizer.step()
            optimizer.zero_grad()
    return {"steps": after_each_step, "final": final, "grads_after_block": grads}, accelerator


def by_hand(local_sgd_steps, accumulation, world, rank):
    """Plain torch: this process's batches (every world-th of the plain loader's, as prepared loaders shard), no
    gradient all-reduce, parameters averaged with torch.distributed every K micro-steps and at each epoch's end."""
    model, data = make_model(), regression()
    optimizer = make_optimizer(model)
    mine = [b for i, b in enumerate(DataLoader(data, batch_size=BATCH)) if i % world == rank]

    def average():
        if world > 1:
            with torch.no_grad():
                for p in model.parameters():
                    dist.all_reduce(p)
                    p /= world

    after_each_step = []
    for _ in range(EPOCHS):
        for j, (x, y) in enumerate(mine):
            (F.mse_loss(model(x), y) / accumulation).backward()
            if (j + 1) % accumulation == 0 or j + 1 == len(mine):
                optimizer.step()
                optimizer.zero_grad()
            if (j + 1) % local_sgd_steps == 0:
                average()
            after_each_step.append(flat(model))
        average()
    return {"steps": after_each_step, "final": flat(model)}


def model_lookup(accelerator):
    """Which model LocalSGD turns DDP's all-reduce off on: the prepared one, also when given the model it wraps;
    a model this accelerator never prepared is refused (where LocalSGD is on)."""
    prepared = accelerator.models[0]
    found = LocalSGD(accelerator, accelerator.unwrap_model(prepared), 2).model is prepared
    try:
        LocalSGD(accelerator, torch.nn.Linear(2, 2), 2)
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"unwrapped_finds_prepared": found, "unprepared_refused": refused}


def training_function(config, args):
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    local_sgd_steps = args.local_sgd_steps
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=gradient_accumulation_steps)
    if accelerator.distributed_type not in [DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU]:
        raise NotImplementedError("this example trains on CPUs or GPUs with plain data parallel only")
    lr, num_epochs, seed, batch_size = config["lr"], int(config["num_epochs"]), int(config["seed"]), int(config["batch_size"])
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = Classifier()
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = warmup_then_linear_decay(optimizer, 4, len(train_dataloader) * num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accuracies, counted = [], []
    for epoch in range(num_epochs):
        model.train()
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps,
                      enabled=local_sgd_steps is not None) as local_sgd:
            for step, batch in enumerate(train_dataloader):
                batch.to(accelerator.device)
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    local_sgd.step()
        counted.append(local_sgd.num_steps)
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
    return {"accuracies": accuracies, "evaluated": seen, "local_steps_counted": counted, "enabled": local_sgd.enabled,
            "weights": flat(accelerator.unwrap_model(model)), "distributed_type": str(accelerator.distributed_type)}


def run(args):
    """Both LocalSGD runs next to their plain loops, and the example-shaped run; returns the result."""
    runs = {}
    for name, setting in RUNS.items():
        runs[name], accelerator = with_accelerator(setting["local_sgd_steps"], setting["accumulation"])
        runs[name]["by_hand"] = by_hand(setting["local_sgd_steps"], setting["accumulation"], accelerator.num_processes,
                                        accelerator.process_index)
    return {"runs": runs, "world": accelerator.num_processes, "model_lookup": model_lookup(accelerator),
            "example": training_function({"lr": 3e-3, "num_epochs": 3, "seed": 42, "batch_size": 8}, args)}
