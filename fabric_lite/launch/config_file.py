"""The launch config file that `fabric-lite config` writes and `fabric-lite launch` / `test` read.

A small YAML mapping; every key is optional and an absent key keeps its default::

    compute_environment: this_machine   # or multi_node
    nnodes: 1                           # machines taking part
    node_rank: 0                        # this machine's index, 0 .. nnodes-1
    master_addr: 127.0.0.1              # address of machine 0 (multi-node)
    master_port: null                   # port on machine 0; null: any free port (one machine)
    nproc_per_node: 2                   # processes on each machine (an integer, or auto/cpu/gpu)
    strategy: auto                      # auto | ddp | fsdp | deepspeed_stage_1/2/3[_offload]
    mixed_precision: 'no'               # no | fp16 | bf16
    gradient_accumulation_steps: 1
    use_cpu: false

The torchrun keys carry torchrun's own flag names, so a flag on the command line and the key it
overrides read the same. Nothing here reads ``os.environ``: `default_config_path` takes the
environment as a mapping, so tests pass a dict.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

from fabric_lite.strategies.registry import available_strategies

__all__ = [
    "ConfigError", "LaunchConfigFile", "default_config_path", "find_config", "load_config", "parse_config",
    "dump_config", "save_config", "validate", "questionnaire", "COMPUTE_ENVIRONMENTS", "STRATEGIES", "MIXED_PRECISIONS",
]

CONFIG_NAME = "default_config.yaml"
COMPUTE_ENVIRONMENTS = ("this_machine", "multi_node")
STRATEGIES = tuple(available_strategies())  # the names in strategies/registry.py: a strategy listed there can be launched
MIXED_PRECISIONS = ("no", "fp16", "bf16")
NPROC_WORDS = ("auto", "cpu", "gpu")
# Other spellings the launcher and the Accelerator accept, mapped to the config's three names.
_PRECISION_SPELLINGS = {"no": "no", "32": "no", "32-true": "no", "fp32": "no",
                        "fp16": "fp16", "16": "fp16", "16-mixed": "fp16",
                        "bf16": "bf16", "bf16-mixed": "bf16"}


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


def default_config_path(env: Mapping[str, str], home: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Where the config lives: $FABRIC_LITE_CONFIG_DIR, else $XDG_CONFIG_HOME/fabric_lite, else
    ~/.config/fabric_lite; the file is ``default_config.yaml`` in that directory.

    >>> default_config_path({"FABRIC_LITE_CONFIG_DIR": "/cfg"}).as_posix()
    '/cfg/default_config.yaml'
    >>> default_config_path({"XDG_CONFIG_HOME": "/x", "HOME": "/h"}).as_posix()
    '/x/fabric_lite/default_config.yaml'
    >>> default_config_path({"HOME": "/h"}).as_posix()
    '/h/.config/fabric_lite/default_config.yaml'
    """
    if env.get("FABRIC_LITE_CONFIG_DIR"):
        return Path(env["FABRIC_LITE_CONFIG_DIR"]).expanduser() / CONFIG_NAME
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]).expanduser() / "fabric_lite" / CONFIG_NAME
    base = env.get("HOME") or home or Path.home()
    return Path(base) / ".config" / "fabric_lite" / CONFIG_NAME


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value)
        else:
            raise ConfigError(f"{key}={value!r} is not a whole number; write an integer >= {minimum}.")
    if value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}.")
    return value


def _choice(key: str, value: Any, allowed: tuple) -> str:
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
        raise ConfigError(f"{prefix}unknown key {unknown[0]!r}; allowed keys: {', '.join(KEYS)}.")
    try:
        return _validated(dict(values))
    except ConfigError as err:
        raise ConfigError(f"{prefix}{err}") from None


def _validated(raw: Dict[str, Any]) -> LaunchConfigFile:
    out: Dict[str, Any] = {}
    if "compute_environment" in raw:
        out["compute_environment"] = _choice("compute_environment", raw["compute_environment"], COMPUTE_ENVIRONMENTS)
    if "nnodes" in raw:
        out["nnodes"] = _int("nnodes", raw["nnodes"], 1)
    if "node_rank" in raw:
        out["node_rank"] = _int("node_rank", raw["node_rank"], 0)
    if "master_addr" in raw:
        addr = raw["master_addr"]
        if not isinstance(addr, str) or not addr.strip():
            raise ConfigError(f"master_addr={addr!r} must be a host name or an IP address.")
        out["master_addr"] = addr.strip()
    if raw.get("master_port") is not None:
        port = _int("master_port", raw["master_port"], 1)
        if port > 65535:
            raise ConfigError(f"master_port={port} must lie in 1..65535.")
        out["master_port"] = port
    if "nproc_per_node" in raw:
        value = raw["nproc_per_node"]
        if isinstance(value, str) and value.strip().lower() in NPROC_WORDS:
            out["nproc_per_node"] = value.strip().lower()
        elif isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
            raise ConfigError(f"nproc_per_node={value!r} must be a whole number >= 1 "
                              f"(or one of: {', '.join(NPROC_WORDS)}).")
        else:
            out["nproc_per_node"] = _int("nproc_per_node", value, 1)
    if "strategy" in raw:
        out["strategy"] = _choice("strategy", raw["strategy"], STRATEGIES)
    if "mixed_precision" in raw:
        value = raw["mixed_precision"]
        if value is False or value is None:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        key = str(value).strip().lower()
        if key not in _PRECISION_SPELLINGS:
            raise ConfigError(f"mixed_precision={value!r} is not allowed; choose one of: {', '.join(MIXED_PRECISIONS)}.")
        out["mixed_precision"] = _PRECISION_SPELLINGS[key]
    if "gradient_accumulation_steps" in raw:
        out["gradient_accumulation_steps"] = _int("gradient_accumulation_steps", raw["gradient_accumulation_steps"], 1)
    if "use_cpu" in raw:
        value = raw["use_cpu"]
        if isinstance(value, str) and value.strip().lower() in ("yes", "true", "1", "no", "false", "0"):
            value = value.strip().lower() in ("yes", "true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"use_cpu={value!r} must be true or false.")
        out["use_cpu"] = value
    config = replace(LaunchConfigFile(), **out)
    check_consistent(config)
    return config


def check_consistent(config: LaunchConfigFile) -> None:
    """Refuse combinations no launch could run."""
    if config.node_rank >= config.nnodes:
        raise ConfigError(f"node_rank={config.node_rank} must be < nnodes={config.nnodes} "
                          f"(machines are numbered 0..{config.nnodes - 1}).")
    if config.compute_environment == "this_machine" and config.nnodes != 1:
        raise ConfigError(f"compute_environment=this_machine runs on one machine, but nnodes={config.nnodes}; "
                          f"set compute_environment: multi_node.")


def parse_config(text: str, source: str = "config") -> LaunchConfigFile:
    """Read YAML text into a config; malformed YAML or bad values raise a one-line ConfigError."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source} is not valid YAML{where}: {problem}.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping of keys to values (key: value lines), "
                          f"not a {type(data).__name__}.")
    return validate(data, source)


def load_config(path: Union[str, os.PathLike]) -> LaunchConfigFile:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; write one with `fabric-lite config`.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}.") from None
    return parse_config(text, str(path))


def find_config(explicit: Optional[Union[str, os.PathLike]], env: Mapping[str, str]) -> Optional[Path]:
    """The config file in force: the one named on the command line, else the default one if it exists."""
    if explicit is not None:
        return Path(explicit)
    path = default_config_path(env)
    return path if path.is_file() else None


def dump_config(config: LaunchConfigFile) -> str:
    import yaml

    # mixed_precision "no" would otherwise be read back as YAML false: the dumper quotes it.
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)


def save_config(config: LaunchConfigFile, path: Union[str, os.PathLike]) -> Path:
    """Write atomically (a half-written config would break every later launch)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_config(config), encoding="utf-8")
    os.replace(tmp, path)
    return path


# -- the questionnaire of `fabric-lite config` ---------------------------------------------------

def _parse_compute_environment(text: str) -> str:
    key = text.strip().lower().replace("-", "_").replace(" ", "_")
    aliases = {"0": "this_machine", "this": "this_machine", "local": "this_machine", "this_machine": "this_machine",
               "1": "multi_node", "multi": "multi_node", "multi_node": "multi_node", "multinode": "multi_node"}
    if key not in aliases:
        raise ConfigError(f"{text!r} is not one of the choices; answer 0 (this machine) or 1 (multi-node).")
    return aliases[key]


def _parse_yes_no(text: str) -> bool:
    key = text.strip().lower()
    if key in ("y", "yes", "true", "1"):
        return True
    if key in ("n", "no", "false", "0"):
        return False
    raise ConfigError(f"{text!r} is not yes or no.")


def questionnaire(ask: Callable[[str], str], say: Callable[[str], None],
                  defaults: LaunchConfigFile = LaunchConfigFile()) -> LaunchConfigFile:
    """Ask each question until its answer is valid (an empty answer takes the default in brackets).

    `ask` is `input` on a terminal; tests pass a scripted function. EOFError from `ask` propagates.
    """
    answers: Dict[str, Any] = {}

    def question(key: str, prompt: str, default: Any, parse: Callable[[str], Any]) -> Any:
        while True:
            text = ask(f"{prompt} [{default}]: ").strip()
            try:
                value = parse(text or str(default))
                _validated({**answers, key: value})  # the value alone, and with the answers so far
            except ConfigError as err:
                say(f"  {err} Please try again.")
                continue
            answers[key] = value
            return value

    env = question("compute_environment",
                   "In which compute environment are you running? (0: this machine, 1: multi-node)",
                   0 if defaults.compute_environment == "this_machine" else 1,
                   _parse_compute_environment)
    if env == "multi_node":
        question("nnodes", "How many machines will take part?", max(2, defaults.nnodes),
                 lambda t: _int("nnodes", t, 2))
        question("node_rank", f"What is the rank of this machine (0..{answers['nnodes'] - 1})?",
                 defaults.node_rank if defaults.node_rank < answers["nnodes"] else 0,
                 lambda t: _int("node_rank", t, 0))
        question("master_addr", "What is the IP address (or host name) of machine 0?", defaults.master_addr,
                 lambda t: t)
        question("master_port", "Which port on machine 0 should the processes meet at?",
                 defaults.master_port or 29500, lambda t: _int("master_port", t, 1))
        per = "on each machine"
    else:
        per = "on this machine"
    question("nproc_per_node", f"How many processes {per}?", defaults.nproc_per_node,
             lambda t: t if t.lower() in NPROC_WORDS else _int("nproc_per_node", t, 1))
    question("strategy", f"Which strategy? ({'/'.join(STRATEGIES)})", defaults.strategy,
             lambda t: _choice("strategy", t, STRATEGIES))
    question("mixed_precision", f"Mixed precision? ({'/'.join(MIXED_PRECISIONS)})", defaults.mixed_precision,
             lambda t: _choice("mixed_precision", t, MIXED_PRECISIONS))
    question("gradient_accumulation_steps", "How many gradient accumulation steps?",
             defaults.gradient_accumulation_steps, lambda t: _int("gradient_accumulation_steps", t, 1))
    question("use_cpu", "Train on CPU only, even where a GPU is present? (yes/no)",
             "yes" if defaults.use_cpu else "no", _parse_yes_no)
    return validate(answers)


def note_unread_config(launcher: str, env: Mapping[str, str]) -> None:
    """Say (on stderr) that a `fabric-lite config` file exists but `launcher`, not `fabric-lite launch`,
    started the processes, so its settings are not in force."""
    path = find_config(None, env)
    if path is not None:
        print(f"fabric_lite: {path} (from `fabric-lite config`) is not read: the processes were started by "
              f"{launcher}, not `fabric-lite launch`. Pass its settings as flags/arguments, or use "
              f"`fabric-lite launch`.", file=sys.stderr, flush=True)
