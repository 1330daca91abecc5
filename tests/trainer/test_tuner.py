"""Lightning's tuner: `Tuner(trainer).scale_batch_size` / `.lr_find` and the BatchSizeFinder / LearningRateFinder
callbacks. Out-of-memory errors are injected (a raised torch.OutOfMemoryError above a batch size); on 2 processes
(tests/workers/tuner_ranks.py) only rank 1 runs out of memory, and both ranks must settle on the same size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import WORKERS, torchrun
from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import BatchSizeFinder, Callback, LearningRateFinder
from fabric_lite.callbacks.finders import LRFinder, search_batch_size, search_micro_batch
from fabric_lite.tuner import Tuner


def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class Regression(TrainModule):
    """A linear regression whose training step "runs out of memory" above `fits_up_to` samples."""

    def __init__(self, batch_size=2, lr=0.05, fits_up_to=None, n=256):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.batch_size, self.lr, self.fits_up_to, self.n = batch_size, lr, fits_up_to, n
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(len(x))
        if self.fits_up_to is not None and len(x) > self.fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        return DataLoader(data(self.n), batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def trainer(tmp_path, **kwargs):
    kwargs = {"enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False,
              "logger": False, "accelerator": "cpu", **kwargs}
    return Trainer(default_root_dir=str(tmp_path), **kwargs)


def weights(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- the searches ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, expected", [
    ("power", [(2, True), (4, True), (8, True), (16, True), (32, False)]),
    ("binsearch", [(2, True), (4, True), (8, True), (16, True), (32, False), (24, False), (20, True), (22, True),
                   (23, False)]),
])
def test_search_orders(mode, expected):
    size, trials = search_batch_size(lambda s: s <= 22, 2, mode, 25)
    assert trials == expected and size == (16 if mode == "power" else 22)


def test_search_halves_until_one_fits_and_stops_at_the_dataset_length():
    size, trials = search_batch_size(lambda s: s <= 5, 16, "power", 25)
    assert (size, [s for s, _ in trials]) == (4, [16, 8, 4])
    assert search_batch_size(lambda s: s <= 5, 16, "binsearch", 25)[0] == 5
    size, trials = search_batch_size(lambda s: True, 2, "power", 25, largest=20)
    assert (size, [s for s, _ in trials]) == (20, [2, 4, 8, 16, 20])
    assert search_batch_size(lambda s: True, 2, "power", 3)[0] == 8  # max_trials: the last size tried that fit
    assert search_batch_size(lambda s: False, 4, "power", 25) == (None, [(4, False), (2, False), (1, False)])


def test_micro_batch_search_keeps_divisors_of_the_global_batch():
    assert search_micro_batch(lambda s: s <= 16, 64, "power", 25) == (16, [(64, False), (32, False), (16, True)])
    size, trials = search_micro_batch(lambda s: s <= 20, 48, "binsearch", 25)  # divisors 48 24 16 12 ...
    assert size == 16 and [s for s, _ in trials] == [48, 24, 12, 16]


# -- Tuner.scale_batch_size ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_scale_batch_size_settles_below_the_out_of_memory_error(tmp_path, mode):
    module = Regression(fits_up_to=16)
    before = weights(module).clone()
    t = trainer(tmp_path, max_epochs=1)
    callbacks = t.callbacks
    assert Tuner(t).scale_batch_size(module, mode=mode, steps_per_trial=2) == 16
    assert module.batch_size == 16 and 32 in module.seen
    assert torch.equal(weights(module), before)  # the probes' steps were undone
    assert t.callbacks is callbacks and t.global_step == 0 and t.current_epoch == 0


def test_fit_after_the_search_starts_from_the_original_state(tmp_path):
    """Weights, optimizer and random generators are put back: a fit after the search trains exactly as a fit with
    the found batch size given from the start."""
    tuned = Regression(fits_up_to=16)
    t = trainer(tmp_path / "a", max_steps=5)
    torch.manual_seed(7)
    Tuner(t).scale_batch_size(tuned, steps_per_trial=1)
    t.fit(tuned)
    plain = Regression(batch_size=16)
    torch.manual_seed(7)
    trainer(tmp_path / "b", max_steps=5).fit(plain)
    assert torch.equal(weights(tuned), weights(plain)) and t.global_step == 5


def test_keep_global_batch_raises_accumulation(tmp_path):
    module = Regression(batch_size=32, fits_up_to=8)
    t = trainer(tmp_path, max_steps=2, accumulate_grad_batches=2)
    assert Tuner(t).scale_batch_size(module, keep_global_batch=True, steps_per_trial=1) == 8
    assert module.batch_size * t.accumulate_grad_batches == 64 and t.accumulate_grad_batches == 8
    t.fit(module)
    assert t.global_step == 2 and module.seen[-16:] == [8] * 16  # 2 steps of 8 micro-batches of 8


def test_batch_size_in_hparams_or_datamodule(tmp_path):
    from fabric_lite.trainer.module import DataModule

    class Data(DataModule):
        def __init__(self):
            super().__init__()
            self.hparams.batch_size = 4

        def train_dataloader(self):
            return DataLoader(data(), batch_size=self.hparams.batch_size)

    dm = Data()
    module = Regression(fits_up_to=32)
    del module.batch_size
    assert Tuner(trainer(tmp_path)).scale_batch_size(module, datamodule=dm, init_val=4, steps_per_trial=1) == 32
    assert dm.hparams.batch_size == 32


def test_scale_batch_size_refusals(tmp_path):
    t = trainer(tmp_path)
    with pytest.raises(ValueError, match="keeps its batch size"):
        Tuner(t).scale_batch_size(Regression(), train_dataloaders=DataLoader(data(), batch_size=4))
    with pytest.raises(AttributeError, match="batch_arg_name"):
        Tuner(t).scale_batch_size(Regression(), batch_arg_name="bs")
    with pytest.raises(ValueError, match="mode='huge'"):
        Tuner(t).scale_batch_size(Regression(), mode="huge")
    with pytest.raises(ValueError, match="only method='fit'"):
        Tuner(t).scale_batch_size(Regression(), method="validate")
    with pytest.raises(RuntimeError, match="no batch size fits"):
        Tuner(t).scale_batch_size(Regression(fits_up_to=0), init_val=2)


def test_batch_size_finder_callback_resizes_the_running_fit(tmp_path):
    module = Regression(fits_up_to=16)
    finder = BatchSizeFinder(steps_per_trial=1)
    t = trainer(tmp_path, max_steps=3, callbacks=[finder])
    t.fit(module)
    assert finder.optimal_batch_size == 16 and module.seen[-3:] == [16, 16, 16] and t.global_step == 3


# -- lr_find ---------------------------------------------------------------------------------------------------------
class LowNoise(Regression):
    def train_dataloader(self):
        return DataLoader(data(512), batch_size=64, shuffle=True)


def sweep_best_lr(lrs, steps=20):
    """The learning rate whose plain SGD run (the same data and start) ends with the lowest loss."""
    x, y = data(512).tensors
    finals = {}
    for lr in lrs:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            idx = torch.randperm(512, generator=g)[:64]
            loss = F.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            final = F.mse_loss(net(x), y).item()
        finals[lr] = final if math.isfinite(final) else math.inf
    return min(finals, key=finals.get)


def test_lr_find_suggests_near_the_best_swept_learning_rate(tmp_path):
    module = LowNoise(lr=1e-3)
    before = weights(module).clone()
    finder = Tuner(trainer(tmp_path)).lr_find(module, min_lr=1e-4, max_lr=10.0, num_training=60)
    assert isinstance(finder, LRFinder) and set(finder.results) == {"lr", "loss"}
    assert len(finder.results["lr"]) == len(finder.results["loss"]) < 60  # stopped early: the loss diverged
    assert finder.results["lr"][0] == pytest.approx(1e-4)
    suggestion = finder.suggestion()
    best = sweep_best_lr([10 ** (k / 4) for k in range(-12, 5)])
    assert best / 3 <= suggestion <= best * 3, (suggestion, best)
    assert module.lr == suggestion  # update_attr
    assert torch.equal(weights(module), before)


def test_lr_find_plot_and_arguments(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    module = LowNoise(lr=1e-3)
    finder = Tuner(trainer(tmp_path)).lr_find(module, min_lr=1e-3, max_lr=1.0, num_training=20, mode="linear",
                                              early_stop_threshold=None, update_attr=False)
    assert len(finder.results["lr"]) == 20 and finder.results["lr"][-1] == pytest.approx(1.0)
    assert finder.results["lr"][1] - finder.results["lr"][0] == pytest.approx((1.0 - 1e-3) / 19)
    assert module.lr == 1e-3  # update_attr=False
    fig = finder.plot(suggest=True)
    assert fig.axes[0].get_xlabel() == "Learning rate"
    with pytest.raises(AttributeError, match="attr_name"):
        Tuner(trainer(tmp_path)).lr_find(module, num_training=5, attr_name="nope")


def test_learning_rate_finder_callback_sets_the_running_optimizer(tmp_path):
    module = LowNoise(lr=1e-3)
    finder = LearningRateFinder(min_lr=1e-4, max_lr=10.0, num_training_steps=60)
    seen = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    t = trainer(tmp_path, max_steps=2, callbacks=[finder, Watch()])
    t.fit(module)
    suggestion = finder.optimal_lr.suggestion()
    assert module.lr == pytest.approx(suggestion) and seen == [pytest.approx(suggestion)] * 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_out_of_memory_error_is_recovered(tmp_path):
    """A step that holds 1 GiB per sample: the search runs into the GPU's real limit, frees each failed trial's
    memory, and the fit afterwards trains at the size found."""

    class Hungry(Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append(len(x))
            held = torch.ones(len(x), 2**28, device=x.device)  # 1 GiB of float32 per sample
            return F.mse_loss(self.net(x), y) + 0 * held[0, 0]

    module = Hungry(n=1024)
    t = trainer(tmp_path, accelerator="cuda", devices=1, max_steps=2)
    before = torch.cuda.memory_allocated()
    size = Tuner(t).scale_batch_size(module, mode="binsearch", init_val=8, steps_per_trial=1)
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert size is not None and 8 <= size < total_gib and max(module.seen) > size
    assert torch.cuda.memory_allocated() - before < 2**28  # nothing of the failed trials is left
    t.fit(module)
    assert t.global_step == 2 and module.seen[-2:] == [size, size]


# -- 2 processes ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_out_of_memory_on_one_rank_is_agreed_by_both(tmp_path):
    """gloo DDP: rank 1 alone runs out of memory above batch 16 (inside the training step, before DDP's gradient
    all-reduce). Both ranks settle on 16 in both modes without waiting out the process group's timeout,
    keep_global_batch gives 16 x 4, the callback's fit trains as one started at 16, lr_find suggests the same rate on
    both ranks, and another error on rank 1 alone stops both ranks at once."""
    ranks = torchrun(WORKERS / "tuner_ranks.py", 2, "--root", tmp_path / "root", out_dir=tmp_path, timeout=240)
    for rank, result in enumerate(ranks):
        for mode in ("power", "binsearch"):
            assert result[mode]["found"] == result[mode]["attr"] == 16, (rank, mode)
            assert result[mode]["seconds"] < 20, (rank, mode)  # no hang until the 20 s timeout
        assert 32 in result["power"]["sizes"] and 17 in result["binsearch"]["sizes"]
        assert result["keep"] == {"found": 16, "attr": 16, "accumulate": 4}, rank
        assert result["callback"] == {"found": 16, "last_sizes": [16, 16, 16], "global_step": 3,
                                      "same_weights": True}, rank
    assert ranks[0]["lr_find"] == ranks[1]["lr_find"] and ranks[0]["lr_find"]["suggestion"] is not None
    errors = [r["other_error"] for r in ranks]
    assert errors[1]["type"] == "ValueError" and errors[1]["message"] == "boom on rank 1"
    assert errors[0]["type"] == "RuntimeError" and "other process(es) stopped with an error" in errors[0]["message"]
    assert errors[0]["seconds"] < 15  # told at once, not after the process group's 20 s timeout


def calls_per_step(tmp_path, tune):
    """Python calls per training step of a fit (the difference between an 8-step and a 4-step fit, over 4)."""
    import sys

    counts = []
    for steps in (4, 8):
        module = Regression(batch_size=8)
        t = trainer(tmp_path / f"{tune}{steps}", max_steps=steps)
        if tune:
            Tuner(t).scale_batch_size(module, init_val=8, max_trials=1, steps_per_trial=1)
            Tuner(t).lr_find(module, num_training=3, update_attr=False)
        seen = [0]

        def count(frame, event, arg):
            if event == "call":
                seen[0] += 1

        sys.setprofile(count)
        try:
            t.fit(module)
        finally:
            sys.setprofile(None)
        counts.append(seen[0])
    return (counts[1] - counts[0]) / 4


def test_a_fit_after_tuning_makes_the_same_calls_per_step(tmp_path):
    """The finders leave nothing behind on the module or the Trainer: no wrapper, no hook, no collective."""
    assert calls_per_step(tmp_path, tune=True) == calls_per_step(tmp_path, tune=False)
