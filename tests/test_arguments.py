"""Every argument of both doors (`Trainer`, `Accelerator`) is checked at construction, before anything starts:
a wrong type is a TypeError, a wrong value a ValueError, and the message names the argument and the value."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from fabric_lite import Accelerator, Trainer
from fabric_lite.accelerator.configs import (
    DataLoaderConfiguration, DeepSpeedPlugin, GradientAccumulationPlugin, GradScalerKwargs, ProjectConfiguration,
)
from fabric_lite.callbacks.base import Callback


class _Marker(Callback):
    pass


_NOT_A_CALLBACK = object()

# (argument, value, exception); the message must contain "Trainer(argument=repr(value)".
TRAINER_BAD = [
    ("max_epochs", "3", TypeError), ("max_epochs", True, TypeError), ("max_epochs", 1.5, TypeError),
    ("max_epochs", -2, ValueError),
    ("max_steps", None, TypeError), ("max_steps", "10", TypeError), ("max_steps", -5, ValueError),
    ("max_time", 0, ValueError), ("max_time", -1.0, ValueError), ("max_time", float("nan"), ValueError),
    ("max_time", "00:01:00:00", TypeError), ("max_time", True, TypeError),
    ("accelerator", "tpu9", ValueError), ("accelerator", 1, TypeError), ("accelerator", None, TypeError),
    ("devices", 0, ValueError), ("devices", -1, ValueError), ("devices", "2", ValueError),
    ("devices", True, TypeError), ("devices", 1.0, TypeError), ("devices", [0], TypeError),
    ("num_nodes", 0, ValueError), ("num_nodes", "1", TypeError), ("num_nodes", True, TypeError),
    ("strategy", "no_such_strategy", ValueError), ("strategy", 3, TypeError), ("strategy", None, TypeError),
    ("precision", "fp8", ValueError), ("precision", 64, ValueError), ("precision", None, TypeError),
    ("precision", True, TypeError), ("precision", 16.0, TypeError),
    ("callbacks", [_NOT_A_CALLBACK], TypeError), ("callbacks", (_Marker(), 5), TypeError),
    ("callbacks", "ModelCheckpoint", TypeError), ("callbacks", 3, TypeError), ("callbacks", _Marker, TypeError),
    ("gradient_clip_val", -1.0, ValueError), ("gradient_clip_val", -1, ValueError),
    ("gradient_clip_val", float("nan"), ValueError), ("gradient_clip_val", "1.0", TypeError),
    ("gradient_clip_val", True, TypeError),
    ("gradient_clip_algorithm", "l2", ValueError), ("gradient_clip_algorithm", None, TypeError),
    ("accumulate_grad_batches", 0, ValueError), ("accumulate_grad_batches", -1, ValueError),
    ("accumulate_grad_batches", 2.0, TypeError), ("accumulate_grad_batches", True, TypeError),
    ("val_check_interval", 0, ValueError), ("val_check_interval", 0.0, ValueError),
    ("val_check_interval", -1, ValueError), ("val_check_interval", 1.5, ValueError),
    ("val_check_interval", "0.5", TypeError), ("val_check_interval", True, TypeError),
    ("val_check_interval", None, TypeError),
    ("check_val_every_n_epoch", 0, ValueError), ("check_val_every_n_epoch", -1, ValueError),
    ("check_val_every_n_epoch", None, TypeError), ("check_val_every_n_epoch", 1.0, TypeError),
    *[(name, value, exc) for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                                      "limit_predict_batches")
      for value, exc in ((-1, ValueError), (1.5, ValueError), (-0.1, ValueError), ("all", TypeError),
                         (True, TypeError))],
    ("fast_dev_run", -1, ValueError), ("fast_dev_run", "yes", TypeError), ("fast_dev_run", 0.5, TypeError),
    ("num_sanity_val_steps", -1, ValueError), ("num_sanity_val_steps", 1.0, TypeError),
    ("log_every_n_steps", 0, ValueError), ("log_every_n_steps", -1, ValueError),
    ("log_every_n_steps", 1.5, TypeError),
    ("default_root_dir", "", ValueError), ("default_root_dir", 5, TypeError), ("default_root_dir", b"runs", TypeError),
    ("enable_progress_bar", "no", TypeError), ("enable_progress_bar", 0, TypeError),
    ("min_epochs", -1, ValueError), ("min_epochs", "2", TypeError), ("min_steps", -1, ValueError),
    ("min_steps", 2.0, TypeError), ("overfit_batches", -1, ValueError), ("overfit_batches", 1.5, ValueError),
    ("overfit_batches", "all", TypeError), ("detect_anomaly", "yes", TypeError), ("detect_anomaly", None, TypeError),
    ("inference_mode", None, TypeError), ("reload_dataloaders_every_n_epochs", -1, ValueError),
    ("reload_dataloaders_every_n_epochs", True, TypeError), ("use_distributed_sampler", 1, TypeError),
    ("benchmark", "yes", TypeError), ("barebones", 1, TypeError),
    ("enable_checkpointing", 1, TypeError),
    ("deterministic", "yes", TypeError), ("deterministic", 1, TypeError),
    ("explain", "yes", TypeError), ("explain", None, TypeError),
]


def _id(case):
    return f"{case[0]}={case[1]!r}"[:60]


@pytest.mark.parametrize("name,value,exc", TRAINER_BAD, ids=[_id(c) for c in TRAINER_BAD])
def test_trainer_refuses_a_bad_argument_naming_it(name, value, exc):
    with pytest.raises(exc) as err:
        Trainer(**{name: value})
    assert type(err.value) is exc
    assert f"Trainer({name}={value!r})" in str(err.value)


def test_trainer_names_the_position_and_type_of_a_callback_that_is_not_one():
    with pytest.raises(TypeError, match=r"item 1 \(5\) has type int, not Callback"):
        Trainer(callbacks=[_Marker(), 5])
    with pytest.raises(TypeError, match=r"item 0 .* has type object, not Callback"):
        Trainer(callbacks=[object()])


# (argument, value, exception, what the message shows after "argument=")
ACCELERATOR_BAD = [
    ("device_placement", "yes", TypeError), ("device_placement", None, TypeError),
    ("split_batches", 1, TypeError), ("split_batches", "true", TypeError),
    ("mixed_precision", "fp8", ValueError), ("mixed_precision", "", ValueError), ("mixed_precision", True, TypeError),
    ("mixed_precision", 1.5, TypeError),
    ("gradient_accumulation_steps", 0, ValueError), ("gradient_accumulation_steps", -2, ValueError),
    ("gradient_accumulation_steps", 2.0, TypeError), ("gradient_accumulation_steps", "2", TypeError),
    ("gradient_accumulation_steps", True, TypeError),
    ("cpu", "yes", TypeError), ("cpu", None, TypeError), ("cpu", 1, TypeError),
    ("dataloader_config", {"split_batches": True}, TypeError),
    ("log_with", "wandb-ish", ValueError), ("log_with", 1, TypeError), ("log_with", ["tensorboard", 2], TypeError),
    ("log_with", ["tensorboard", "nope"], ValueError),
    ("project_dir", "", ValueError), ("project_dir", 3, TypeError),
    ("project_config", "runs", TypeError),
    ("gradient_accumulation_plugin", 3, TypeError),
    ("step_scheduler_with_optimizer", "yes", TypeError), ("step_scheduler_with_optimizer", None, TypeError),
    ("kwargs_handlers", [{"init_scale": 2}], TypeError), ("kwargs_handlers", GradScalerKwargs(), TypeError),
    ("kwargs_handlers", "GradScalerKwargs", TypeError),
    ("even_batches", "no", TypeError), ("even_batches", 0, TypeError),
    ("rng_types", 5, TypeError), ("rng_types", ["torch", 1], TypeError),
    ("dynamo_backend", "", ValueError), ("dynamo_backend", 5, TypeError),
    ("strategy", "horovod", ValueError), ("strategy", 42, TypeError), ("strategy", None, TypeError),
    ("devices", 0, ValueError), ("devices", -2, ValueError), ("devices", "two", ValueError),
    ("devices", True, TypeError), ("devices", 1.0, TypeError),
    ("accelerator", "tpu9", ValueError), ("accelerator", None, TypeError),
    ("deepspeed_plugin", "zero2", TypeError),
    ("fsdp_plugin", {}, TypeError),
    ("divide_loss_by", "steps", ValueError), ("divide_loss_by", None, TypeError),
]


@pytest.mark.parametrize("name,value,exc", ACCELERATOR_BAD, ids=[_id(c) for c in ACCELERATOR_BAD])
def test_accelerator_refuses_a_bad_argument_naming_it(name, value, exc):
    with pytest.raises(exc) as err:
        Accelerator(**{name: value})
    assert type(err.value) is exc
    assert f"Accelerator({name}={value!r})" in str(err.value)


@pytest.mark.parametrize("kwargs,shown", [
    ({"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=0)}, "num_steps=0"),
    ({"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=-1)}, "num_steps=-1"),
    ({"deepspeed_plugin": DeepSpeedPlugin(gradient_accumulation_steps=0)}, "gradient_accumulation_steps=0"),
    ({"deepspeed_plugin": DeepSpeedPlugin(gradient_accumulation_steps=-2)}, "gradient_accumulation_steps=-2"),
])
def test_accumulation_steps_from_a_plugin_are_checked_too(kwargs, shown):
    """gradient_accumulation_steps=0 no longer becomes 1 (an `or` did that), also when a plugin gives it."""
    (argument,) = kwargs
    with pytest.raises(ValueError) as err:
        Accelerator(cpu=True, **kwargs)
    message = str(err.value)
    assert f"Accelerator({argument}=" in message and shown in message


def test_the_cases_the_issue_names():
    for kwargs, exc in [({"gradient_clip_val": -1.0}, ValueError), ({"log_every_n_steps": 0}, ValueError),
                        ({"val_check_interval": 0}, ValueError), ({"check_val_every_n_epoch": 0}, ValueError),
                        ({"max_epochs": "3"}, TypeError), ({"callbacks": [object()]}, TypeError)]:
        with pytest.raises(exc, match=f"Trainer\\({next(iter(kwargs))}="):
            Trainer(**kwargs)
    for steps in (0, -2):
        with pytest.raises(ValueError, match=f"Accelerator\\(gradient_accumulation_steps={steps}\\)"):
            Accelerator(gradient_accumulation_steps=steps)
    assert "must be a number >= 0" in _message(Trainer, gradient_clip_val=-1.0)
    assert "0 or None turns clipping off" in _message(Trainer, gradient_clip_val=-1.0)


def _message(door, **kwargs):
    with pytest.raises((TypeError, ValueError)) as err:
        door(**kwargs)
    return str(err.value)


def test_a_negative_gradient_clip_val_never_gets_to_training(monkeypatch):
    """Refused before anything starts: no Accelerator (strategy, process group), no relaunch, no torch settings."""
    import fabric_lite.trainer.trainer as trainer_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the argument checks")

    monkeypatch.setattr(trainer_module, "Accelerator", must_not_run)
    monkeypatch.setattr(trainer_module, "relaunch_if_needed", must_not_run)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", must_not_run)
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=-1.0\)"):
        Trainer(gradient_clip_val=-1.0, deterministic=True, max_epochs=3)
    with pytest.raises(ValueError, match=r"Trainer\(log_every_n_steps=0\)"):
        Trainer(log_every_n_steps=0, deterministic=True, devices=2)


def test_the_accelerator_checks_before_it_connects(monkeypatch):
    import fabric_lite.accelerator.accelerator as accelerator_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the argument checks")

    monkeypatch.setattr(accelerator_module, "connect", must_not_run)
    monkeypatch.setattr(accelerator_module, "read_launch_environment", must_not_run)
    with pytest.raises(ValueError, match=r"Accelerator\(gradient_accumulation_steps=0\)"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match=r"Accelerator\(cpu='yes'\)"):
        Accelerator(cpu="yes", strategy="ddp")


def _trainer(**kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {},
    {"max_epochs": -1, "max_steps": 10}, {"max_epochs": None, "max_steps": -1}, {"max_epochs": 0},
    {"max_epochs": np.int64(3)}, {"max_time": 30}, {"max_time": 0.5}, {"max_time": None},
    {"limit_train_batches": 0.5, "limit_val_batches": 0, "limit_test_batches": 1.0, "limit_predict_batches": 3},
    {"limit_train_batches": 0.0}, {"val_check_interval": 5}, {"val_check_interval": 0.25}, {"val_check_interval": 1},
    {"fast_dev_run": True}, {"fast_dev_run": 3}, {"fast_dev_run": 0}, {"fast_dev_run": False},
    {"devices": 1, "accelerator": "CPU", "strategy": "single"}, {"devices": "auto", "strategy": "auto"},
    {"devices": None}, {"precision": 32}, {"precision": "32"}, {"precision": "bf16-mixed"},
    {"precision": "BF16-Mixed"}, {"precision": "no"}, {"precision": 16},
    {"gradient_clip_val": 1}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
    {"gradient_clip_val": float("inf")},
    {"check_val_every_n_epoch": 2, "log_every_n_steps": 1, "num_sanity_val_steps": 0, "num_nodes": 1},
    {"accumulate_grad_batches": 4}, {"deterministic": False}, {"deterministic": None}, {"explain": True},
    {"callbacks": None}, {"callbacks": []}, {"callbacks": ()},
])
def test_the_documented_trainer_values_still_construct(kwargs):
    _trainer(**kwargs)


def test_trainer_keeps_its_normalized_values(tmp_path):
    trainer = _trainer(max_epochs=np.int64(3), gradient_clip_val=0, default_root_dir=pathlib.Path(tmp_path))
    assert trainer.max_epochs == 3 and type(trainer.max_epochs) is int
    assert trainer.gradient_clip_val is None  # 0 turns clipping off (clipping to 0 would zero the gradients)
    assert trainer.default_root_dir == str(tmp_path)
    assert _trainer(gradient_clip_val=0.0).gradient_clip_val is None
    assert _trainer(gradient_clip_val=2).gradient_clip_val == 2


def test_callbacks_may_be_one_callback_a_tuple_or_an_iterable():
    one, two = _Marker(), _Marker()
    assert _trainer(callbacks=one).callbacks == [one]
    assert _trainer(callbacks=(one, two)).callbacks == [one, two]
    assert _trainer(callbacks=iter([one])).callbacks == [one]
    given = [one]
    trainer = _trainer(callbacks=given, enable_progress_bar=True)
    assert given == [one] and len(trainer.callbacks) == 2  # the caller's list is not changed


def test_deterministic_warn_asks_torch_for_deterministic_kernels_with_warnings():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        _trainer(deterministic="warn")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("kwargs", [
    {}, {"cpu": True}, {"mixed_precision": "no"}, {"mixed_precision": "bf16"}, {"mixed_precision": "BF16-Mixed"},
    {"mixed_precision": 16}, {"mixed_precision": None}, {"gradient_accumulation_steps": 1},
    {"gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": None},
    {"split_batches": True, "even_batches": False}, {"split_batches": None, "even_batches": None},
    {"device_placement": False, "step_scheduler_with_optimizer": False},
    {"log_with": "tensorboard"}, {"log_with": ["tensorboard"]}, {"log_with": "all"}, {"log_with": None},
    {"rng_types": ["torch", "generator"]}, {"rng_types": ("torch",)}, {"rng_types": "torch"},
    {"dynamo_backend": "no"}, {"dynamo_backend": None},
    {"devices": 1, "strategy": "single", "accelerator": "cpu"}, {"devices": "auto"}, {"accelerator": "AUTO"},
    {"kwargs_handlers": [GradScalerKwargs(init_scale=1024)]}, {"kwargs_handlers": ()},
    {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=3)},
    {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=3), "gradient_accumulation_steps": 3},
    {"dataloader_config": DataLoaderConfiguration(split_batches=True)},
    {"project_config": ProjectConfiguration(project_dir="runs")},
    {"divide_loss_by": "window"}, {"divide_loss_by": "gradient_accumulation_steps"},
])
def test_the_documented_accelerator_values_still_construct(kwargs):
    Accelerator(**kwargs)


def test_accelerator_paths_and_steps(tmp_path):
    acc = Accelerator(project_dir=pathlib.Path(tmp_path), log_with="tensorboard", gradient_accumulation_steps=3)
    assert acc.project_dir == str(tmp_path) and acc.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        acc.gradient_accumulation_steps = 0
    with pytest.raises(ValueError, match="gradient_accumulation_steps=True"):
        acc.gradient_accumulation_steps = True
