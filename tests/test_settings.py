"""resolve_run_config on plain values: no processes started, no environment read or changed (dicts are passed)."""

import dataclasses
import pathlib
from types import SimpleNamespace

import pytest

from fabric_lite.settings import HANDLER_ATTRIBUTES, RunConfig, handlers_by_attribute, resolve_run_config
from fabric_lite.strategies.environments import (
    ENV_ACCELERATOR, ENV_EXPLAIN, ENV_GRAD_ACCUM, ENV_LAUNCHED, ENV_MIXED_PRECISION, ENV_STRATEGY, ENV_USE_CPU,
    LaunchEnvironment, LaunchSettings, ProcessInfo, detect_process, read_launch_environment,
    read_launch_settings,
)
from fabric_lite.strategies.xla_env import XLASettings, read_xla_settings


def _env(**launch) -> LaunchEnvironment:
    return LaunchEnvironment(launch=LaunchSettings(**launch))


class _Plugin:
    """Stands in for DeepSpeedPlugin / FullyShardedDataParallelPlugin: resolve only calls to_strategy()."""

    def __init__(self, made="made", gradient_accumulation_steps=None):
        self.made, self.gradient_accumulation_steps = made, gradient_accumulation_steps

    def to_strategy(self):
        return self.made


# -- the launch environment, read in one call -----------------------------------------------------------------

def test_read_launch_environment_is_the_three_reads_of_one_mapping():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", ENV_MIXED_PRECISION: "bf16", "PJRT_DEVICE": "tpu"}
    read = read_launch_environment(env)
    assert read == LaunchEnvironment(detect_process(env), read_launch_settings(env), {"xla": read_xla_settings(env)})
    assert read.process.global_rank == 1 and read.launch.mixed_precision == "bf16" and \
        read.runtimes["xla"].pjrt_device == "TPU"
    assert read_launch_environment({}) == LaunchEnvironment()


# -- defaults and precedence -----------------------------------------------------------------------------------

def test_nothing_given_resolves_to_the_defaults_of_a_lone_process():
    config = resolve_run_config({})
    assert config == RunConfig(arguments=config.arguments, handlers=config.handlers)
    assert (config.strategy, config.accelerator, config.devices, config.precision) == ("auto", "auto", None, "no")
    assert config.gradient_accumulation_steps == 1 and config.gradient_accumulation_plugin is None
    assert config.process == ProcessInfo() and config.rng_types == ("generator",)
    assert not config.explain_requested and not config.notes_unread_config and config.scaler_kwargs is None
    assert dict(config.handlers) == dict.fromkeys(HANDLER_ATTRIBUTES)


def test_the_launch_environment_fills_what_the_arguments_leave_open():
    env = _env(mixed_precision="bf16", gradient_accumulation_steps=4, strategy="ddp", accelerator="cpu")
    config = resolve_run_config({}, launch_env=env)
    assert (config.precision, config.gradient_accumulation_steps, config.strategy, config.accelerator) == \
        ("bf16", 4, "ddp", "cpu")
    given = {"mixed_precision": "fp16", "gradient_accumulation_steps": 2, "strategy": "single", "accelerator": "gpu"}
    config = resolve_run_config(given, launch_env=env)
    assert (config.precision, config.gradient_accumulation_steps, config.strategy, config.accelerator) == \
        ("fp16", 2, "single", "gpu")


def test_cpu_from_the_argument_or_the_launch_wins_over_any_accelerator():
    assert resolve_run_config({"cpu": True, "accelerator": "gpu"}).accelerator == "cpu"
    assert resolve_run_config({"accelerator": "gpu"}, launch_env=_env(use_cpu=True)).accelerator == "cpu"


def test_accumulation_steps_below_one_from_the_launch_are_refused_naming_the_variable():
    with pytest.raises(ValueError, match=ENV_GRAD_ACCUM):
        resolve_run_config({}, launch_env=_env(gradient_accumulation_steps=0))


def test_the_config_file_counts_only_where_arguments_and_launch_say_nothing():
    values = {"mixed_precision": "fp16", "gradient_accumulation_steps": 3, "strategy": "ddp", "use_cpu": True}
    config = resolve_run_config({}, config_file=values)
    assert (config.precision, config.gradient_accumulation_steps, config.strategy, config.accelerator) == \
        ("fp16", 3, "ddp", "cpu")
    config = resolve_run_config({"gradient_accumulation_steps": 5}, launch_env=_env(mixed_precision="bf16"),
                                config_file=values)
    assert (config.precision, config.gradient_accumulation_steps) == ("bf16", 5)
    with pytest.raises(ValueError, match="num_processes"):
        resolve_run_config({}, config_file={"num_processes": 2})


# -- plugins -----------------------------------------------------------------------------------------------

def test_a_deepspeed_plugin_gives_the_strategy_and_the_accumulation_steps():
    config = resolve_run_config({}, {"deepspeed_plugin": _Plugin("ds", gradient_accumulation_steps=8)})
    assert (config.strategy, config.gradient_accumulation_steps) == ("ds", 8)
    config = resolve_run_config({"gradient_accumulation_steps": 2}, {"deepspeed_plugin": _Plugin("ds", 8)})
    assert config.gradient_accumulation_steps == 2  # the argument wins


@pytest.mark.parametrize("arguments, plugins, match", [
    ({"strategy": "ddp"}, {"deepspeed_plugin": _Plugin()}, "or deepspeed_plugin, not both"),
    ({"strategy": "ddp"}, {"fsdp_plugin": _Plugin()}, "not several"),
    ({}, {"fsdp_plugin": _Plugin(), "deepspeed_plugin": _Plugin()}, "not several"),
])
def test_two_sources_of_the_strategy_are_refused(arguments, plugins, match):
    with pytest.raises(ValueError, match=match):
        resolve_run_config(arguments, plugins)


def test_an_accumulation_plugin_is_kept_and_must_agree_with_the_steps_given():
    plugin = SimpleNamespace(num_steps=4)
    config = resolve_run_config({"gradient_accumulation_steps": 4}, {"gradient_accumulation_plugin": plugin},
                                launch_env=_env(gradient_accumulation_steps=9))
    assert config.gradient_accumulation_plugin is plugin and config.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="disagrees with gradient_accumulation_plugin.num_steps=4"):
        resolve_run_config({"gradient_accumulation_steps": 2}, {"gradient_accumulation_plugin": plugin})


# -- kwargs handlers -----------------------------------------------------------------------------------------

class _Scaler:
    accelerator_attribute = "scaler_handler"

    def to_kwargs(self):
        return {"init_scale": 8.0}


def test_handlers_are_kept_under_their_attribute_and_two_of_a_kind_refused():
    scaler = _Scaler()
    config = resolve_run_config({}, kwargs_handlers=[scaler])
    assert config.handlers["scaler_handler"] is scaler and config.kwargs_handlers == (scaler,)
    assert config.scaler_kwargs == {"init_scale": 8.0}
    with pytest.raises(ValueError, match="two _Scaler objects"):
        handlers_by_attribute([_Scaler(), _Scaler()])


# -- explain, XLA, the rest ----------------------------------------------------------------------------------

def test_under_a_planned_launch_devices_are_left_to_the_plan():
    planned = _env(explain='{"nproc_per_node": 4, "nnodes": 1}')
    config = resolve_run_config({"devices": 4}, launch_env=planned)
    assert config.devices is None and config.explain_requested and config.explain_dry_run
    assert config.arguments["devices"] == 4  # as given, for the plan
    assert resolve_run_config({"devices": 4}, launch_env=_env(explain="1")).devices == 4


@pytest.mark.parametrize("accelerator, pjrt, strategy, expected", [
    ("tpu", None, "auto", "xla"), ("auto", "TPU", "auto", "xla"), ("auto", "CPU", "auto", "auto"),
    ("cpu", "TPU", "auto", "auto"), ("auto", "TPU", "ddp", "ddp"),
])
def test_an_xla_device_picks_the_xla_strategy_only_for_auto(accelerator, pjrt, strategy, expected):
    env = LaunchEnvironment(runtimes={"xla": XLASettings(pjrt_device=pjrt)})
    assert resolve_run_config({"accelerator": accelerator, "strategy": strategy}, launch_env=env).strategy == expected


def test_rank_zero_of_another_launcher_notes_an_unread_config_file():
    torchrun = ProcessInfo(world_size=2, global_rank=0, local_world_size=2, source="torchrun")
    assert resolve_run_config({}, launch_env=LaunchEnvironment(process=torchrun)).notes_unread_config
    ours = LaunchEnvironment(process=torchrun, launch=LaunchSettings(launched_by_fabric_lite=True))
    assert not resolve_run_config({}, launch_env=ours).notes_unread_config
    rank1 = LaunchEnvironment(process=dataclasses.replace(torchrun, global_rank=1))
    assert not resolve_run_config({}, launch_env=rank1).notes_unread_config


def test_loader_and_project_arguments_are_passed_on_as_plain_values():
    config = resolve_run_config({"split_batches": True, "even_batches": None, "project_dir": pathlib.Path("runs"),
                                 "rng_types": "torch"})
    assert dict(config.dataloader_overrides) == {"split_batches": True}
    assert config.project_dir == "runs" and config.rng_types == ("torch",)


def test_the_run_config_is_frozen():
    config = resolve_run_config({"mixed_precision": "bf16"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.precision = "fp16"
    with pytest.raises(TypeError):
        config.arguments["mixed_precision"] = "fp16"


def test_resolving_reads_no_environment(monkeypatch):
    for name in (ENV_MIXED_PRECISION, ENV_GRAD_ACCUM, ENV_USE_CPU, ENV_STRATEGY, ENV_ACCELERATOR, ENV_LAUNCHED,
                 ENV_EXPLAIN):
        monkeypatch.setenv(name, "2" if name == ENV_GRAD_ACCUM else "1")
    assert resolve_run_config({}) == resolve_run_config({}, launch_env=LaunchEnvironment())


def test_the_trainer_resolves_its_settings_into_the_same_run_config():
    from fabric_lite.trainer.settings import resolve_trainer_run_config

    settings = SimpleNamespace(strategy="ddp", devices="auto", precision="bf16-mixed", accelerator="cpu",
                               accumulate_grad_batches=3)
    config = resolve_trainer_run_config(settings, _env(mixed_precision="fp16", strategy="fsdp"))
    assert (config.strategy, config.devices, config.precision, config.accelerator) == \
        ("ddp", None, "bf16-mixed", "cpu")
    assert (config.gradient_accumulation_steps, config.divide_loss_by) == (3, "window")
