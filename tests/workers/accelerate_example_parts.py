"""Pieces shaped like what Accelerate's by_feature examples build with transformers and datasets (a tokenizer's
padded batches, a sequence classifier answering `.loss` and `.logits`, the GLUE loaders), small and offline."""

from collections import UserDict
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from fabric_lite import DistributedType


class Encoded(UserDict):
    """What a tokenizer's padding returns: a dict of tensors with `.to(device)`."""

    def to(self, device):
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


class Pairs(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, :3].sum(1) > self.x[:, 3:].sum(1)).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


class Classifier(torch.nn.Module):
    """Answers like a Hugging Face sequence classifier: `model(**batch).loss` and `.logits`."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def forward(self, input_ids, labels=None):
        logits = self.body(input_ids)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


def get_dataloaders(accelerator, batch_size):
    with accelerator.main_process_first():
        train_set, eval_set = Pairs(96, 1), Pairs(40, 2)  # (a tokenizer's map would run here)

    def collate_fn(examples):
        pad_to = 128 if accelerator.distributed_type == DistributedType.XLA else None
        multiple = 16 if accelerator.mixed_precision == "fp8" else (8 if accelerator.mixed_precision != "no" else None)
        assert pad_to is None and multiple in (None, 8)
        return Encoded({k: torch.stack([e[k] for e in examples]) for k in examples[0]})

    return (DataLoader(train_set, shuffle=True, collate_fn=collate_fn, batch_size=batch_size),
            DataLoader(eval_set, shuffle=False, collate_fn=collate_fn, batch_size=16))


def warmup_then_linear_decay(optimizer, warmup, total):
    """What transformers' get_linear_schedule_with_warmup does, with torch's LambdaLR."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / total))
