"""`fabric-lite launch`: the config file's defaults, then the flags (`cli/launch_flags.py`), the checks, then
torchrun (`launch/launcher.py`) or a runtime's own replica launcher."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence

from fabric_lite.cli.launch_flags import (
    launch_command_parser, refuse_replica_flags, replica_runtime, resolve_accelerate_flags,
)
from fabric_lite.launch.config_file import AccelerateConfig, LaunchConfigFile, find_config, load_config
from fabric_lite.launch.launch_checks import (
    LaunchError, check_capacity, check_launch, check_mixed_precision, check_script,
)
from fabric_lite.launch.launcher import run_torchrun
from fabric_lite.launch.lifeline import ENV_LAUNCHER_PID
from fabric_lite.launch.worker_env import settings_env
from fabric_lite.strategies.environments import ENV_STRATEGY, NodeLayout, detect_node_layout

__all__ = ["launch_command", "parse_with_config", "config_notice", "free_port_rendezvous", "own_attributes"]


def own_attributes(args: argparse.Namespace) -> List[str]:
    """The namespace attributes fabric_lite adds to torchrun's; removed before torchrun's run() sees them."""
    from torch.distributed.run import get_args_parser

    torchrun = set(vars(get_args_parser().parse_args(["x"])))
    return [name for name in vars(args) if name not in torchrun]


def _config_defaults(config: LaunchConfigFile, env: Mapping[str, str]) -> Dict[str, Any]:
    """Parser defaults from a config file; torchrun's PET_* variables, where set, still win (and so does a cluster
    engine's node layout: `_layout_defaults`)."""
    values: Dict[str, Any] = {
        "nproc_per_node": str(config.nproc_per_node), "nnodes": str(config.nnodes), "node_rank": config.node_rank,
        "master_addr": config.master_addr, "master_port": config.master_port,
    }
    if isinstance(config, AccelerateConfig):
        if config.num_processes is not None:  # Accelerate's total: divided by the final --nnodes
            values["num_processes"] = config.num_processes
        if config.rdzv_backend is not None:
            values["rdzv_backend"] = config.rdzv_backend
    values = {k: v for k, v in values.items()
              if f"PET_{k.upper()}" not in env and not (k == "num_processes" and "PET_NPROC_PER_NODE" in env)}
    values.update(mixed_precision=config.mixed_precision, cpu=config.use_cpu,
                  gradient_accumulation_steps=config.gradient_accumulation_steps, strategy=config.strategy)
    if isinstance(config, AccelerateConfig):
        values.update(tpu=config.tpu, main_training_function=config.main_training_function, gpu_ids=config.gpu_ids)
        for dimension, size in config.parallelism or ():  # (as if given with --parallelism_config_*_size)
            values[f"parallelism_config_{dimension}_size"] = size
    return values


def _layout_defaults(layout: Optional[NodeLayout], env: Mapping[str, str]) -> Dict[str, Any]:
    """Parser defaults from the nodes a cluster engine describes (SkyPilot's variables: `detect_node_layout`).

    Like torchrun's PET_* variables they describe the machines this launch runs on, so they win over a config
    file's values (which always name a layout, one machine on 127.0.0.1 unless edited) and lose to flags. A PET_*
    variable that is set still gives its own setting (torchrun's parser read it already)."""
    if layout is None:
        return {}
    values: Dict[str, Any] = {"nnodes": str(layout.nnodes), "node_rank": layout.node_rank,
                              "master_addr": layout.master_addr, "master_port": layout.master_port}
    if layout.nproc_per_node is not None:
        values["nproc_per_node"] = str(layout.nproc_per_node)
    return {k: v for k, v in values.items() if v is not None and f"PET_{k.upper()}" not in env}


def config_notice(command: str, config_path: Any, config: Optional[LaunchConfigFile]) -> str:
    """The one stderr line that says which config file a launch uses (and, for Accelerate's, what of it is
    ignored)."""
    if isinstance(config, AccelerateConfig):
        line = f"{command}: using Accelerate config file {config_path}"
        if config.ignored:
            line += f"; ignored, no meaning here: {', '.join(config.ignored)}"
        return line
    return f"{command}: using config file {config_path}"


def free_port_rendezvous(args: argparse.Namespace) -> None:
    """One machine and no port given: meet on a port the OS picks (c10d rendezvous at localhost:0).

    torch >= 2.13 does this itself; older torch would take port 29500, or fail on a port of None."""
    if args.master_port is None and args.rdzv_backend == "static" and not args.rdzv_endpoint \
            and not args.standalone and int(str(args.nnodes).split(":")[-1]) == 1:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:  # several machines: torch's usual port
        args.master_port = 29500


def _error(message: str) -> int:
    print(f"fabric-lite launch: error: {message}", file=sys.stderr)
    return 2


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str]) -> tuple:
    """(flags alone, flags over the defaults, the config's path or None, the config or None).
    Raises ConfigError for a config file that cannot be used, ValueError for a cluster engine's variables that
    cannot be right. The config is fabric_lite's (`--config-file`, else the default one), else Accelerate's
    default one (`config_file.find_config`).

    What wins, first to last: flags; the cluster's own variables (torchrun's PET_*, which a Kubeflow TrainJob sets,
    and SkyPilot's node layout: `_layout_defaults`); the config file; torchrun's defaults."""
    argv = list(argv)
    flags = parser.parse_args(argv)
    layout = _layout_defaults(detect_node_layout(env), env)
    config_path = find_config(flags.config_file, env)
    config = load_config(config_path) if config_path is not None else None
    defaults = _config_defaults(config, env) if config is not None else {}
    if "nproc_per_node" in layout:  # the node's own count, over an Accelerate config's total
        defaults.pop("num_processes", None)
    defaults.update(layout)
    if not defaults:
        return flags, flags, config_path, config
    parser.set_defaults(**defaults)
    return flags, parser.parse_args(argv), config_path, config  # again: flags on the command line win


def launch_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> int:
    """`fabric-lite launch`: config file defaults, then flags; checks; then torchrun (or the runtime's replicas)."""
    env = os.environ if env is None else env
    parser = launch_command_parser()
    try:
        _, args, config_path, config = parse_with_config(parser, argv, env)
    except ValueError as err:  # a config file (ConfigError) or a cluster engine's variables that cannot be used
        return _error(str(err))
    suffix = f" (defaults from config file {config_path})" if config_path is not None else ""
    replicas: Optional[int] = None
    try:
        worker_env, ignored = resolve_accelerate_flags(args, config)
        check_mixed_precision(args, config)
        runtime = replica_runtime(args)  # a runtime's own launcher, with checks of its own
        if runtime is not None:
            replicas = runtime.check_launch_args(args)
        else:
            refuse_replica_flags(args)
            check_launch(args)
            check_capacity(args.nproc_per_node, args.cpu, args.oversubscribe)
            free_port_rendezvous(args)
        settings = settings_env(args.mixed_precision, args.gradient_accumulation_steps, args.cpu)
        settings[ENV_LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (lifeline.py)
    except ValueError as err:
        return _error(f"{err}{suffix}")
    try:
        check_script(args)
    except LaunchError as err:
        return _error(str(err))
    if args.strategy is not None:
        settings[ENV_STRATEGY] = args.strategy
    settings.update(worker_env)
    if config_path is not None:
        print(config_notice("fabric-lite launch", config_path, config), file=sys.stderr)
    if ignored:
        print(f"fabric-lite launch: ignoring Accelerate flags that have no meaning here: {', '.join(ignored)}",
              file=sys.stderr)
    if runtime is not None:
        return runtime.launch_script(args.training_script, args.training_script_args, replicas, settings,
                                     args.main_training_function, spmd=runtime.one_process(args.strategy))
    debug = args.debug
    for name in own_attributes(args):
        delattr(args, name)
    return run_torchrun(args, settings, debug=debug)
