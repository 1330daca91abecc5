"""A training script written for Hugging Face Accelerate, with `accelerate` replaced by `fabric_lite` in its
imports and nothing else changed (the shape of Accelerate's own examples: argparse, set_seed, a logger,
trackers, prepare, accumulate, gather_for_metrics, save_state, end_training)."""

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, DistributedType
from fabric_lite.logging import get_logger
from fabric_lite.utils import LoggerType, ProjectConfiguration, gather_object, set_seed

logger = get_logger(__name__)


def get_dataloaders(accelerator, batch_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x.sum(dim=1) > 0).long()
    train = TensorDataset(x[:64], y[:64])
    evaluation = TensorDataset(x[64:], y[64:])
    with accelerator.main_process_first():
        pass  # (tokenization would happen here)
    return (DataLoader(train, shuffle=True, batch_size=batch_size),
            DataLoader(evaluation, shuffle=False, batch_size=batch_size))


def training_function(args):
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=2,
        log_with=LoggerType.TENSORBOARD,
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True),
    )
    set_seed(42)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, args.batch_size)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accelerator.init_trackers("accelerate_style", config=vars(args))
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        logger.info("training on %d CPU processes", accelerator.num_processes, main_process_only=True)
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                inputs, targets = batch
                loss = nn.functional.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct, total = 0, 0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, targets))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} over {total} samples")
        accelerator.log({"accuracy": correct / total, "train_loss": loss.item()}, step=epoch)
        accelerator.save_state()
    ranks = gather_object([accelerator.process_index])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        accelerator.save_model(unwrapped, os.path.join(args.project_dir, "final"))
        with open(os.path.join(args.project_dir, "result.json"), "w") as f:
            json.dump({"ranks": ranks, "total": total, "world": accelerator.num_processes,
                       "type": str(accelerator.distributed_type), "args": vars(args)}, f)
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="A simple example of a training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--project_dir", type=str, required=True)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    training_function(args)


if __name__ == "__main__":
    main()
