"""A Transformers-style model and dict batches with the raw door: `outputs = model(**batch)`, `outputs.loss`.

    python examples/dict_batches.py                                  # one process
    fabric-lite launch --nproc-per-node 2 examples/dict_batches.py   # DDP on 2 processes

The task is made up so that it needs no download: sequences of token ids of varying length, labelled 1 when
they contain the "needle" token. Each sample is a dict, as a tokenized Hugging Face dataset gives them; the
collate function pads a batch to its longest sequence and builds the attention mask.
"""

import argparse
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric_lite import Accelerator, set_seed

PAD, NEEDLE, VOCAB = 0, 1, 32


@dataclass
class ClassifierOutput:
    """What a Hugging Face model returns: the loss when labels were given, and the logits."""

    loss: Optional[torch.Tensor]
    logits: torch.Tensor


class TinySequenceClassifier(nn.Module):
    """Embeddings, one self-attention layer, a masked mean over the real tokens, and a linear head."""

    def __init__(self, vocab_size: int = VOCAB, dim: int = 32, num_labels: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=PAD)
        self.layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None) -> ClassifierOutput:
        hidden = self.layer(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)       # padding does not count in the mean
        logits = self.head(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(loss=loss, logits=logits)


class NeedleDataset(Dataset):
    """`n` samples like {"input_ids": [5, 17, 1, 9], "label": 1}: label 1 when the NEEDLE token occurs."""

    def __init__(self, n: int, seed: int):
        rng = random.Random(seed)
        self.samples = []
        for i in range(n):
            ids = [rng.randrange(NEEDLE + 1, VOCAB) for _ in range(rng.randint(4, 16))]
            label = i % 2                                      # balanced classes
            if label:
                ids[rng.randrange(len(ids))] = NEEDLE
            self.samples.append({"input_ids": ids, "label": label})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Dict:
        return self.samples[index]


def collate(samples: List[Dict]) -> Dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch; the keys are the model's argument names."""
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = torch.tensor(sample["input_ids"])
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    labels = torch.tensor([s["label"] for s in samples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    set_seed(0)
    accelerator = Accelerator()
    model = TinySequenceClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(NeedleDataset(1024, seed=0), batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    eval_loader = DataLoader(NeedleDataset(250, seed=1), batch_size=64, collate_fn=collate)

    # The prepared loaders move every tensor of each dict to the device (and shard the batches under DDP).
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            outputs = model(**batch)                # the dict's keys are the forward's arguments
            accelerator.backward(outputs.loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: last batch loss {outputs.loss.item():.4f}")

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in eval_loader:
            predictions = model(**batch).logits.argmax(dim=-1)
            # Every process's predictions, without the samples repeated to give each process a full last batch:
            # the accuracy is over the 250 evaluation samples exactly, on any number of processes.
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == labels).sum().item()
            total += labels.numel()
    accelerator.print(f"eval accuracy {correct / total:.3f} over {total} samples")
    accelerator.end_training()


if __name__ == "__main__":
    main()
