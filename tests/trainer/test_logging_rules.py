"""`self.log` / `self.log_dict` as Lightning users write them: which hook logs what by default and what it
refuses, the `_step`/`_epoch` names, per-step logging in validation and test, `reduce_fx`, `batch_size`,
several evaluation loaders, torchmetrics objects, `rank_zero_only`, `enable_graph`, and what
`trainer.callback_metrics` / `logged_metrics` / `progress_bar_metrics` hold.

The logged values are chosen so that every expected number is known by hand: the samples are the
numbers 0, 1, 2, ... in batches of 4 (or 2), so a batch's mean and an epoch's weighted mean are plain
arithmetic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Trainer, TrainModule
from fabric_lite.callbacks import Callback


def numbers(lo, hi):
    """Samples lo, lo+1, ..., hi-1 as (x, y) with x == y (one feature)."""
    x = torch.arange(lo, hi, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, x)


def loader(lo, hi, batch_size=4):
    return DataLoader(numbers(lo, hi), batch_size=batch_size)


class Recorder(Callback):
    """Everything sent to the loggers: (step, {name: value})."""

    def __init__(self):
        self.logs = []

    def on_log(self, trainer, metrics, step):
        self.logs.append((step, dict(metrics)))

    def of(self, key):
        return [(step, m[key]) for step, m in self.logs if key in m]


def make_trainer(tmp_path, *callbacks, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return Trainer(default_root_dir=tmp_path, callbacks=list(callbacks), enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, **kwargs)


class Base(TrainModule):
    """A 1-feature linear model that does not move (lr 0): the logged values are the data's own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


# -- per-step logging in evaluation ----------------------------------------------------------------

class ValPerStep(Base):
    def validation_step(self, batch, batch_idx):
        self.log("val_x", batch[0].mean(), on_step=True)             # on_epoch stays True in validation


def test_validation_on_step_logs_each_step_under_its_own_counter_and_the_epoch_mean(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec, max_epochs=2, limit_train_batches=2, num_sanity_val_steps=2)
    trainer.fit(ValPerStep(), loader(0, 8), loader(0, 10))          # val batches: [0..3] [4..7] [8, 9]
    # one value per validation step, counted over the whole fit (the sanity check does not count)
    assert rec.of("val_x_step") == [(0, 1.5), (1, 5.5), (2, 8.5), (3, 1.5), (4, 5.5), (5, 8.5)]
    assert rec.of("val_x_epoch") == [(2, 4.5), (4, 4.5)]             # at the global step, weighted mean
    assert "val_x" not in {k for _, m in rec.logs for k in m}
    # evaluation step values stay out of callback_metrics (as in Lightning); the loggers' copy keeps them
    assert set(trainer.callback_metrics) == {"val_x", "val_x_epoch"}
    assert float(trainer.callback_metrics["val_x"]) == 4.5
    assert float(trainer.logged_metrics["val_x_step"]) == 8.5 and float(trainer.logged_metrics["val_x_epoch"]) == 4.5
    rec.logs.clear()
    assert trainer.validate(trainer.module, loader(0, 10)) == [{"val_x_epoch": 4.5}]
    assert [s for s, _ in rec.of("val_x_step")] == [0, 1, 2]           # trainer.validate counts from 0


class PerTestStep(Base):
    def test_step(self, batch, batch_idx):
        self.log("t", batch[0].sum(), on_step=True, on_epoch=False)


def test_test_step_logs_per_step_only(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec)
    assert trainer.test(PerTestStep(), loader(0, 6)) == [{}]         # nothing per epoch: nothing returned
    assert rec.of("t") == [(0, 6.0), (1, 9.0)]


# -- defaults and refusals per hook -----------------------------------------------------------------

class LogsIn(Base):
    """Logs `value` with `kwargs` from the hook named `where`."""

    def __init__(self, where, value=1.0, **kwargs):
        super().__init__()
        self.where, self.value, self.kwargs = where, value, kwargs

    def _maybe(self, hook):
        if self.where == hook:
            self.log("m", self.value, **self.kwargs)

    def training_step(self, batch, batch_idx):
        self._maybe("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self._maybe("validation_step")

    def predict_step(self, batch, batch_idx):
        self._maybe("predict_step")
        return batch[0]

    def on_fit_start(self):
        self._maybe("on_fit_start")

    def on_train_start(self):
        self._maybe("on_train_start")

    def on_train_end(self):
        self._maybe("on_train_end")

    def on_train_epoch_start(self):
        self._maybe("on_train_epoch_start")

    def on_train_epoch_end(self):
        self._maybe("on_train_epoch_end")

    def on_validation_epoch_end(self):
        self._maybe("on_validation_epoch_end")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._maybe("on_train_batch_end")


@pytest.mark.parametrize("where, kwargs, message", [
    ("on_fit_start", {}, "on_fit_start, where logging is not allowed"),
    ("on_train_end", {}, "on_train_end, where logging is not allowed"),
    ("on_train_epoch_end", {"on_step": True}, "on_step=True) is not allowed in on_train_epoch_end"),
    ("on_validation_epoch_end", {"on_epoch": False}, "on_epoch=False) is not allowed in on_validation_epoch_end"),
    ("training_step", {"on_step": False, "on_epoch": False}, "records nothing"),
    ("training_step", {"reduce_fx": "median"}, "reduce_fx='median'): allowed reductions are 'mean', 'sum'"),
    ("training_step", {"reduce_fx": torch.median}, "reduce_fx=median)"),
    ("training_step", {"sync_dist": True, "rank_zero_only": True}, "rank_zero_only=True, sync_dist=True"),
])
def test_what_a_hook_refuses_is_one_clear_error_naming_the_key(tmp_path, where, kwargs, message):
    with pytest.raises((ValueError, RuntimeError), match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        make_trainer(tmp_path, limit_train_batches=1).fit(LogsIn(where, **kwargs), loader(0, 4), loader(0, 4))
    assert "self.log('m'" in str(err.value)


def test_logging_in_predict_step_is_refused_as_in_lightning(tmp_path):
    trainer = make_trainer(tmp_path)
    with pytest.raises(RuntimeError, match="self.log\\('m'\\) was called in predict_step: prediction does not log"):
        trainer.predict(LogsIn("predict_step"), loader(0, 4))


@pytest.mark.parametrize("where, expected", [
    ("training_step", {"m"}),                     # per step by default
    ("on_train_batch_end", {"m"}),
    ("on_train_start", {"m"}),                    # epoch-level hooks: once, at the epoch end
    ("on_train_epoch_start", {"m"}),
    ("on_train_epoch_end", {"m"}),
    ("validation_step", {"m"}),                   # per epoch by default
    ("on_validation_epoch_end", {"m"}),
])
def test_each_hook_logs_with_lightnings_default(tmp_path, where, expected):
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec, max_epochs=2, limit_train_batches=3, log_every_n_steps=1)
    trainer.fit(LogsIn(where, value=2.0), loader(0, 12), loader(0, 4))
    steps = [s for s, _ in rec.of("m")]
    per_step = where in ("training_step", "on_train_batch_end")
    if per_step:
        assert steps == [1, 2, 3, 4, 5, 6]
    elif where == "on_train_start":
        assert steps == [3]                        # one value, with the first epoch's results
    else:
        assert steps == [3, 6]
    assert {k for k in trainer.callback_metrics} == expected
    assert float(trainer.callback_metrics["m"]) == 2.0


class ChangesArguments(Base):
    def training_step(self, batch, batch_idx):
        self.log("m", 1.0, prog_bar=batch_idx == 1)
        return super().training_step(batch, batch_idx)


def test_one_name_logged_twice_in_a_hook_with_other_arguments_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"self.log\('m'\) was called twice in training_step with different "
                                         r"arguments: prog_bar=True \(before: False\)"):
        make_trainer(tmp_path).fit(ChangesArguments(), loader(0, 8))


class BadValue(Base):
    def __init__(self, value, name="m"):
        super().__init__()
        self.value, self.name = value, name

    def training_step(self, batch, batch_idx):
        self.log(self.name, self.value)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("value, name, message", [
    (torch.ones(3), "m", r"self.log\('m'\) got a tensor of shape \(3,\); .* value.mean\(\)"),
    ({"a": 1.0}, "m", r"self.log\('m'\) got a dict; log several values with self.log_dict"),
    ("text", "m", r"self.log\('m'\) got a str"),
    (1.0, "m/dataloader_idx_0", r"must not contain '/dataloader_idx_'"),
])
def test_a_value_that_cannot_be_logged_names_the_key_and_the_fix(tmp_path, value, name, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path).fit(BadValue(value, name), loader(0, 4))


def test_log_without_a_trainer_warns_and_drops_the_value():
    with pytest.warns(UserWarning, match="not attached to a Trainer"):
        Base().log("m", 1.0)


# -- names, reductions, batch sizes -----------------------------------------------------------------

class Outputs(Base):
    def training_step(self, batch, batch_idx):
        x = batch[0]
        self.log("a", x.mean())                                                   # per step
        self.log("b", x.mean(), on_step=True, on_epoch=True, prog_bar=True)       # both: b_step and b_epoch
        self.log("c", x.max(), on_step=False, on_epoch=True, prog_bar=True, logger=False, reduce_fx="max")
        self.seen_during = dict(self.trainer.callback_metrics)
        return super().training_step(batch, batch_idx)


class Snapshot(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.callback = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.bar = dict(trainer.progress_bar_metrics)


def test_callback_logged_and_progress_bar_metrics_hold_lightnings_contents(tmp_path):
    snap, rec = Snapshot(), Recorder()
    trainer = make_trainer(tmp_path, snap, rec, log_every_n_steps=1)
    trainer.fit(Outputs(), loader(0, 10))                    # batches [0..3] [4..7] [8, 9]
    # during the last step: step values under the plain and the _step name; epoch values not yet
    assert snap.callback == {"a": 8.5, "b": 8.5, "b_step": 8.5}
    assert snap.bar == {"b_step": 8.5} and isinstance(snap.bar["b_step"], float)
    # after the epoch: "b" is the epoch value (weighted mean 4.5), "c" the max
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == {
        "a": 8.5, "b": 4.5, "b_step": 8.5, "b_epoch": 4.5, "c": 9.0}
    assert all(isinstance(v, torch.Tensor) for v in trainer.logged_metrics.values())
    assert {k: float(v) for k, v in trainer.logged_metrics.items()} == {"a": 8.5, "b_step": 8.5, "b_epoch": 4.5}
    assert trainer.progress_bar_metrics == {"b_step": 8.5, "b_epoch": 4.5, "c": 9.0}
    assert rec.of("b_step") == [(1, 1.5), (2, 5.5), (3, 8.5)] and rec.of("b_epoch") == [(3, 4.5)]
    assert rec.of("c") == []                                                      # logger=False


class Reductions(Base):
    def training_step(self, batch, batch_idx):
        x = batch[0]
        kw = dict(on_step=False, on_epoch=True)
        self.log("mean", x.mean(), **kw)                                  # weighted by the batch size
        self.log("avg", x.mean(), reduce_fx="avg", **kw)
        self.log("torch_mean", x.mean(), reduce_fx=torch.mean, **kw)
        self.log("sum", x.sum(), reduce_fx="SUM", **kw)
        self.log("torch_sum", x.sum(), reduce_fx=torch.sum, **kw)
        self.log("max", x.max(), reduce_fx=torch.max, **kw)
        self.log("builtin_max", x.max(), reduce_fx=max, **kw)
        self.log("min", x.min(), reduce_fx=torch.min, **kw)
        self.log("unweighted", x.mean(), batch_size=1, **kw)
        self.log("dict_batch", x.mean(), **kw)
        self.log("int", int(x.sum()), reduce_fx="sum", **kw)              # numbers and int tensors become floats
        self.log("int_tensor", x.sum().long(), reduce_fx="sum", **kw)
        return super().training_step(batch, batch_idx)


def test_reduce_fx_strings_and_torch_functions_and_batch_size_weighting(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.fit(Reductions(), loader(0, 10))                 # batches [0..3] [4..7] [8, 9]: sizes 4, 4, 2
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for name in ("mean", "avg", "torch_mean", "dict_batch"):
        assert m[name] == 4.5, name                          # (1.5*4 + 5.5*4 + 8.5*2) / 10
    assert m["sum"] == m["torch_sum"] == m["int"] == m["int_tensor"] == 45.0
    assert m["max"] == m["builtin_max"] == 9.0 and m["min"] == 0.0
    assert m["unweighted"] == pytest.approx((1.5 + 5.5 + 8.5) / 3)


class DictBatches(Base):
    def training_step(self, batch, batch_idx):
        self.log("w", batch["x"].mean(), on_step=False, on_epoch=True)    # size read from the dict's tensor
        return F.mse_loss(self.net(batch["x"]), batch["x"])


class StringBatches(Base):
    def validation_step(self, batch, batch_idx):
        self.log("s", 1.0)                                                 # a mean over batches of strings


def test_batch_size_is_read_from_a_dict_batch_and_a_batch_without_tensors_needs_it(tmp_path):
    trainer = make_trainer(tmp_path)
    data = [{"x": torch.tensor([float(i)])} for i in range(6)]              # batches [0..3] [4, 5]
    trainer.fit(DictBatches(), DataLoader(data, batch_size=4))
    assert float(trainer.callback_metrics["w"]) == pytest.approx((1.5 * 4 + 4.5 * 2) / 6)
    with pytest.raises(ValueError, match=r"self.log\('s'\) needs the batch size .* batch_size=\.\.\."):
        make_trainer(tmp_path).validate(StringBatches(), DataLoader(["a", "b", "c"], batch_size=2))


class LogDictAll(Base):
    def training_step(self, batch, batch_idx):
        x = batch[0]
        self.log_dict({"p": x.max(), "q": x.min()}, prog_bar=True, logger=False, on_step=False, on_epoch=True,
                      reduce_fx="max", enable_graph=False, sync_dist=True, sync_dist_group=None,
                      add_dataloader_idx=True, batch_size=4, rank_zero_only=False)
        return super().training_step(batch, batch_idx)


def test_log_dict_takes_every_keyword_of_log(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec)
    trainer.fit(LogDictAll(), loader(0, 10))
    assert trainer.progress_bar_metrics == {"p": 9.0, "q": 8.0}
    assert "p" not in trainer.logged_metrics and rec.of("p") == []


class Graph(Base):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("attached", loss, enable_graph=True)
        self.log("detached", loss)
        return loss


class GraphWatch(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.flags = (trainer.callback_metrics["attached"].requires_grad,
                      trainer.callback_metrics["detached"].requires_grad)


def test_enable_graph_keeps_the_step_value_attached(tmp_path):
    watch = GraphWatch()
    make_trainer(tmp_path, watch, limit_train_batches=1).fit(Graph(), loader(0, 4))
    assert watch.flags == (True, False)


# -- several evaluation loaders ---------------------------------------------------------------------

class TwoLoaders(Base):
    def __init__(self, same_name_without_idx=False):
        super().__init__()
        self.same = same_name_without_idx

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x = batch[0]
        self.log("v", x.mean())
        self.log("s", x.sum(), on_step=True, on_epoch=False)
        name = "plain" if self.same else f"plain_{int(x.min() >= 10)}"       # (loader 1 holds 10 and up)
        self.log(name, x.max(), reduce_fx="max", add_dataloader_idx=False)

    def on_validation_epoch_end(self):
        self.log("end", 7.0)


def test_several_loaders_get_the_dataloader_idx_suffix_and_epoch_end_values_in_each_result(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec)
    results = trainer.validate(TwoLoaders(), [loader(0, 8), loader(10, 16)])   # [0..3] [4..7] | [10..13] [14, 15]
    assert results == [{"v/dataloader_idx_0": 3.5, "plain_0": 7.0, "end": 7.0},
                       {"v/dataloader_idx_1": 12.5, "plain_1": 15.0, "end": 7.0}]
    assert rec.of("s/dataloader_idx_0") == [(0, 6.0), (1, 22.0)]          # each loader counts its own steps
    assert rec.of("s/dataloader_idx_1") == [(0, 46.0), (1, 29.0)]
    assert float(trainer.callback_metrics["v/dataloader_idx_1"]) == 12.5
    with pytest.raises(ValueError, match=r"self.log\('plain', add_dataloader_idx=False\) was called from "
                                         r"dataloader 1 after dataloader 0 logged the same name"):
        make_trainer(tmp_path).validate(TwoLoaders(same_name_without_idx=True), [loader(0, 8), loader(10, 16)])


def test_one_loader_keeps_plain_names(tmp_path):
    results = make_trainer(tmp_path).validate(TwoLoaders(), loader(0, 8))
    assert results == [{"v": 3.5, "plain_0": 7.0, "end": 7.0}]


# -- torchmetrics ----------------------------------------------------------------------------------

class WithMetrics(Base):
    def __init__(self):
        super().__init__()
        import torchmetrics

        self.train_mean = torchmetrics.MeanMetric()
        self.val_metrics = torchmetrics.MetricCollection({"sum": torchmetrics.SumMetric(),
                                                          "max": torchmetrics.MaxMetric()}, prefix="val_")

    def training_step(self, batch, batch_idx):
        x = batch[0]
        self.train_mean(x)                                          # forward: this batch's mean
        self.log("m", self.train_mean, on_step=True, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_metrics.update(batch[0])
        self.log_dict(self.val_metrics)


def test_a_logged_metric_gives_its_forward_value_per_step_and_is_computed_and_reset_per_epoch(tmp_path):
    pytest.importorskip("torchmetrics")
    rec = Recorder()
    trainer = make_trainer(tmp_path, rec, max_epochs=2, log_every_n_steps=1)
    trainer.fit(WithMetrics(), loader(0, 10), loader(0, 6))
    assert rec.of("m_step")[:3] == [(1, 1.5), (2, 5.5), (3, 8.5)]
    assert rec.of("m_epoch") == [(3, 4.5), (6, 4.5)]                # reset between epochs: not a running mean
    assert rec.of("val_sum") == [(3, 15.0), (6, 15.0)] and rec.of("val_max") == [(3, 5.0), (6, 5.0)]


class LooseMetric(Base):
    def __init__(self, attribute=None):
        super().__init__()
        import torchmetrics

        self.metrics = [torchmetrics.SumMetric()]                   # a plain list: not a submodule
        self.attribute = attribute

    def validation_step(self, batch, batch_idx):
        self.metrics[0].update(batch[0])
        self.log("loose", self.metrics[0], metric_attribute=self.attribute)


def test_a_metric_that_is_not_an_attribute_needs_metric_attribute(tmp_path):
    pytest.importorskip("torchmetrics")
    with pytest.raises(ValueError, match=r"self.log\('loose'\) got a torchmetrics SumMetric that is not an "
                                         r"attribute of LooseMetric.*metric_attribute="):
        make_trainer(tmp_path).validate(LooseMetric(), loader(0, 4))
    assert make_trainer(tmp_path).validate(LooseMetric("loose_sum"), loader(0, 4)) == [{"loose": 6.0}]


# -- logging from callbacks and epoch-end hooks ----------------------------------------------------

class CallbackLogs(Callback):
    def on_train_epoch_end(self, trainer, module):
        module.log("from_cb_train", 3.0)

    def on_validation_epoch_end(self, trainer, module):
        module.log("from_cb_val", 4.0)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.log("from_cb_batch", float(batch_idx))


def test_callbacks_log_through_the_module_in_their_hooks(tmp_path):
    rec = Recorder()
    trainer = make_trainer(tmp_path, CallbackLogs(), rec, log_every_n_steps=1)
    trainer.fit(Base(), loader(0, 8), loader(0, 4))
    assert rec.of("from_cb_train") == [(2, 3.0)] and rec.of("from_cb_val") == [(2, 4.0)]
    assert rec.of("from_cb_batch") == [(1, 0.0), (2, 1.0)]
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == {
        "from_cb_train": 3.0, "from_cb_val": 4.0, "from_cb_batch": 1.0}


# -- two processes ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_sync_dist_rank_zero_only_and_dataloader_idx(launch, tmp_path):
    r0, r1 = launch("logging_rules", 2, "--root", tmp_path / "root")
    assert r0["world"] == r1["world"] == 2
    for r in (r0, r1):
        # training: the step value and the epoch value are the mean over ranks of 0 and 1
        assert r["fit"] == {"t": 0.5, "t_step": 0.5, "t_epoch": 0.5, "t_max": 1.0}
        assert [s for s, m in r["fit_logs"] if "t_step" in m] == [1, 2]
    # one loader of 0..8 in batches of 2: rank 0 has [0,1] [4,5] [8], rank 1 [2,3] [6,7]
    synced = {"x_mean": 4.0, "x_sum": 36.0, "x_max": 8.0, "end": 1.0}
    assert r0["single"] == [{**synced, "x_local": pytest.approx(18 / 5), "only0": 1.0}]
    assert r1["single"] == [{**synced, "x_local": 4.5}]                          # rank_zero_only: rank 0 only
    # per-step values are reduced on the steps both ranks run; rank 0's extra step keeps its own value
    assert [(s, m["s"]) for s, m in r0["single_logs"] if "s" in m] == [(0, 3.0), (1, 11.0), (2, 8.0)]
    assert [(s, m["s"]) for s, m in r1["single_logs"] if "s" in m] == [(0, 3.0), (1, 11.0)]
    # two loaders (the second is 10..14): suffixed keys, the epoch-end value in both results
    for r, local in ((r0, (18 / 5, 35 / 3)), (r1, (4.5, 12.5))):
        first, second = r["two"]
        assert {k: v for k, v in first.items() if "local" not in k and "only0" not in k} == {
            "x_mean/dataloader_idx_0": 4.0, "x_sum/dataloader_idx_0": 36.0, "x_max/dataloader_idx_0": 8.0,
            "end": 1.0}
        assert {k: v for k, v in second.items() if "local" not in k and "only0" not in k} == {
            "x_mean/dataloader_idx_1": 12.0, "x_sum/dataloader_idx_1": 60.0, "x_max/dataloader_idx_1": 14.0,
            "end": 1.0}
        assert first["x_local/dataloader_idx_0"] == pytest.approx(local[0])
        assert second["x_local/dataloader_idx_1"] == pytest.approx(local[1])
        assert [(s, m["s/dataloader_idx_1"]) for s, m in r["two_logs"] if "s/dataloader_idx_1" in m][0] == (0, 23.0)
    assert "only0/dataloader_idx_1" in r0["two"][1] and "only0/dataloader_idx_1" not in r1["two"][1]
