"""What the Accelerate-example-shaped workers share: a small sentence-pair classification set of our own
(variable-length token ids, a label and the sample's index), a collate function returning a batch mapping
with `.to(device)` (the shape of a tokenizer's padded batch), a tiny classifier whose output has `.loss` and
`.logits`, a tiny causal language model, a linear-warmup schedule, a metric that counts what it was given,
the JSON result file, and `end_training`, which puts a script's accelerator.end_training() off to the end of
the process."""

import json
import math
import random
from collections import UserDict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 32
PAD = 0
TRAIN_SIZE = 64          # 4 batches of 16 alone, 2 per process on 2 processes
VALIDATION_SIZE = 41     # uneven over 2 processes and over evaluation batches of 32
EVAL_BATCH_SIZE = 32


class PairDataset(Dataset):
    """Rows {input_ids, labels, idx}: 3-12 token ids in [1, VOCAB), the label a function of the ids."""

    def __init__(self, n, seed):
        rng = random.Random(seed)
        self.rows = []
        for i in range(n):
            ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 12))]
            self.rows.append({"input_ids": ids, "labels": int(sum(ids) % 3 == 0), "idx": i})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(self.rows[i])


class Batch(UserDict):
    """A padded batch: a mapping whose `.to(device)` moves its tensors and returns itself."""

    def to(self, device):
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def collate_fn(examples, pad_to_multiple_of=None):
    length = max(len(e["input_ids"]) for e in examples)
    if pad_to_multiple_of:
        length = int(math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of)
    ids = torch.full((len(examples), length), PAD, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
    return Batch({"input_ids": ids, "attention_mask": (ids != PAD).long(),
                  "labels": torch.tensor([e["labels"] for e in examples]),
                  "idx": torch.tensor([e["idx"] for e in examples])})


class Output(dict):
    def __getattr__(self, item):
        try:
            return self[item]
        except KeyError:
            raise AttributeError(item) from None


class PairClassifier(nn.Module):
    """Mean of token embeddings (masked), a hidden layer, two logits; `loss` when labels are given."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.hidden = nn.Linear(8, 8)
        self.classifier = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask, labels=None, idx=None):
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.classifier(torch.tanh(self.hidden(pooled)))
        loss = nn.functional.cross_entropy(logits.float(), labels) if labels is not None else None
        return Output(loss=loss, logits=logits)


class TinyCausalLM(nn.Module):
    """Next-token logits from the token's embedding; with `num_items_in_batch` the summed token loss is
    divided by it (the caller's count of label tokens over the whole accumulated, all-process batch)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels=None, num_items_in_batch=None, idx=None, attention_mask=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        total = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                            reduction="sum")
        count = num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum()
        return Output(loss=total / count, logits=logits)


def lm_collate_fn(examples):
    """input_ids / labels shifted by one, padding labelled -100 (the autoregressive example's collate)."""
    length = max(len(e["input_ids"]) for e in examples) + 1
    ids = torch.full((len(examples), length), PAD, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
    labels = ids[:, 1:]
    return Batch({"input_ids": ids[:, :-1], "labels": torch.where(labels == PAD, -100, labels),
                  "idx": torch.tensor([e["idx"] for e in examples])})


def linear_warmup(optimizer, num_warmup_steps, num_training_steps):
    def factor(step):
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class CountingMetric:
    """add_batch / compute like an evaluation metric; compute also returns which sample indices it saw."""

    def __init__(self):
        self.preds, self.refs, self.idx = [], [], []

    def add_batch(self, predictions, references, idx=None):
        self.preds.append(predictions.reshape(-1).cpu())
        self.refs.append(references.reshape(-1).cpu())
        if idx is not None:
            self.idx.append(idx.reshape(-1).cpu())

    def compute(self):
        p, r = torch.cat(self.preds), torch.cat(self.refs)
        seen = sorted(torch.cat(self.idx).tolist()) if self.idx else []
        self.preds, self.refs, self.idx = [], [], []
        return {"accuracy": float((p == r).float().mean()), "samples": int(len(p)), "seen": seen}


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def write_result(out, rank, result):
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


OPEN_ACCELERATORS = []


def end_training(accelerator):
    """A script's `accelerator.end_training()` where several scripts run one after the other in one process:
    kept for the end of the process (`end_all`). Ending it at once would shut the process group down, and the
    next script's Accelerator would start one again over the launcher's store, which still holds the first
    group's keys under the same group name (torch restarts its group count): that hangs now and then."""
    OPEN_ACCELERATORS.append(accelerator)


def end_all():
    """end_training for every script's Accelerator, the latest first: the first one, which started the
    process group, shuts it down last."""
    while OPEN_ACCELERATORS:
        OPEN_ACCELERATORS.pop().end_training()
