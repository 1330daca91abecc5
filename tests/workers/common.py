"""Shared bits of the worker scripts that the multi-process tests start."""

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset


def parse(extra=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    for name, kwargs in (extra or {}).items():
        parser.add_argument(name, **kwargs)
    return parser.parse_args()


def write_result(out, rank, result):
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


class IndexDataset(Dataset):
    """Sample i is (features derived from i, i), so gathered labels tell which samples were seen."""

    def __init__(self, n, dim=4):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i], torch.tensor(i)


def make_model(seed=0, dim=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def regression_data(n, seed=0):
    """y = x·w + noise for 4 features: the resume workers' data (the same samples in every worker)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class StepCounter:
    """A registered checkpoint object: optimizer steps taken, saved and restored with the run."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]
