"""In-process training runs for resume-exactness tests: a tiny regression (Linear) trained with gradient
accumulation over a prepared loader, saved at chosen points, and resumed in a fresh Accelerator with
identically built objects. Used by tests/data/test_resume_exact.py and tests/data/test_resume_matrix.py."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from fabric_lite import Accelerator, set_seed

N, DIMS, BATCH = 24, 3, 4  # 6 batches an epoch


def _table():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(N, DIMS, generator=g), torch.randn(N, 1, generator=g)


class Plain(Dataset):
    """Map-style, no randomness."""

    def __init__(self):
        self.x, self.y = _table()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Augmented(Plain):
    """Map-style with a random augmentation drawn from torch's RNG (the worker's, with num_workers > 0)."""

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(DIMS), self.y[i]


class Stream(IterableDataset):
    """An IterableDataset that draws from the global RNG; with workers each reads every W-th item."""

    def __init__(self):
        self.x, self.y = _table()

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, N, step):
            yield self.x[i] + 0.1 * torch.rand(DIMS), self.y[i]


class GlobalShuffle(Sampler):
    """A custom sampler shuffling with the global torch RNG (no `generator` attribute)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        yield from torch.randperm(self.n).tolist()


class Counter:
    def __init__(self):
        self.micro = 0

    def state_dict(self):
        return {"micro": self.micro}

    def load_state_dict(self, state):
        self.micro = state["micro"]


def run(make_loader: Callable[[], torch.utils.data.DataLoader], *, saves: Iterable[Tuple[str, int]] = (),
        directory=None, resume=None, epochs: int = 2, accum: int = 2, seed: int = 0) -> Dict[str, object]:
    """Train `epochs` epochs; returns {"weights": the final weights, "warnings": messages seen, "saved": {point: path}}.

    `saves`: ("micro", m) saves right after micro-step m (inside the loop; odd m is inside an accumulation
    window), ("epoch", e) saves between epochs, once e epochs are done. `resume`: a checkpoint to load first
    (the run is built from another seed: the checkpoint must bring everything back)."""
    saves = set(saves)
    set_seed(seed if resume is None else seed + 1000)
    model = torch.nn.Linear(DIMS, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerator(gradient_accumulation_steps=accum)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    saved: Dict[Tuple[str, int], str] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, opt, loader = acc.prepare(model, opt, make_loader())
        if resume is not None:
            acc.load_state(resume)

        def save(point):
            if point in saves:
                saved[point] = str(directory / f"{point[0]}{point[1]}")
                acc.save_state(saved[point])

        for epoch in range(loader.epoch, epochs):
            for x, y in loader:
                with acc.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
                counter.micro += 1
                save(("micro", counter.micro))
            save(("epoch", epoch + 1))
    weights = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()]).clone()
    acc.end_training()
    return {"weights": weights, "warnings": [str(w.message) for w in seen], "saved": saved}


def resume_gaps(make_loader, points: List[Tuple[str, int]], directory, **kw) -> Dict[Tuple[str, int], dict]:
    """The uninterrupted run (saving at `points` on its way) and one resumed run per point. Returns per point
    {"diff": max |resumed - uninterrupted| (0.0: bit-exact), "warnings": the resumed run's warnings}."""
    whole = run(make_loader, saves=points, directory=directory, **kw)
    out = {}
    for point in points:
        resumed = run(make_loader, resume=whole["saved"][point], **kw)
        out[point] = {"diff": (resumed["weights"] - whole["weights"]).abs().max().item(),
                      "exact": torch.equal(resumed["weights"], whole["weights"]),
                      "warnings": resumed["warnings"]}
    return out


def unexpected(warnings_seen: List[str], allowed: Optional[str] = None) -> List[str]:
    """Warnings other than the one a cell expects (torch's note on worker counts above the CPU count aside)."""
    return [w for w in warnings_seen
            if "suggested max number of worker" not in w and (allowed is None or allowed not in w)]
