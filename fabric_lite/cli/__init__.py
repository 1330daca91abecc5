"""The `fabric-lite` command: launch, config, env, test, explain, consolidate; and `TrainerCLI`, the
config-file command line of a training script (imported on first use: it needs jsonargparse)."""

from __future__ import annotations

import importlib
from typing import Any

from fabric_lite.cli.main import main

_TRAINER_CLI = {
    "TrainerCLI": "fabric_lite.cli.trainer_cli",
    "LightningCLI": "fabric_lite.cli.trainer_cli",
    "SaveConfigCallback": "fabric_lite.cli.trainer_cli",
    "ReduceLROnPlateau": "fabric_lite.cli.trainer_cli",
    "instantiate_class": "fabric_lite.cli.trainer_cli",
    "OptimizerCallable": "fabric_lite.cli.trainer_cli",
    "LRSchedulerCallable": "fabric_lite.cli.trainer_cli",
    "ArgsType": "fabric_lite.cli.trainer_cli",
    "LRSchedulerTypeTuple": "fabric_lite.cli.trainer_cli",
    "LRSchedulerTypeUnion": "fabric_lite.cli.trainer_cli",
    "LRSchedulerType": "fabric_lite.cli.trainer_cli",
    "TrainerArgumentParser": "fabric_lite.cli.trainer_parser",
    "LightningArgumentParser": "fabric_lite.cli.trainer_parser",
}

__all__ = ["main", *_TRAINER_CLI]


def __getattr__(name: str) -> Any:
    module = _TRAINER_CLI.get(name)
    if module is None:
        raise AttributeError(f"module 'fabric_lite.cli' has no attribute {name!r}")
    if module.endswith("trainer_parser"):
        from fabric_lite.cli.trainer_cli import load_jsonargparse_parser

        load_jsonargparse_parser()  # (one sentence saying what to install, where jsonargparse is missing)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
