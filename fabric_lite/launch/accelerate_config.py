"""Accelerate's config file (what `accelerate config` writes: ``default_config.yaml``, or an older
``default_config.json``) mapped to the launch's settings: `AccelerateConfig`, read by `parse_accelerate_config`
where `is_accelerate_config` tells the file is Accelerate's; where it lives (`accelerate_config_path`); and the
DeepSpeed settings its sections and `accelerate launch`'s flags name (`deepspeed_strategy`, `read_deepspeed_json`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from fabric_lite.launch.config_values import CONFIG_NAME, KEYS, ConfigError, LaunchConfigFile, checked, whole_number

__all__ = ["AccelerateConfig", "accelerate_config_path", "is_accelerate_config", "parse_accelerate_config",
           "deepspeed_strategy", "read_deepspeed_json", "ACCELERATE_KEYS"]


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
    #: parallelism_config's sizes by dimension (dp_replicate, dp_shard, tp, cp), or None where the file has none.
    parallelism: Optional[Tuple[Tuple[str, int], ...]] = None

    def summary(self) -> str:
        """What the launch makes of the file, in one line (`fabric-lite env` prints it)."""
        return (f"{self.nproc_per_node} process(es) per machine on {self.nnodes} machine(s), strategy {self.strategy}, "
                f"mixed precision {self.mixed_precision}{', on CPU' if self.use_cpu else ''}"
                f"{', XLA' if self.tpu else ''}")


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
    "deepspeed_config", "fsdp_config", "main_training_function", "parallelism_config",
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
    found = data.get("zero_optimization")
    zero: Dict[str, Any] = found if isinstance(found, dict) else {}

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
    num_machines = whole_number("num_machines", raw["num_machines"], 1) if raw.get("num_machines") is not None else 1
    machine_rank = whole_number("machine_rank", raw["machine_rank"], 0) if raw.get("machine_rank") is not None else 0
    total = whole_number("num_processes", raw["num_processes"], 1) if raw.get("num_processes") is not None else None
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
                     ignored=tuple(ignored), fp8_backend=_fp8_backend(raw.get("fp8_config")),
                     parallelism=_parallelism(raw.get("parallelism_config")))
    return config


def _parallelism(section: Any) -> Optional[Tuple[Tuple[str, int], ...]]:
    """parallelism_config's `parallelism_config_<dimension>_size` keys (others in it are not read)."""
    if _off(section) or not isinstance(section, dict):
        return None
    found = []
    for dimension in ("dp_replicate", "dp_shard", "tp", "cp"):
        key = f"parallelism_config_{dimension}_size"
        if section.get(key) not in (None, ""):
            found.append((dimension, whole_number(f"parallelism_config.{key}", section[key], 1)))
    return tuple(found) or None


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
    base = checked(values, _FROM_ACCELERATE)
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
            stage = whole_number("deepspeed_config.zero_stage", stage, 0)

        def offloads(key: str) -> bool:
            return str(section.get(key) or "none").strip().lower() in ("cpu", "nvme")

        name, more = deepspeed_strategy(stage, offloads("offload_optimizer_device"), offloads("offload_param_device"),
                                        "deepspeed_config.zero_stage")
        notes += [f"deepspeed_config.{n}" for n in more]
        if section.get("gradient_accumulation_steps") not in (None, "", "auto"):
            steps = whole_number("deepspeed_config.gradient_accumulation_steps", section["gradient_accumulation_steps"], 1)
    notes += [f"deepspeed_config.{k}" for k, v in section.items() if k not in _DEEPSPEED_READ and not _off(v)]
    return name, notes, steps
