"""The launch config file that `fabric-lite config` writes and `fabric-lite launch` / `test` read.

A small YAML mapping; every key is optional and an absent key keeps its default::

    compute_environment: this_machine   # or multi_node
    nnodes: 1                           # machines taking part
    node_rank: 0                        # this machine's index, 0 .. nnodes-1
    master_addr: 127.0.0.1              # address of machine 0 (multi-node)
    master_port: null                   # port on machine 0; null: any free port (one machine)
    nproc_per_node: 2                   # processes on each machine (an integer, or auto/cpu/gpu)
    strategy: auto                      # auto | ddp | fsdp | deepspeed_stage_1/2/3[_offload]
    mixed_precision: 'no'               # no | fp16 | bf16 | fp8 (fp8: a GPU of compute capability 8.9+)
    gradient_accumulation_steps: 1
    use_cpu: false

The torchrun keys carry torchrun's own flag names, so a flag on the command line and the key it
overrides read the same. Nothing here reads ``os.environ``: `default_config_path` takes the
environment as a mapping, so tests pass a dict.

Hugging Face Accelerate's ``default_config.yaml`` (what `accelerate config` writes) is read too: a
file with Accelerate's keys (``distributed_type``, ``num_processes``, ...) becomes an
`AccelerateConfig` (see `parse_accelerate_config`), and where no fabric_lite config exists,
Accelerate's default file ($HF_HOME/accelerate/default_config.yaml) is the one in force. The settings and
their checks are `config_values.py`, Accelerate's format `accelerate_config.py`; their names are here too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

from fabric_lite.launch.accelerate_config import (
    AccelerateConfig, accelerate_config_path, deepspeed_strategy, is_accelerate_config,
    parse_accelerate_config, read_deepspeed_json,
)
from fabric_lite.launch.config_values import (
    COMPUTE_ENVIRONMENTS, CONFIG_NAME, KEYS, MIXED_PRECISIONS, NPROC_WORDS, STRATEGIES, ConfigError, LaunchConfigFile, checked,
    check_consistent, one_of, validate, whole_number,
)

__all__ = [
    "ConfigError", "LaunchConfigFile", "AccelerateConfig", "default_config_path", "accelerate_config_path",
    "find_config", "load_config", "parse_config", "parse_accelerate_config", "is_accelerate_config",
    "deepspeed_strategy", "read_deepspeed_json", "dump_config", "save_config", "validate", "questionnaire",
    "COMPUTE_ENVIRONMENTS", "STRATEGIES", "MIXED_PRECISIONS", "KEYS", "check_consistent", "note_unread_config",
]


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
    if is_accelerate_config(data):
        return parse_accelerate_config(data, source)
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


def find_config(explicit: Optional[Union[str, os.PathLike]], env: Mapping[str, str],
                accelerate: bool = True) -> Optional[Path]:
    """The config file in force: the one named on the command line, else fabric_lite's default one if it
    exists, else (with `accelerate`) Accelerate's default one if that exists."""
    if explicit is not None:
        return Path(explicit)
    path = default_config_path(env)
    if path.is_file():
        return path
    if accelerate:
        path = accelerate_config_path(env)
        if path.is_file():
            return path
    return None


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
                checked({**answers, key: value})  # the value alone, and with the answers so far
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
                 lambda t: whole_number("nnodes", t, 2))
        question("node_rank", f"What is the rank of this machine (0..{answers['nnodes'] - 1})?",
                 defaults.node_rank if defaults.node_rank < answers["nnodes"] else 0,
                 lambda t: whole_number("node_rank", t, 0))
        question("master_addr", "What is the IP address (or host name) of machine 0?", defaults.master_addr,
                 lambda t: t)
        question("master_port", "Which port on machine 0 should the processes meet at?",
                 defaults.master_port or 29500, lambda t: whole_number("master_port", t, 1))
        per = "on each machine"
    else:
        per = "on this machine"
    question("nproc_per_node", f"How many processes {per}?", defaults.nproc_per_node,
             lambda t: t if t.lower() in NPROC_WORDS else whole_number("nproc_per_node", t, 1))
    question("strategy", f"Which strategy? ({'/'.join(STRATEGIES)})", defaults.strategy,
             lambda t: one_of("strategy", t, STRATEGIES))
    question("mixed_precision", f"Mixed precision? ({'/'.join(MIXED_PRECISIONS)})", defaults.mixed_precision,
             lambda t: one_of("mixed_precision", t, MIXED_PRECISIONS))
    question("gradient_accumulation_steps", "How many gradient accumulation steps?",
             defaults.gradient_accumulation_steps, lambda t: whole_number("gradient_accumulation_steps", t, 1))
    question("use_cpu", "Train on CPU only, even where a GPU is present? (yes/no)",
             "yes" if defaults.use_cpu else "no", _parse_yes_no)
    return validate(answers)


def note_unread_config(launcher: str, env: Mapping[str, str]) -> None:
    """Say (on stderr) that a `fabric-lite config` file exists but `launcher`, not `fabric-lite launch`,
    started the processes, so its settings are not in force."""
    path = find_config(None, env, accelerate=False)
    if path is not None:
        print(f"fabric_lite: {path} (from `fabric-lite config`) is not read: the processes were started by "
              f"{launcher}, not `fabric-lite launch`. Pass its settings as flags/arguments, or use "
              f"`fabric-lite launch`.", file=sys.stderr, flush=True)
