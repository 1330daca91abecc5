"""Accelerate's migration-guide loop on scikit-learn's handwritten digits, with TensorBoard logs.

    python examples/migration_digits.py                                  # one process
    fabric-lite launch --nproc-per-node 2 examples/migration_digits.py   # DDP on 2 processes
    torchrun --nproc-per-node 2 examples/migration_digits.py             # the same, with plain torchrun
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, set_seed


def build_data(batch_size: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    train, valid = order[:1500], order[1500:]
    train_loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True)
    valid_loader = DataLoader(TensorDataset(x[valid], y[valid]), batch_size=64)
    return train_loader, valid_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--project-dir", default="runs/digits")
    args = parser.parse_args()

    set_seed(0)
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.project_dir)
    accelerator.init_trackers("migration_digits", config=vars(args))

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    training_dataloader, valid_dataloader = build_data(args.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(training_dataloader))
    loss_function = torch.nn.CrossEntropyLoss()

    # --- the migration guide's loop, unchanged but for the import line ---
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    valid_dataloader = accelerator.prepare(valid_dataloader)
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in training_dataloader:
            optimizer.zero_grad()
            inputs, targets = batch
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 10 == 0:
                accelerator.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0]}, step=step)

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for inputs, targets in valid_dataloader:
                predictions = model(inputs).argmax(dim=-1)
                predictions, targets = accelerator.gather_for_metrics((predictions, targets))
                correct += (predictions == targets).sum().item()
                total += targets.numel()
        accuracy = correct / total
        accelerator.log({"valid/accuracy": accuracy}, step=step)
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}  valid accuracy {accuracy:.3f} ({total} samples)")

    accelerator.end_training()


if __name__ == "__main__":
    main()
