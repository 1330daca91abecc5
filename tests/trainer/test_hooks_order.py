"""Which hooks the Trainer calls, with which arguments, in which order: fit, validate, test and predict, recorded
from a callback and a module that override every hook, against Lightning's order written out here.

Where the order differs from Lightning's it is said next to the expected list: the module's `setup` runs
before the callbacks' (with the data hooks, when the loaders are asked for), the epoch-end hooks run the
module's before the callbacks' (the callbacks read that epoch's results, which this Trainer computes at the
epoch's end), callbacks hear no `on_validation_epoch_end` during the sanity check, and `on_before_zero_grad`
comes after the optimizer step (this engine clears gradients after stepping).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks.base import Callback
from fabric_lite.callbacks.lambda_callback import LambdaCallback
from fabric_lite.callbacks.checkpoint import ModelCheckpoint

CALLBACK_HOOKS = [n for n in vars(Callback) if n.startswith("on_") and n not in ("on_log", "on_hyperparameters",
                                                                                  "on_exception")]
CALLBACK_HOOKS += ["setup", "teardown"]
MODULE_HOOKS = [n for n in vars(TrainModule) if n.startswith("on_")] + ["setup", "teardown", "on_before_batch_transfer",
                                                                        "transfer_batch_to_device", "on_after_batch_transfer"]


def short(value):
    """What a recorded argument is checked by: its kind for batches, outputs, losses and optimizers."""
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "batch"
    if isinstance(value, dict):
        return "dict:" + ",".join(sorted(value))
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, torch.optim.Optimizer) or hasattr(value, "param_groups"):
        return "optimizer"
    return type(value).__name__


class Recorder(Callback):
    def __init__(self, calls):
        self.calls = calls


def _callback_hook(name):
    def hook(self, trainer, module, *args):
        assert isinstance(trainer, Trainer) and isinstance(module, TrainModule)
        self.calls.append(("Callback." + name, *map(short, args)))
    return hook


for _name in CALLBACK_HOOKS:
    setattr(Recorder, _name, _callback_hook(_name))


class Recorded(TrainModule):
    def __init__(self, calls):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)
        self.calls = calls

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.calls.append(("training_step", batch_idx))
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.calls.append(("validation_step", batch_idx))
        return {"x": F.mse_loss(self(batch[0]), batch[1])}

    def test_step(self, batch, batch_idx):
        self.calls.append(("test_step", batch_idx))
        return {"y": F.mse_loss(self(batch[0]), batch[1])}

    def predict_step(self, batch, batch_idx):
        self.calls.append(("predict_step", batch_idx))
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _module_hook(name, default):
    def hook(self, *args):
        self.calls.append((name, *map(short, args)))
        return default(self, *args)
    return hook


for _name in MODULE_HOOKS:
    setattr(Recorded, _name, _module_hook(_name, getattr(TrainModule, _name)))


def data(n=8):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def make_trainer(tmp_path, calls, **kwargs):
    return Trainer(default_root_dir=str(tmp_path), callbacks=[Recorder(calls)], enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, logger=False, **kwargs)


def both(name, *args):
    return [("Callback." + name, *args), (name, *args)]


def moved(dataloader_idx=0):
    """The batch-transfer hooks, before any batch hook (Lightning's order)."""
    return [("on_before_batch_transfer", "batch", dataloader_idx),
            ("transfer_batch_to_device", "batch", "device", dataloader_idx),
            ("on_after_batch_transfer", "batch", dataloader_idx)]


def eval_run(noun, batches, sanity=False):
    """One validation or test run over one loader (Lightning's `_eval_epoch` with its start/end around it)."""
    out = [(f"on_{noun}_model_eval",), *both(f"on_{noun}_start"), *both(f"on_{noun}_epoch_start")]
    for i in range(batches):
        out += [*moved(), *both(f"on_{noun}_batch_start", "batch", i), (f"{noun}_step", i),
                *both(f"on_{noun}_batch_end", "dict:" + ("x" if noun == "validation" else "y"), "batch", i)]
    out += [(f"on_{noun}_epoch_end",)]  # the module's first, then the callbacks' (none during the sanity check)
    if not sanity:
        out += [(f"Callback.on_{noun}_epoch_end",)]
    out += [*both(f"on_{noun}_end"), (f"on_{noun}_model_train",)]
    return out


def train_batch(i):
    return [*moved(), *both("on_train_batch_start", "batch", i), ("training_step", i),
            *both("on_before_backward", "tensor"), *both("on_after_backward"),
            *both("on_before_optimizer_step", "optimizer"),
            *both("on_before_zero_grad", "optimizer"),  # (after the step here; before backward in Lightning)
            *both("on_train_batch_end", "dict:loss", "batch", i)]


def test_fit_calls_every_hook_in_lightnings_order(tmp_path):
    calls = []
    trainer = make_trainer(tmp_path, calls, max_epochs=1, limit_train_batches=2, limit_val_batches=2,
                           num_sanity_val_steps=1)
    trainer.fit(Recorded(calls), DataLoader(data(), batch_size=2), DataLoader(data(), batch_size=2))
    expected = [
        ("setup", "fit"), ("Callback.setup", "fit"),  # (module first, see the docstring)
        *both("on_fit_start"),
        ("Callback.on_sanity_check_start",), *eval_run("validation", 1, sanity=True), ("Callback.on_sanity_check_end",),
        *both("on_train_start"),
        *both("on_train_epoch_start"),
        *train_batch(0), *train_batch(1),
        *eval_run("validation", 2),
        ("on_train_epoch_end",), ("Callback.on_train_epoch_end",),  # (module first, see the docstring)
        *both("on_train_end"), *both("on_fit_end"),
        ("Callback.teardown", "fit"), ("teardown", "fit"),
    ]
    assert calls == expected


@pytest.mark.parametrize("verb, noun", [("validate", "validation"), ("test", "test")])
def test_validate_and_test_call_their_hooks_in_lightnings_order(tmp_path, verb, noun):
    calls = []
    trainer = make_trainer(tmp_path, calls, limit_val_batches=2, limit_test_batches=2)
    getattr(trainer, verb)(Recorded(calls), DataLoader(data(), batch_size=2))
    assert calls == [("setup", verb), ("Callback.setup", verb), *eval_run(noun, 2),
                     ("Callback.teardown", verb), ("teardown", verb)]


def test_predict_calls_its_hooks_in_lightnings_order(tmp_path):
    calls = []
    trainer = make_trainer(tmp_path, calls, limit_predict_batches=2)
    module = Recorded(calls)
    module.train()
    out = trainer.predict(module, DataLoader(data(), batch_size=2))
    batches = []
    for i in range(2):
        batches += [*moved(), *both("on_predict_batch_start", "batch", i), ("predict_step", i),
                    *both("on_predict_batch_end", "tensor", "batch", i)]
    assert calls == [
        ("setup", "predict"), ("Callback.setup", "predict"),
        ("on_predict_model_eval",), *both("on_predict_start"), *both("on_predict_epoch_start"),
        *batches,
        *both("on_predict_epoch_end"), *both("on_predict_end"),
        ("Callback.teardown", "predict"), ("teardown", "predict"),
    ]
    assert len(out) == 2 and module.training  # the module's mode from before is restored


class TwoLoaders(Recorded):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls.append(("validation_step", batch_idx, dataloader_idx))
        return {"x": F.mse_loss(self(batch[0]), batch[1])}


def test_several_loaders_pass_dataloader_idx_to_batch_hooks_and_steps(tmp_path):
    calls = []
    trainer = make_trainer(tmp_path, calls, limit_val_batches=1)
    trainer.validate(TwoLoaders(calls), [DataLoader(data(), batch_size=2), DataLoader(data(), batch_size=2)])
    assert [c for c in calls if c[0] == "on_before_batch_transfer"] == [("on_before_batch_transfer", "batch", 0),
                                                                        ("on_before_batch_transfer", "batch", 1)]
    batch_calls = [c for c in calls if ("batch" in c[0] and "transfer" not in c[0]) or c[0].endswith("_step")]
    assert batch_calls == [
        ("Callback.on_validation_batch_start", "batch", 0, 0), ("on_validation_batch_start", "batch", 0, 0),
        ("validation_step", 0, 0),
        ("Callback.on_validation_batch_end", "dict:x", "batch", 0, 0), ("on_validation_batch_end", "dict:x", "batch", 0, 0),
        ("Callback.on_validation_batch_start", "batch", 0, 1), ("on_validation_batch_start", "batch", 0, 1),
        ("validation_step", 0, 1),
        ("Callback.on_validation_batch_end", "dict:x", "batch", 0, 1), ("on_validation_batch_end", "dict:x", "batch", 0, 1),
    ]
    # one loader: no dataloader_idx at all (Lightning passes it only with several)
    calls.clear()
    trainer.validate(TwoLoaders(calls), DataLoader(data(), batch_size=2))
    assert ("validation_step", 0, 0) in calls and ("on_validation_batch_start", "batch", 0) in calls


def test_validation_model_train_restores_each_layers_mode_unless_overridden(tmp_path):
    class Frozen(TrainModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Dropout(0.5)
            self.b.eval()  # a layer kept in eval mode on purpose

        def validation_step(self, batch, batch_idx):
            assert not self.a.training and not self.b.training
            return None

    module = Frozen()
    module.a.train()
    Trainer(enable_progress_bar=False, enable_checkpointing=False, logger=False, enable_model_summary=False,
            default_root_dir=str(tmp_path)).validate(module, DataLoader(data(), batch_size=4))
    assert module.a.training and not module.b.training


def test_lambda_callback_runs_the_functions_it_was_given(tmp_path):
    seen = []
    cb = LambdaCallback(on_train_epoch_start=lambda t, m: seen.append(("epoch", t.current_epoch)),
                        on_train_batch_end=lambda t, m, out, batch, i: seen.append(("batch", i, sorted(out))))
    trainer = Trainer(max_epochs=2, limit_train_batches=2, callbacks=[cb], enable_progress_bar=False,
                      enable_checkpointing=False, logger=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(Recorded([]), DataLoader(data(), batch_size=2))
    assert seen == [("epoch", 0), ("batch", 0, ["loss"]), ("batch", 1, ["loss"]),
                    ("epoch", 1), ("batch", 0, ["loss"]), ("batch", 1, ["loss"])]
    with pytest.raises(TypeError, match="on_train_epoch_ends.*not a Callback hook"):
        LambdaCallback(on_train_epoch_ends=print)
    with pytest.raises(TypeError, match="needs a function"):
        LambdaCallback(on_fit_start=3)


class Marker(Callback):
    def __init__(self, tag):
        self.tag = tag


class SubMarker(Marker):
    pass


def test_configure_callbacks_replaces_the_trainers_of_the_same_type_and_checkpoints_go_last(tmp_path):
    kept, replaced, plain = Marker("trainer"), LambdaCallback(), Callback()
    mine_sub, mine_plain = SubMarker("module"), Callback()
    mine_ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"))

    class WithCallbacks(Recorded):
        def configure_callbacks(self):
            return [mine_ckpt, mine_sub, mine_plain]

    trainer = Trainer(callbacks=[kept, replaced, plain], enable_progress_bar=False, logger=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.validate(WithCallbacks([]), DataLoader(data(), batch_size=4))
    # SubMarker replaces the Trainer's Marker (its parent type); a plain Callback replaces nothing;
    # the checkpoint callback goes last
    assert trainer.callbacks == [replaced, plain, mine_sub, mine_plain, mine_ckpt]
    trainer.predict(WithCallbacks([]), DataLoader(data(), batch_size=4))  # every stage asks again: no duplicates
    assert trainer.callbacks == [replaced, plain, mine_sub, mine_plain, mine_ckpt]


def test_on_train_batch_start_returning_minus_one_ends_the_epoch_after_the_callbacks_heard_it(tmp_path):
    calls = []

    class Stops(Recorded):
        def on_train_batch_start(self, batch, batch_idx):
            calls.append(("on_train_batch_start", batch_idx))
            return -1 if batch_idx == 1 else None

    trainer = make_trainer(tmp_path, calls, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Stops(calls), DataLoader(data(), batch_size=2))
    starts = [c for c in calls if c[0].endswith("on_train_batch_start")]
    assert starts == [("Callback.on_train_batch_start", "batch", 0), ("on_train_batch_start", 0),
                      ("Callback.on_train_batch_start", "batch", 1), ("on_train_batch_start", 1)]
    assert [c for c in calls if c[0] == "training_step"] == [("training_step", 0)]


class Augmenting(TrainModule):
    """Doubles each input before the transfer and adds one after it: training sees 2x + 1."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.net = nn.Linear(3, 1)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return [batch[0] * 2, batch[1]]

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return [batch[0] + 1, batch[1]]

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return F.mse_loss(self.net(batch[0]), batch[1])

    def predict_step(self, batch, batch_idx):
        return batch[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_batch_transfer_hooks_change_the_batches_every_stage_sees(tmp_path):
    ds = data(4)
    module = Augmenting()
    trainer = Trainer(max_epochs=1, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(ds, batch_size=2))
    torch.testing.assert_close(torch.cat(module.seen), ds.tensors[0] * 2 + 1)
    out = trainer.predict(module, DataLoader(ds, batch_size=4))
    torch.testing.assert_close(out[0], ds.tensors[0] * 2 + 1)
