"""Turn what the user asked for (accelerator, devices, strategy, precision) into one configured Strategy.

Both front doors call `connect`; it is the only place that looks at the hardware and the launch
environment, and the place that refuses combinations that cannot work.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type, Union

import torch

from fabric_lite.strategies.environments import ProcessInfo
from fabric_lite.strategies.fp8 import FP8Recipe, default_fp8_recipe
from fabric_lite.strategies.precision import Precision, resolve_precision
from fabric_lite.strategies.registry import runtime_entry, runtime_for_accelerator, runtimes as registered_runtimes
from fabric_lite.strategies.runtime import PROCESS_PER_DEVICE, Runtime
from fabric_lite.strategies import Strategy, create_strategy, strategy_class

__all__ = ["connect", "resolve_accelerator", "check_devices", "default_strategy", "runtime_class", "ACCELERATORS",
           "RUNTIME_DEVICES"]

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu", "xla")
#: Device types whose own runtime places the processes (the registry's runtimes), each with the registry name
#: strategy="auto" becomes there.
RUNTIME_DEVICES: Dict[str, str] = {entry.name: entry.strategy for entry in registered_runtimes()}


def _runtime_device(name: str, runtimes: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The device type of the runtime that accelerator `name` (lower case) picks, without probing hardware: a name a
    runtime registered, or 'auto' where the launch environment's settings of a runtime (`runtimes`, as
    `LaunchEnvironment.runtimes`) request it; None: a device torch drives."""
    entry = runtime_for_accelerator(name, runtimes)
    return None if entry is None else entry.name


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_accelerator(accelerator: str, runtimes: Optional[Mapping[str, Any]] = None) -> str:
    """'auto' -> the best device type here (a device runtime's first, where the launch environment's `runtimes`
    request one, see `_runtime_device`); 'gpu' -> 'cuda' (or 'mps' on Apple silicon); a name a device runtime
    registered -> its device type."""
    name = str(accelerator).lower()
    if name not in ACCELERATORS:
        raise ValueError(
            f"Unknown accelerator {accelerator!r}. Allowed values: {', '.join(map(repr, ACCELERATORS))}."
        )
    runtime_device = _runtime_device(name, runtimes)
    if runtime_device is not None:
        return runtime_device
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else ("mps" if _mps_available() else "cpu")
    if name == "gpu":
        name = "cuda" if torch.cuda.is_available() or not _mps_available() else "mps"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator={accelerator!r} was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Use accelerator='cpu', "
            f"or install a CUDA build of torch on a machine with an NVIDIA GPU."
        )
    if name == "mps" and not _mps_available():
        raise ValueError(f"accelerator={accelerator!r} was asked for, but MPS is not available. Use 'cpu'.")
    return name


def default_strategy(strategy: Any, accelerator: str, runtimes: Optional[Mapping[str, Any]] = None) -> Any:
    """`strategy` as given, except "auto" on a device whose own runtime places the processes: that runtime's
    strategy (checks `accelerator` as `resolve_accelerator` does)."""
    if isinstance(strategy, str) and strategy.lower() == "auto":
        return RUNTIME_DEVICES.get(resolve_accelerator(accelerator, runtimes), strategy)
    return strategy


def runtime_class(accelerator: str, strategy: Any, runtimes: Optional[Mapping[str, Any]] = None) -> Type[Runtime]:
    """The runtime class a run with these arguments gets, known before anything starts and without probing
    hardware (the Trainer re-launches by it): the strategy's, or, where the accelerator names a device with
    a runtime of its own (`runtimes`: the launch environment's, for 'auto'), that device's strategy's."""
    if isinstance(strategy, Strategy):
        cls: Any = type(strategy)
    else:
        cls = None if str(strategy).lower() == "auto" else strategy_class(str(strategy))
    runtime: Type[Runtime] = Runtime if cls is None else cls.runtime
    device = _runtime_device(str(accelerator).lower(), runtimes)
    if runtime.device_type is None and runtime.kind == PROCESS_PER_DEVICE and device is not None:
        runtime = strategy_class(RUNTIME_DEVICES[device]).runtime
    return runtime


def check_devices(devices: Union[int, str, None], device_type: str, process: ProcessInfo) -> None:
    if devices is None or devices == "auto":
        return
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} is not valid: pass a positive integer or 'auto'.")
    if device_type == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(
            f"devices={devices} was asked for, but only {torch.cuda.device_count()} CUDA device(s) are "
            f"visible. Pass devices<={torch.cuda.device_count()} or check CUDA_VISIBLE_DEVICES."
        )
    if device_type == "mps" and devices > 1:
        raise ValueError(f"devices={devices} was asked for, but MPS offers one device. Pass devices=1.")
    if process.is_distributed and devices != process.local_world_size:
        raise ValueError(
            f"devices={devices} disagrees with the launcher, which started {process.local_world_size} "
            f"process(es) on this node ({process.source}). Drop `devices` or make them match."
        )
    if not process.is_distributed and devices > 1:
        raise ValueError(
            f"devices={devices} needs {devices} processes, but this is a lone process. Start it with "
            f"`fabric-lite launch --nproc-per-node {devices} train.py` (or torchrun), or use "
            f"notebook_launcher(fn, num_processes={devices})."
        )


def connect(
    strategy: Union[str, Strategy] = "auto",
    accelerator: str = "auto",
    devices: Union[int, str, None] = None,
    precision: Optional[str] = None,
    process: Optional[ProcessInfo] = None,
    scaler_kwargs: Optional[dict] = None,
    autocast_kwargs: Optional[Dict[str, Any]] = None,
    fp8_recipe: Any = None,
    runtimes: Optional[Mapping[str, Any]] = None,
) -> Strategy:
    """Return a configured (not yet started) strategy for this process.

    `autocast_kwargs`: torch.autocast's `enabled` / `cache_enabled` for every autocast of the run (Accelerate's
    AutocastKwargs). `fp8_recipe`: how precision "fp8" trains (an `FP8Recipe`; None: torchao's default).
    `runtimes`: the device runtimes' launch settings (`LaunchEnvironment.runtimes`, the RunConfig's), which say
    what accelerator="auto" picks and how a runtime starts; None: nothing set."""
    runtimes = runtimes if runtimes is not None else {}
    process = process if process is not None else ProcessInfo()
    precision_name = resolve_precision(precision)

    def make_precision(device_type: str, device: Optional[torch.device] = None) -> Precision:
        recipe = fp8_recipe
        if precision_name == "fp8":
            recipe = recipe if recipe is not None else default_fp8_recipe()
            _check_fp8_strategy(instance, recipe)
        return Precision(precision_name, device_type, scaler_kwargs, autocast_kwargs=autocast_kwargs,
                         fp8_recipe=recipe, device=device)

    device_type = resolve_accelerator(accelerator, runtimes)
    if isinstance(strategy, Strategy):
        instance = strategy
    elif isinstance(strategy, str):
        if strategy.lower() == "auto":
            strategy = RUNTIME_DEVICES.get(device_type, strategy)
        instance = create_strategy(strategy, process.world_size)
    else:
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}.")
    runtime = instance.runtime
    needs = runtime.device_type
    if needs is not None and accelerator == "auto":
        device_type = needs  # a runtime's strategy alone says where it trains
    if needs is not None and device_type != needs:
        entry = runtime_entry(needs)
        raise ValueError(
            f"strategy {type(instance).__name__} trains on {entry.label}, but accelerator={accelerator!r} was "
            f"asked for. Pass accelerator={entry.accelerators[0]!r} (or leave it 'auto'), or pick a strategy for "
            f"{device_type!r}.")
    if needs is None and device_type in RUNTIME_DEVICES:
        entry = runtime_entry(device_type)
        said = runtimes.get(device_type)
        why = f"{getattr(said, 'reason', 'the launch environment')} made accelerator='auto'" \
            if accelerator == "auto" else f"accelerator={accelerator!r} was asked for"
        raise ValueError(
            f"strategy {type(instance).__name__} does not train on {entry.label}, but {why}. Use {entry.advice}, "
            f"or leave strategy 'auto'.")
    if needs is not None:  # the runtime owns the world: it says where this replica is
        process, root = runtime.start(process, devices, runtimes.get(needs))
        runtime.check_precision(precision_name)
        configure_strategy(instance, process, root, make_precision(device_type))
        return instance
    check_devices(devices, device_type, process)
    if device_type == "cuda" and process.device is not None and process.device.startswith("cuda"):
        root = torch.device(process.device)  # the engine (Ray Train) picked it: used as it is
    elif device_type == "cuda":
        root = torch.device("cuda", process.local_rank % max(1, torch.cuda.device_count()))
    else:
        root = torch.device(device_type)
    configure_strategy(instance, process, root, make_precision(device_type, root))
    return instance


def configure_strategy(strategy: Strategy, process: ProcessInfo, root_device: torch.device,
                       precision: Precision) -> None:
    """Bind a strategy to its process, its device and the precision it trains with (once, here)."""
    strategy.process = process
    strategy.root_device = root_device
    strategy.precision = strategy.adapt_precision(precision)


def _check_fp8_strategy(instance: Strategy, recipe: FP8Recipe) -> None:
    """Refuse the strategies fp8 cannot train with here (the engine or the sharding would not see the fp8 layers)."""
    kind = instance.traits.accelerate_type
    if kind == "DEEPSPEED":
        raise ValueError(
            "mixed_precision='fp8' with DeepSpeed is not supported here: DeepSpeed's engine keeps its own bf16/fp16 "
            "copies of the weights, which the fp8 layers would not see. Use strategy='fsdp' (sharded, with torchao "
            "fp8) or 'ddp', or train DeepSpeed in mixed_precision='bf16'.")
    if kind == "FSDP" and recipe.backend != "ao":
        raise ValueError(
            "mixed_precision='fp8' with FSDP trains with torchao here (AORecipeKwargs); TransformerEngine's layers "
            "(TERecipeKwargs) are not sharded by it. Use AORecipeKwargs, or strategy='ddp' with TransformerEngine.")
