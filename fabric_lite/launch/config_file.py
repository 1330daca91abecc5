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
Accelerate's default file ($HF_HOME/accelerate/default_config.yaml) is the one in force.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from fabric_lite.strategies.registry import available_strategies

__all__ = [
    "ConfigError", "LaunchConfigFile", "AccelerateConfig", "default_config_path", "accelerate_config_path",
    "find_config", "load_config", "parse_config", "parse_accelerate_config", "is_accelerate_config",
    "deepspeed_strategy", "read_deepspeed_json", "dump_config", "save_config", "validate", "questionnaire",
    "COMPUTE_ENVIRONMENTS", "STRATEGIES", "MIXED_PRECISIONS",
]

CONFIG_NAME = "default_config.yaml"
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


@dataclass(frozen=True)
class AccelerateConfig(LaunchConfigFile):
    """An Accelerate config file, as the launcher reads it: the fabric_lite settings it maps to, and
    what has no fabric_lite counterpart.

    `nproc_per_node` is `num_processes / num_machines` (Accelerate counts processes over every machine);
    `num_processes` keeps Accelerate's total, so a --num_machines flag still divides it."""

    num_processes: Optional[int] = None  # the total over every machine; XLA replicas where `tpu`
    tpu: bool = False  # distributed_type XLA / TPU: torch_xla's launcher
    main_training_function: Optional[str] = None  # only for `tpu`
    gpu_ids: Optional[str] = None
    rdzv_backend: Optional[str] = None
    ignored: Tuple[str, ...] = ()  # keys set to something this launcher does not do, for one notice line
    fp8_backend: Optional[str] = None  # fp8_config's backend (TE, MSAMP, AO), upper case; the launch passes none on


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


def accelerate_config_path(env: Mapping[str, str], home: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Where Accelerate keeps its default config: $HF_HOME/accelerate, else
    $XDG_CACHE_HOME/huggingface/accelerate, else ~/.cache/huggingface/accelerate; the file is
    ``default_config.yaml`` there (an older ``default_config.json`` where only that one exists).

    >>> accelerate_config_path({"HF_HOME": "/hf"}).as_posix()
    '/hf/accelerate/default_config.yaml'
    >>> accelerate_config_path({"XDG_CACHE_HOME": "/c", "HOME": "/h"}).as_posix()
    '/c/huggingface/accelerate/default_config.yaml'
    >>> accelerate_config_path({"HOME": "/h"}).as_posix()
    '/h/.cache/huggingface/accelerate/default_config.yaml'
    """
    if env.get("HF_HOME"):
        folder = Path(env["HF_HOME"]).expanduser() / "accelerate"
    else:
        cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else \
            Path(env.get("HOME") or home or Path.home()) / ".cache"
        folder = cache / "huggingface" / "accelerate"
    yaml_file, json_file = folder / CONFIG_NAME, folder / "default_config.json"
    return json_file if json_file.is_file() and not yaml_file.is_file() else yaml_file


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
        key = str(unknown[0])
        near = _ACCELERATE_NAMES.get(key) or next(iter(difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)), None)
        hint = f" (did you mean {near}?)" if near else ""
        raise ConfigError(f"{prefix}unknown key {key!r}{hint}; allowed keys: {', '.join(KEYS)}.")
    try:
        return _validated(dict(values))
    except ConfigError as err:
        raise ConfigError(f"{prefix}{err}") from None


def _validated(raw: Dict[str, Any], written: Optional[Mapping[str, str]] = None) -> LaunchConfigFile:
    """`raw` (fabric_lite's keys) checked into a config. `written`: the key each value had in the user's file,
    where it was another one (an Accelerate file's main_process_port for master_port), for the messages."""
    def name(key: str) -> str:
        return (written or {}).get(key, key)

    out: Dict[str, Any] = {}
    if "compute_environment" in raw:
        out["compute_environment"] = _choice("compute_environment", raw["compute_environment"], COMPUTE_ENVIRONMENTS)
    if "nnodes" in raw:
        out["nnodes"] = _int(name("nnodes"), raw["nnodes"], 1)
    if "node_rank" in raw:
        out["node_rank"] = _int(name("node_rank"), raw["node_rank"], 0)
    if "master_addr" in raw:
        addr = raw["master_addr"]
        if not isinstance(addr, str) or not addr.strip():
            raise ConfigError(f"{name('master_addr')}={addr!r} must be a host name or an IP address.")
        out["master_addr"] = addr.strip()
    if raw.get("master_port") is not None:
        port = _int(name("master_port"), raw["master_port"], 1)
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
    path = find_config(None, env, accelerate=False)
    if path is not None:
        print(f"fabric_lite: {path} (from `fabric-lite config`) is not read: the processes were started by "
              f"{launcher}, not `fabric-lite launch`. Pass its settings as flags/arguments, or use "
              f"`fabric-lite launch`.", file=sys.stderr, flush=True)


# -- Accelerate's config file ------------------------------------------------------------------------

# Accelerate's top-level keys (ClusterConfig and its parents), for telling its files from fabric_lite's.
ACCELERATE_KEYS = frozenset((
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "main_training_function", "enable_cpu_affinity", "gpu_ids", "downcast_bf16", "deepspeed_config", "fsdp_config",
    "megatron_lm_config", "fp8_config", "ipex_config", "mpirun_config", "parallelism_config", "dynamo_config",
    "dynamo_backend", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_env", "tpu_vm",
    "command_file", "commands", "ipex", "use_xpu", "num_cpu_threads_per_process",
))
_ACCELERATE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
# distributed_type values that start processes the way torchrun does here; the device part of the
# MULTI_<device> kinds fabric_lite lacks is reported as ignored.
_ACCELERATE_MULTI = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU",
                     "MULTI_SDAA", "MULTI_NEURON")
_ACCELERATE_TYPES = ("NO", *_ACCELERATE_MULTI, "DEEPSPEED", "FSDP", "XLA", "TPU", "MEGATRON_LM")
# Keys this launcher maps (the rest is reported when set to anything but an empty/off value).
_ACCELERATE_READ = frozenset((
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "num_processes", "num_machines",
    "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "same_network", "gpu_ids",
    "deepspeed_config", "fsdp_config", "main_training_function",
))
_DEEPSPEED_READ = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                   "deepspeed_config_file")
_OFF = ("", "no", "none", "false", "0", "null", "default")


def is_accelerate_config(data: Mapping[str, Any]) -> bool:
    """Whether a config's mapping is Accelerate's: it has `distributed_type`, or Accelerate's values of
    `compute_environment` (LOCAL_MACHINE, ...), or only Accelerate's keys with at least one fabric_lite lacks.
    A fabric_lite file with a misspelt key stays fabric_lite's (and is refused, naming the key)."""
    if "distributed_type" in data:
        return True
    environment = data.get("compute_environment")
    if isinstance(environment, str) and environment.strip().upper() in _ACCELERATE_ENVIRONMENTS:
        return True
    keys = set(data)
    return bool(keys) and keys <= ACCELERATE_KEYS and bool(keys - set(KEYS))


def _off(value: Any) -> bool:
    """An empty or switched-off value (Accelerate writes every key, most of them off)."""
    if value is None or value is False:
        return True
    if isinstance(value, (list, tuple, dict)):
        return all(_off(v) for v in (value.values() if isinstance(value, dict) else value))
    return isinstance(value, str) and value.strip().lower() in _OFF


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("yes", "true", "1", "no", "false", "0"):
        return value.strip().lower() in ("yes", "true", "1")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false.")
    return value


def deepspeed_strategy(stage: Optional[int], offload_optimizer: bool, offload_params: bool,
                       source: str = "zero_stage") -> Tuple[str, List[str]]:
    """The registered DeepSpeed strategy for an Accelerate-style stage / offload request, and what of the
    request it cannot honour (a note each). ConfigError for stage 0, which has no name here."""
    notes: List[str] = []
    if stage is None:
        stage = 2 if offload_optimizer or offload_params else None  # Accelerate's default stage is 2
    if stage is None:
        return "deepspeed", notes
    if stage == 0:
        raise ConfigError(f"{source}=0 (DeepSpeed without ZeRO) has no strategy here: use strategy ddp, or a "
                          f"ZeRO stage 1, 2 or 3.")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{source}={stage!r} is not a ZeRO stage; choose 1, 2 or 3.")
    if stage == 3 and (offload_optimizer or offload_params):
        return "deepspeed_stage_3_offload", notes
    if stage == 2 and offload_optimizer:
        name = "deepspeed_stage_2_offload"
    else:
        name = f"deepspeed_stage_{stage}"
        if offload_optimizer:
            notes.append(f"offload_optimizer_device (no offload at stage {stage})")
    if offload_params:
        notes.append("offload_param_device (parameters offload at stage 3 only)")
    return name, notes


def read_deepspeed_json(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """What the launcher takes from a DeepSpeed JSON config: zero stage, offload (bools) and
    gradient_accumulation_steps ("auto" and absent values are left out)."""
    import json

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"cannot read DeepSpeed config file {path}: {err}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config file {path} must hold a JSON object.")
    zero = data.get("zero_optimization") if isinstance(data.get("zero_optimization"), dict) else {}

    def device(key: str) -> bool:
        entry = zero.get(key)
        return isinstance(entry, dict) and str(entry.get("device", "none")).lower() in ("cpu", "nvme")

    out: Dict[str, Any] = {"offload_optimizer": device("offload_optimizer"), "offload_params": device("offload_param")}
    if isinstance(zero.get("stage"), int) and not isinstance(zero.get("stage"), bool):
        out["stage"] = zero["stage"]
    steps = data.get("gradient_accumulation_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):
        out["gradient_accumulation_steps"] = steps
    return out


def parse_accelerate_config(data: Mapping[str, Any], source: str = "config") -> AccelerateConfig:
    """Map an Accelerate config (the mapping of its YAML) to the launcher's settings.

    Read: distributed_type (MULTI_CPU: use_cpu; DEEPSPEED: strategy deepspeed[_stage_N[_offload]] from
    deepspeed_config, whose gradient_accumulation_steps is read too; FSDP: fsdp; XLA/TPU: torch_xla's
    launcher), num_processes (the total: nproc_per_node = num_processes / num_machines), num_machines,
    machine_rank, main_process_ip/port, mixed_precision, use_cpu, gpu_ids, rdzv_backend. Other keys set to
    anything but an empty or off value are listed in `ignored`; so is fp8_config, whose `backend` is kept as
    `fp8_backend` (the launch names it when fp8 cannot run). ConfigError (one line, naming `source`) for what no
    launch here can run: SageMaker, Megatron-LM, a total that does not divide."""
    try:
        return _accelerate(dict(data))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err} (read as an Accelerate config file)") from None


def _accelerate(raw: Dict[str, Any]) -> AccelerateConfig:
    ignored: List[str] = []
    values: Dict[str, Any] = {}
    environment = str(raw.get("compute_environment") or "LOCAL_MACHINE").strip().upper()
    if environment == "AMAZON_SAGEMAKER":
        raise ConfigError("compute_environment=AMAZON_SAGEMAKER: fabric-lite launch starts processes on this "
                          "machine; SageMaker jobs are not started from here.")
    if environment != "LOCAL_MACHINE":
        raise ConfigError(f"compute_environment={raw.get('compute_environment')!r} is not one of Accelerate's "
                          f"(LOCAL_MACHINE).")
    kind = str(raw.get("distributed_type") or "NO").strip().upper()
    if kind not in _ACCELERATE_TYPES:
        raise ConfigError(f"distributed_type={raw.get('distributed_type')!r} is not one this launcher knows; "
                          f"known: {', '.join(_ACCELERATE_TYPES)}.")
    if kind == "MEGATRON_LM":
        raise ConfigError("distributed_type=MEGATRON_LM: fabric_lite has no Megatron-LM; use FSDP or DEEPSPEED.")
    num_machines = _int("num_machines", raw["num_machines"], 1) if raw.get("num_machines") is not None else 1
    machine_rank = _int("machine_rank", raw["machine_rank"], 0) if raw.get("machine_rank") is not None else 0
    total = _int("num_processes", raw["num_processes"], 1) if raw.get("num_processes") is not None else None
    tpu = kind in ("XLA", "TPU")
    values.update(nnodes=num_machines, node_rank=machine_rank,
                  compute_environment="multi_node" if num_machines > 1 else "this_machine")
    if total is not None and not tpu:
        if total % num_machines:
            raise ConfigError(f"num_processes={total} is the total over num_machines={num_machines} machines and "
                              f"must divide evenly among them.")
        values["nproc_per_node"] = total // num_machines
    if raw.get("main_process_ip") not in (None, ""):
        values["master_addr"] = raw["main_process_ip"]
    if raw.get("main_process_port") not in (None, ""):
        values["master_port"] = raw["main_process_port"]
    if raw.get("mixed_precision") is not None:
        values["mixed_precision"] = raw["mixed_precision"]  # (fp8: the launch checks the machine's GPUs)
    use_cpu = _flag("use_cpu", raw.get("use_cpu"))
    if kind == "MULTI_CPU":
        use_cpu = True
    values["use_cpu"] = use_cpu
    if kind in _ACCELERATE_MULTI and kind not in ("MULTI_GPU", "MULTI_CPU"):
        ignored.append(f"distributed_type={kind} (run as processes on this machine's GPUs or CPUs)")
    if kind == "DEEPSPEED":
        values["strategy"], notes, steps = _accelerate_deepspeed(raw.get("deepspeed_config"))
        ignored += notes
        if steps is not None:
            values["gradient_accumulation_steps"] = steps
    elif not _off(raw.get("deepspeed_config")):
        ignored.append("deepspeed_config (distributed_type is not DEEPSPEED)")
    if kind == "FSDP":
        values["strategy"] = "fsdp"
    if not _off(raw.get("fsdp_config")):
        ignored.append(_named("fsdp_config", raw["fsdp_config"]))
    gpu_ids = raw.get("gpu_ids")
    gpu_ids = None if gpu_ids is None or str(gpu_ids).strip().lower() in ("", "all") else str(gpu_ids).strip()
    rdzv = raw.get("rdzv_backend")
    function = raw.get("main_training_function")
    if not tpu and function not in (None, "", "main"):
        ignored.append("main_training_function (for XLA launches only)")
    for key, value in raw.items():
        if key not in _ACCELERATE_READ and not _off(value):
            ignored.append(_named(str(key), value))
    config = replace(_as_accelerate(values), num_processes=total, tpu=tpu,
                     main_training_function=str(function) if tpu and function not in (None, "") else None,
                     gpu_ids=gpu_ids, rdzv_backend=str(rdzv).strip() if rdzv not in (None, "") else None,
                     ignored=tuple(ignored), fp8_backend=_fp8_backend(raw.get("fp8_config")))
    return config


def _fp8_backend(section: Any) -> Optional[str]:
    backend = section.get("backend") if isinstance(section, dict) else None
    return None if _off(backend) else str(backend).strip().upper().replace("-", "")


def _named(key: str, value: Any) -> str:
    """`key`, or `key (sub, keys)` naming the entries of a section that are set."""
    if isinstance(value, dict):
        return f"{key} ({', '.join(str(k) for k, v in value.items() if not _off(v))})"
    return key


# The Accelerate key each fabric_lite key is read from, to name in messages the key the user wrote.
_FROM_ACCELERATE = {"nnodes": "num_machines", "node_rank": "machine_rank", "master_addr": "main_process_ip",
                    "master_port": "main_process_port"}


def _as_accelerate(values: Dict[str, Any]) -> AccelerateConfig:
    """Check `values` as fabric_lite keys (the same checks as a fabric_lite file, naming Accelerate's keys) into an
    AccelerateConfig."""
    base = _validated(values, _FROM_ACCELERATE)
    return AccelerateConfig(**base.to_dict())


def _accelerate_deepspeed(section: Any) -> Tuple[str, List[str], Optional[int]]:
    """(strategy, ignored notes, gradient_accumulation_steps or None) from Accelerate's deepspeed_config."""
    section = section if isinstance(section, dict) else {}
    notes: List[str] = []
    steps: Optional[int] = None
    if section.get("deepspeed_config_file") not in (None, ""):
        found = read_deepspeed_json(section["deepspeed_config_file"])
        name, more = deepspeed_strategy(found.get("stage"), found["offload_optimizer"], found["offload_params"],
                                        "zero_optimization.stage")
        notes += [f"deepspeed_config_file: {n}" for n in more]
        notes.append("deepspeed_config_file (only its ZeRO stage, offload and gradient_accumulation_steps are read)")
        steps = found.get("gradient_accumulation_steps")
    else:
        stage = section.get("zero_stage")
        if stage is not None:
            stage = _int("deepspeed_config.zero_stage", stage, 0)

        def offloads(key: str) -> bool:
            return str(section.get(key) or "none").strip().lower() in ("cpu", "nvme")

        name, more = deepspeed_strategy(stage, offloads("offload_optimizer_device"), offloads("offload_param_device"),
                                        "deepspeed_config.zero_stage")
        notes += [f"deepspeed_config.{n}" for n in more]
        if section.get("gradient_accumulation_steps") not in (None, "", "auto"):
            steps = _int("deepspeed_config.gradient_accumulation_steps", section["gradient_accumulation_steps"], 1)
    notes += [f"deepspeed_config.{k}" for k, v in section.items() if k not in _DEEPSPEED_READ and not _off(v)]
    return name, notes, steps
