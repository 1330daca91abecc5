"""The settings a launch config file holds (`LaunchConfigFile`) and their checks (`validate`): every value
refused with a one-line `ConfigError` that names its key. Reading and writing the file is `config_file.py`;
Accelerate's format is `accelerate_config.py`."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Mapping, Optional, Union

from fabric_lite.strategies.registry import available_strategies

__all__ = ["ConfigError", "LaunchConfigFile", "validate", "checked", "check_consistent", "whole_number", "one_of",
           "KEYS", "CONFIG_NAME", "COMPUTE_ENVIRONMENTS", "STRATEGIES", "MIXED_PRECISIONS", "NPROC_WORDS"]

CONFIG_NAME = "default_config.yaml"  # (fabric_lite's file and Accelerate's have the same name)
COMPUTE_ENVIRONMENTS = ("this_machine", "multi_node")
STRATEGIES = tuple(available_strategies())  # the names in strategies/registry.py: a strategy listed there can be launched
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
NPROC_WORDS = ("auto", "cpu", "gpu")
# Other spellings the launcher and the Accelerator accept, mapped to the config's names.
_PRECISION_SPELLINGS = {"no": "no", "32": "no", "32-true": "no", "fp32": "no",
                        "fp16": "fp16", "16": "fp16", "16-mixed": "fp16",
                        "bf16": "bf16", "bf16-mixed": "bf16", "fp8": "fp8"}


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message is one line, ready for the user."""


@dataclass(frozen=True)
class LaunchConfigFile:
    """The settings a config file holds (defaults: one machine, one process, fp32)."""

    compute_environment: str = "this_machine"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    nproc_per_node: Union[int, str] = 1
    strategy: str = "auto"
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    use_cpu: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


KEYS = tuple(f.name for f in fields(LaunchConfigFile))
# Accelerate's names for some keys, suggested when one of them is found in a fabric_lite config.
_ACCELERATE_NAMES = {"num_processes": "nproc_per_node (processes on each machine)", "num_machines": "nnodes",
                     "machine_rank": "node_rank", "main_process_ip": "master_addr", "main_process_port": "master_port"}


def whole_number(key: str, value: Any, minimum: int) -> int:
    """`value` (an int, or its digits) as an int >= `minimum`; ConfigError naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value)
        else:
            raise ConfigError(f"{key}={value!r} is not a whole number; write an integer >= {minimum}.")
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}.")
    return value


def one_of(key: str, value: Any, allowed: tuple) -> str:
    """`value` lower-cased where it is one of `allowed`; ConfigError naming `key` otherwise."""
    text = str(value).strip().lower()
    if text not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}.")
    return text


def validate(values: Mapping[str, Any], source: Optional[str] = None) -> LaunchConfigFile:
    """Check every key and value of a raw mapping and return the config; ConfigError otherwise.
    `source` (a file name) starts each message."""
    prefix = f"{source}: " if source else ""
    unknown = [k for k in values if k not in KEYS]
    if unknown:
        key = str(unknown[0])
        near = _ACCELERATE_NAMES.get(key) or next(iter(difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)), None)
        hint = f" (did you mean {near}?)" if near else ""
        raise ConfigError(f"{prefix}unknown key {key!r}{hint}; allowed keys: {', '.join(KEYS)}.")
    try:
        return checked(dict(values))
    except ConfigError as err:
        raise ConfigError(f"{prefix}{err}") from None


def checked(raw: Dict[str, Any], written: Optional[Mapping[str, str]] = None) -> LaunchConfigFile:
    """`raw` (fabric_lite's keys) checked into a config. `written`: the key each value had in the user's file,
    where it was another one (an Accelerate file's main_process_port for master_port), for the messages."""
    def name(key: str) -> str:
        return (written or {}).get(key, key)

    out: Dict[str, Any] = {}
    if "compute_environment" in raw:
        out["compute_environment"] = one_of("compute_environment", raw["compute_environment"], COMPUTE_ENVIRONMENTS)
    if "nnodes" in raw:
        out["nnodes"] = whole_number(name("nnodes"), raw["nnodes"], 1)
    if "node_rank" in raw:
        out["node_rank"] = whole_number(name("node_rank"), raw["node_rank"], 0)
    if "master_addr" in raw:
        addr = raw["master_addr"]
        if not isinstance(addr, str) or not addr.strip():
            raise ConfigError(f"{name('master_addr')}={addr!r} must be a host name or an IP address.")
        out["master_addr"] = addr.strip()
    if raw.get("master_port") is not None:
        port = whole_number(name("master_port"), raw["master_port"], 1)
        if port > 65535:
            raise ConfigError(f"{name('master_port')}={port} must lie in 1..65535.")
        out["master_port"] = port
    if "nproc_per_node" in raw:
        value = raw["nproc_per_node"]
        if isinstance(value, str) and value.strip().lower() in NPROC_WORDS:
            out["nproc_per_node"] = value.strip().lower()
        elif isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
            raise ConfigError(f"nproc_per_node={value!r} must be a whole number >= 1 "
                              f"(or one of: {', '.join(NPROC_WORDS)}).")
        else:
            out["nproc_per_node"] = whole_number("nproc_per_node", value, 1)
    if "strategy" in raw:
        out["strategy"] = one_of("strategy", raw["strategy"], STRATEGIES)
    if "mixed_precision" in raw:
        value = raw["mixed_precision"]
        if value is False or value is None:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        key = str(value).strip().lower()
        if key not in _PRECISION_SPELLINGS:
            raise ConfigError(f"mixed_precision={value!r} is not allowed; choose one of: {', '.join(MIXED_PRECISIONS)}.")
        out["mixed_precision"] = _PRECISION_SPELLINGS[key]
    if "gradient_accumulation_steps" in raw:
        out["gradient_accumulation_steps"] = whole_number("gradient_accumulation_steps", raw["gradient_accumulation_steps"], 1)
    if "use_cpu" in raw:
        value = raw["use_cpu"]
        if isinstance(value, str) and value.strip().lower() in ("yes", "true", "1", "no", "false", "0"):
            value = value.strip().lower() in ("yes", "true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"use_cpu={value!r} must be true or false.")
        out["use_cpu"] = value
    config = replace(LaunchConfigFile(), **out)
    check_consistent(config, written)
    return config


def check_consistent(config: LaunchConfigFile, written: Optional[Mapping[str, str]] = None) -> None:
    """Refuse combinations no launch could run. `written`: as for `_validated`."""
    names = written or {}
    if config.node_rank >= config.nnodes:
        raise ConfigError(f"{names.get('node_rank', 'node_rank')}={config.node_rank} must be < "
                          f"{names.get('nnodes', 'nnodes')}={config.nnodes} "
                          f"(machines are numbered 0..{config.nnodes - 1}).")
    if config.compute_environment == "this_machine" and config.nnodes != 1:
        raise ConfigError(f"compute_environment=this_machine runs on one machine, but nnodes={config.nnodes}; "
                          f"set compute_environment: multi_node.")
