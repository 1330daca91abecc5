"""Lightning's hooks that the Trainer has, on a module and a callback written as Lightning users write them: which
run, how often, with which arguments, in Lightning's order, over a tiny fit/test/predict; and Lightning's
Trainer arguments and members a script reads after a run (known values, a few batches)."""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import torchrun
from fabric_lite import Callback, Trainer, TrainModule, seed_everything

MODULE_HOOKS = ["configure_model", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
                "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end",
                "on_validation_epoch_start", "on_validation_epoch_end", "on_train_epoch_end", "on_train_end",
                "on_fit_end", "on_save_checkpoint", "on_load_checkpoint", "on_test_epoch_start",
                "on_test_epoch_end"]
CALLBACK_HOOKS = ["setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
                  "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
                  "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
                  "on_validation_batch_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_end",
                  "on_predict_batch_end", "on_before_optimizer_step", "on_save_checkpoint", "on_load_checkpoint",
                  "on_exception"]


def recorder(name, calls, tag):
    def hook(self, *args):
        calls.append((tag, name, args))

    return hook


def loader(n=8, batch_size=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size)


class Regressor(TrainModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(3, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log_dict({"loss": loss, "double": 2 * loss})
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def recorded(calls):
    module_cls = type("Recorded", (Regressor,), {h: recorder(h, calls, "module") for h in MODULE_HOOKS})
    callback_cls = type("Watcher", (Callback,), {h: recorder(h, calls, "callback") for h in CALLBACK_HOOKS})
    return module_cls(), callback_cls()


def run_trainer(tmp_path, callbacks, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, **kwargs)


def names(calls, tag=None):
    return [name for who, name, _ in calls if tag is None or who == tag]


def test_every_hook_the_trainer_has_runs_in_lightnings_order_with_its_arguments(tmp_path):
    calls = []
    module, watcher = recorded(calls)
    trainer = run_trainer(tmp_path, [watcher], max_epochs=2)
    trainer.fit(module, loader(8), loader(4))  # 4 training batches, 2 validation batches an epoch
    fit = Counter(names(calls))
    assert names(calls, "module")[:4] == ["configure_model", "on_fit_start", "on_train_start", "on_train_epoch_start"]
    assert names(calls, "module")[-2:] == ["on_train_end", "on_fit_end"]
    assert names(calls, "callback")[0] == "setup"
    assert names(calls, "callback")[-3:] == ["on_train_end", "on_fit_end", "teardown"]
    for hook, n in {"on_fit_start": 2, "on_train_start": 2, "on_train_epoch_start": 4, "on_train_batch_start": 16,
                    "on_train_batch_end": 16, "on_before_backward": 8, "on_after_backward": 8,
                    "on_before_optimizer_step": 16, "on_validation_start": 2, "on_validation_end": 2,
                    "on_validation_epoch_start": 4, "on_validation_epoch_end": 4, "on_validation_batch_end": 4,
                    "on_train_epoch_end": 4, "on_train_end": 2, "on_fit_end": 2, "setup": 1, "teardown": 1,
                    "configure_model": 1}.items():
        assert fit[hook] == n, (hook, fit[hook], n)  # module and callback each, where both have the hook
    one_epoch = [name for who, name, _ in calls if who == "callback"][1:]
    first_end = one_epoch.index("on_train_epoch_end")
    assert one_epoch[:first_end].count("on_validation_end") == 1  # validation runs before the epoch's end hook
    args = {(who, name): a for who, name, a in calls}
    assert args[("module", "on_train_batch_start")][1] == 3  # (batch, batch_idx): the epoch's last batch
    outputs, batch, batch_idx = args[("callback", "on_train_batch_end")][2:]
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs  # (Lightning gives {"loss": loss})
    assert batch_idx == 3 and loss.dim() == 0 and len(batch) == 2
    assert args[("module", "on_before_backward")][0].dim() == 0  # the loss
    assert args[("callback", "on_before_optimizer_step")][2] is trainer.optimizers[0]
    assert args[("callback", "setup")][2] == "fit" and args[("callback", "teardown")][2] == "fit"
    assert ("module", "on_save_checkpoint") not in args  # no checkpointing asked for

    calls.clear()
    x, y = next(iter(loader(4, batch_size=4)))
    with torch.no_grad():
        expected = float(F.mse_loss(module.net(x), y))
    assert trainer.test(module, loader(4, batch_size=4)) == [{"test_loss": pytest.approx(expected, rel=1e-5)}]
    assert Counter(names(calls)) == {"on_test_epoch_start": 2, "on_test_epoch_end": 2, "on_test_batch_end": 1,
                                     "setup": 1, "teardown": 1}  # (the callback's, with stage="test")
    calls.clear()
    predictions = trainer.predict(module, loader(4))
    assert len(predictions) == 2 and names(calls) == ["setup", "on_predict_batch_end", "on_predict_batch_end",
                                                      "teardown"]
    assert calls[2][2][4] == 1 and torch.equal(calls[2][2][2], predictions[1])  # (trainer, module, outputs, batch,
    #                                                                                      batch_idx)


def test_checkpoint_hooks_and_callback_state_round_trip(tmp_path):
    class Counting(Callback):
        def __init__(self):
            self.batches = 0
            self.loaded = None

        @property
        def state_key(self):
            return "Counting[every=1]"

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batches += 1

        def state_dict(self):
            return {"batches": self.batches}

        def load_state_dict(self, state):
            self.loaded = dict(state)

        def on_save_checkpoint(self, trainer, module, checkpoint):
            checkpoint["counting"] = self.batches

        def on_load_checkpoint(self, trainer, module, checkpoint):
            self.restored_extra = checkpoint["counting"]

    class Saving(Regressor):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["module_note"] = self.global_step

        def on_load_checkpoint(self, checkpoint):
            self.note = checkpoint["module_note"]

    first = Counting()
    run_trainer(tmp_path, [first], max_epochs=1, enable_checkpointing=True).fit(Saving(), loader(8))
    assert first.batches == 4
    second, module = Counting(), Saving()
    trainer = run_trainer(tmp_path, [second], max_epochs=2, enable_checkpointing=True)
    trainer.fit(module, loader(8), ckpt_path="last")
    assert second.loaded == {"batches": 4} and second.restored_extra == 4 and module.note == 4
    assert second.batches == 4 and trainer.global_step == 8  # the second epoch only


def test_on_exception_reaches_the_callbacks_and_the_error_goes_on(tmp_path):
    calls = []

    class Failing(Regressor):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("bad batch")
            return super().training_step(batch, batch_idx)

    watcher = type("Watcher", (Callback,), {h: recorder(h, calls, "callback") for h in CALLBACK_HOOKS})()
    with pytest.raises(RuntimeError, match="bad batch"):
        run_trainer(tmp_path, [watcher], max_epochs=1).fit(Failing(), loader(8))
    (error,) = [args[2] for _, name, args in calls if name == "on_exception"]
    assert str(error) == "bad batch" and names(calls)[-1] == "teardown"


def test_the_trainer_arguments_and_members_a_script_reads_after_fit(tmp_path):
    seed_everything(7)
    first = torch.rand(1)
    seed_everything(7)
    assert torch.equal(torch.rand(1), first)
    module = Regressor(lr=0.2)
    trainer = run_trainer(tmp_path, [], max_epochs=3, max_steps=5, accumulate_grad_batches=2,
                          gradient_clip_algorithm="value", gradient_clip_val=0.5, log_every_n_steps=1,
                          check_val_every_n_epoch=2, val_check_interval=1.0, limit_test_batches=1,
                          limit_predict_batches=1)
    trainer.fit(module, loader(8), loader(4))
    assert trainer.global_step == 5 and trainer.current_epoch == 3  # 2 steps an epoch, stopped at 5 in the third
    assert (trainer.max_steps, trainer.accumulate_grad_batches, trainer.gradient_clip_algorithm,
            trainer.gradient_clip_val, trainer.log_every_n_steps, trainer.check_val_every_n_epoch,
            trainer.val_check_interval, trainer.num_sanity_val_steps, trainer.fast_dev_run) == \
        (5, 2, "value", 0.5, 1, 2, 1.0, 0, False)
    (config,) = trainer.lr_scheduler_configs
    assert config.interval == "epoch" and module.lr_schedulers() is config.scheduler
    assert config.scheduler.get_last_lr() == [pytest.approx(0.2 * 0.5 ** 3)]  # three epoch ends
    assert set(trainer.logged_metrics) >= {"loss", "double"}
    assert float(trainer.logged_metrics["double"]) == pytest.approx(2 * float(trainer.logged_metrics["loss"]))
    assert len(trainer.train_dataloader) == 4 and len(trainer.val_dataloaders) == 1
    assert module.trainer is trainer and module.device == trainer.device == torch.device("cpu")
    assert trainer.model.state_dict().keys() == module.state_dict().keys()
    assert trainer.validate(module, loader(4))[0].keys() == {"val_loss"}
    assert len(trainer.test(module, loader(8))) == 1  # limit_test_batches=1: one batch of the four
    x = next(iter(loader(8)))[0]
    (prediction,) = trainer.predict(module, loader(8))  # limit_predict_batches=1
    with torch.no_grad():
        assert torch.allclose(prediction, module(x))


def test_max_time_stops_fit_after_the_step_that_reaches_it(tmp_path):
    trainer = run_trainer(tmp_path, [], max_epochs=5, max_time=1e-9)
    trainer.fit(Regressor(), loader(8))
    assert trainer.global_step == 1


def test_should_stop_set_by_a_callback_ends_fit_after_that_batch(tmp_path):
    class StopAtTwo(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.should_stop = True

    trainer = run_trainer(tmp_path, [StopAtTwo()], max_epochs=3)
    assert trainer.should_stop is False
    trainer.fit(Regressor(), loader(8))
    assert trainer.should_stop is True and trainer.global_step == 2


NAMES_WORKER = textwrap.dedent("""
    import contextlib, io, json, sys
    import torch
    from torch import nn
    from fabric_lite import Trainer, TrainModule

    out = sys.argv[sys.argv.index("--out") + 1]
    trainer = Trainer(accelerator="cpu", strategy="ddp", enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False)
    module = TrainModule()
    module.layer = nn.Linear(2, 2)
    module.trainer = trainer
    rank = trainer.global_rank
    gathered = module.all_gather({"x": torch.tensor([rank, rank + 10.0]), "n": [torch.tensor(rank)]})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.print("module", rank)
        trainer.print("trainer", rank)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"x": gathered["x"].tolist(), "n": gathered["n"][0].tolist(), "printed": printed.getvalue(),
                   "ranks": [module.global_rank, module.local_rank], "world": trainer.world_size}, f)
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_all_gather_and_print_on_two_processes_as_in_lightning(tmp_path):
    script = tmp_path / "names_worker.py"
    script.write_text(NAMES_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    results = torchrun(script, 2, out_dir=out, timeout=150)
    for rank, result in enumerate(results):
        assert result["world"] == 2 and result["ranks"] == [rank, rank]
        assert result["x"] == [[0.0, 10.0], [1.0, 11.0]] and result["n"] == [0, 1]  # stacked along a new dim 0
    assert results[0]["printed"] == "module 0\ntrainer 0\n" and results[1]["printed"] == ""
