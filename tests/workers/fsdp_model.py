"""The model of the FSDP tests (tests/strategies/test_fsdp.py, tests/workers/fsdp_cases.py): two blocks that
each get their own fully_shard, between an input and an output layer."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def make(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), Block(width), Block(width), nn.Linear(width, 3))
