"""Starting several processes: `fabric-lite launch` (over torch.distributed.run) and `notebook_launcher`.

Both use PyTorch's own elastic machinery; settings for the Accelerator travel as environment
variables that `environments.read_launch_settings` reads in each worker. `fabric-lite launch` takes
its defaults from the config file `fabric-lite config` wrote (see `config_file`); flags win.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import socket
import sys
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from fabric_lite.strategies.registry import runs_one_process
from fabric_lite.launch.config_file import STRATEGIES, ConfigError, LaunchConfigFile, find_config, load_config
from fabric_lite.strategies.environments import (
    ENV_GRAD_ACCUM, ENV_LAUNCHED, ENV_MIXED_PRECISION, ENV_STRATEGY, ENV_USE_CPU, read_xla_settings,
)
from fabric_lite.launch.lifeline import ENV_LAUNCHER_PID
from fabric_lite.strategies.precision import resolve_precision

__all__ = ["notebook_launcher", "launch_command_parser", "launch_command", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(mixed_precision: Optional[str], gradient_accumulation_steps: Optional[int],
                  cpu: bool) -> Dict[str, str]:
    env: Dict[str, str] = {ENV_LAUNCHED: "1"}
    if mixed_precision is not None:
        env[ENV_MIXED_PRECISION] = resolve_precision(mixed_precision)
    if gradient_accumulation_steps is not None:
        if gradient_accumulation_steps < 1:
            raise ValueError(f"--gradient-accumulation-steps={gradient_accumulation_steps} must be >= 1.")
        env[ENV_GRAD_ACCUM] = str(gradient_accumulation_steps)
    if cpu:
        env[ENV_USE_CPU] = "1"
    return env


@contextlib.contextmanager
def patched_environ(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (str) or remove (None) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_command_parser() -> argparse.ArgumentParser:
    """torchrun's own parser plus fabric_lite's settings, so every torchrun flag works unchanged."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    # No port given: None (then _free_port_rendezvous), as torch >= 2.13 does; older torch says 29500.
    # torchrun's PET_MASTER_PORT still gives the default.
    parser.set_defaults(master_port=os.environ.get("PET_MASTER_PORT"))
    parser.prog = "fabric-lite launch"
    parser.description = (
        "Start a training script on one or many processes (a front over torch.distributed.run; all of its "
        "flags work). Example: fabric-lite launch --nproc-per-node 2 train.py --epochs 3. Defaults come from "
        "the config file that `fabric-lite config` writes; flags given here win over it."
    )
    group = parser.add_argument_group("fabric_lite settings (read by Accelerator() in each worker)")
    group.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                       help="YAML file of defaults (default: the one `fabric-lite config` wrote, if any).")
    group.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=False,
                       help="Train on CPU even where a GPU is present (--no-cpu overrides a config's use_cpu).")
    group.add_argument("--mixed-precision", "--mixed_precision", default=None,
                       help="no | fp16 | bf16 (or 32-true, 16-mixed, bf16-mixed, bf16-true).")
    group.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=int, default=None)
    group.add_argument("--oversubscribe", action="store_true", default=False,
                       help="Start more processes per node than the machine has GPUs (or CPU cores, on CPUs).")
    group.add_argument("--strategy", default=None, choices=STRATEGIES,
                       help="What Accelerator(strategy='auto') / Trainer(strategy='auto') become in the workers.")
    xla = parser.add_argument_group("XLA / TPU (torch_xla's launcher instead of torchrun)")
    xla.add_argument("--tpu", action="store_true", default=False,
                     help="Start XLA replicas with torch_xla's launcher (implied by --strategy xla / xla_spmd). "
                          "With PJRT_DEVICE=CPU, --nproc-per-node (or --num-processes) sets how many.")
    xla.add_argument("--num-processes", "--num_processes", type=int, default=None,
                     help="XLA replicas to start (default: every device the runtime has).")
    xla.add_argument("--main-training-function", "--main_training_function", default=None, metavar="NAME",
                     help="Call this function of the script in each replica instead of running it as __main__.")
    return parser


class LaunchError(ValueError):
    """A launch that cannot work, found before starting anything; the message is one line."""


def _config_defaults(config: LaunchConfigFile, env: Mapping[str, str]) -> Dict[str, Any]:
    """Parser defaults from a config file; torchrun's PET_* variables, where set, still win."""
    values: Dict[str, Any] = {
        "nproc_per_node": str(config.nproc_per_node), "nnodes": str(config.nnodes), "node_rank": config.node_rank,
        "master_addr": config.master_addr, "master_port": config.master_port,
    }
    values = {k: v for k, v in values.items() if f"PET_{k.upper()}" not in env}
    values.update(mixed_precision=config.mixed_precision, cpu=config.use_cpu,
                  gradient_accumulation_steps=config.gradient_accumulation_steps, strategy=config.strategy)
    return values


def check_launch(args: argparse.Namespace) -> None:
    """Refuse what torchrun would only report with a traceback (or a hang)."""
    nproc = str(args.nproc_per_node).strip()
    if nproc.lstrip("+-").isdigit():
        if int(nproc) < 1:
            raise LaunchError(f"--nproc-per-node={nproc} must be a whole number >= 1.")
    elif nproc not in ("auto", "cpu", "gpu", "xpu"):
        raise LaunchError(f"--nproc-per-node={nproc!r} must be a whole number >= 1 or one of auto, cpu, gpu, xpu.")
    parts = str(args.nnodes).split(":")
    if len(parts) > 2 or not all(p.strip().lstrip("+-").isdigit() for p in parts):
        raise LaunchError(f"--nnodes={args.nnodes!r} must be a number of machines (2) or a range MIN:MAX (1:4).")
    min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    if not 0 < min_nodes <= max_nodes:
        raise LaunchError(f"--nnodes={args.nnodes!r} must be >= 1 (and MIN <= MAX for a range).")
    static = args.rdzv_backend == "static" and not args.standalone
    if args.node_rank < 0 or (static and args.node_rank >= max_nodes):
        raise LaunchError(f"--node-rank={args.node_rank} must lie in 0..{max_nodes - 1}: machines are numbered "
                          f"from 0 and --nnodes={args.nnodes}.")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise LaunchError(f"--master-port={args.master_port} must lie in 1..65535.")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts} must be >= 0.")
    several = (nproc.isdigit() and int(nproc) > 1) or max_nodes > 1
    strategy = getattr(args, "strategy", None)
    if strategy and several and runs_one_process(strategy):
        raise LaunchError(f"--strategy {strategy} trains in one process, but this launch starts "
                          f"{nproc} per node on {args.nnodes} node(s). Use --strategy ddp (or leave it out), or "
                          f"--nproc-per-node 1.")
    # On the machine that hosts the rendezvous store (static rendezvous, node 0) a port in use would
    # surface as a traceback from deep inside c10d, or a hang: look before starting.
    if static and not args.rdzv_endpoint and args.master_port is not None and args.node_rank == 0:
        if _port_taken(args.master_addr, args.master_port):
            raise LaunchError(f"--master-port={args.master_port} is already in use on {args.master_addr}; pick a "
                              f"free port, or leave --master-port out on a single machine (a free one is chosen).")


def _free_port_rendezvous(args: argparse.Namespace) -> None:
    """One machine and no port given: meet on a port the OS picks (c10d rendezvous at localhost:0).

    torch >= 2.13 does this itself; older torch would take port 29500, or fail on a port of None."""
    if args.master_port is None and args.rdzv_backend == "static" and not args.rdzv_endpoint \
            and not args.standalone and int(str(args.nnodes).split(":")[-1]) == 1:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:  # several machines: torch's usual port
        args.master_port = 29500


def _port_taken(addr: str, port: int) -> bool:
    """Whether a socket on this machine holds `port` at `addr` or on every interface (the store
    listens on all). An address of another machine (or one that does not resolve) is not checked."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    local = False
    for family, _, _, _, sockaddr in infos:
        taken = _bind_fails(family, sockaddr)
        if taken is None:
            continue  # not an address of this machine
        if taken:
            return True
        local = True
    return local and bool(_bind_fails(socket.AF_INET, ("", port)))


def _bind_fails(family: int, sockaddr: Any) -> Optional[bool]:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            s.bind(sockaddr)
        except OSError as err:
            return True if err.errno == errno.EADDRINUSE else None
    return False


def _error(message: str) -> int:
    print(f"fabric-lite launch: error: {message}", file=sys.stderr)
    return 2


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str]) -> tuple:
    """(flags alone, flags over the config file's values, the config's path or None, the config or None).
    Raises ConfigError for a config file that cannot be used."""
    argv = list(argv)
    flags = parser.parse_args(argv)
    config_path = find_config(flags.config_file, env)
    if config_path is None:
        return flags, flags, None, None
    config = load_config(config_path)
    parser.set_defaults(**_config_defaults(config, env))
    return flags, parser.parse_args(argv), config_path, config  # again: flags on the command line win


def launch_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> int:
    """`fabric-lite launch`: config file defaults, then flags; checks; then torchrun."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from fabric_lite.launch.preemption import EXIT_PREEMPTED

    env = os.environ if env is None else env
    parser = launch_command_parser()
    try:
        _, args, config_path, config = parse_with_config(parser, argv, env)
    except ConfigError as err:
        return _error(str(err))
    suffix = f" (defaults from config file {config_path})" if config_path is not None else ""
    xla = args.tpu or args.strategy in ("xla", "xla_spmd")  # torch_xla's launcher, with checks of its own
    try:
        if xla:
            check_xla_launch(args)
        else:
            for flag, value in (("--num-processes", args.num_processes),
                                ("--main-training-function", args.main_training_function)):
                if value is not None:
                    raise LaunchError(f"{flag} applies to XLA launches (--tpu); for torchrun's processes use "
                                      f"--nproc-per-node (and --nnodes).")
            check_launch(args)
            check_capacity(args.nproc_per_node, args.cpu, args.oversubscribe)
            _free_port_rendezvous(args)
        settings = settings_env(args.mixed_precision, args.gradient_accumulation_steps, args.cpu)
        settings[ENV_LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (lifeline.py)
    except ValueError as err:
        return _error(f"{err}{suffix}")
    if args.strategy is not None:
        settings[ENV_STRATEGY] = args.strategy
    if config_path is not None:
        print(f"fabric-lite launch: using config file {config_path}", file=sys.stderr)
    if xla:
        return _launch_xla(args, settings)
    for name in ("cpu", "mixed_precision", "gradient_accumulation_steps", "config_file", "strategy", "tpu",
                 "num_processes", "main_training_function", "oversubscribe"):
        delattr(args, name)
    with patched_environ(settings):
        try:
            run(args)
        except ChildFailedError as err:
            codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
            if preempted_together(codes):
                print(f"fabric-lite launch: every worker stopped for preemption after saving (exit {EXIT_PREEMPTED}); "
                      f"requeue the job to resume.", file=sys.stderr)
                return EXIT_PREEMPTED
            # the worker's own traceback is already on stderr; this is torchrun's summary of who failed
            print(err.format_msg(), file=sys.stderr)
            return 1
        except SignalException as err:  # this launcher was told to stop (the workers were stopped with it)
            print(f"fabric-lite launch: stopped by {err.sigval.name}; the workers were sent it too.", file=sys.stderr)
            return 128 + int(err.sigval)
    return 0


def preempted_together(codes: Mapping[int, int]) -> bool:
    """Whether failed workers' exit codes mean "preempted, saved, requeue me": every worker exited with
    EXIT_PREEMPTED, or some did and the others were stopped by the agent's SIGTERM as it took the job down
    (a save is agreed by every worker before any exits, so a worker stopped then has already saved)."""
    import signal

    from fabric_lite.launch.preemption import EXIT_PREEMPTED

    values = set(codes.values())
    return EXIT_PREEMPTED in values and values <= {EXIT_PREEMPTED, -int(signal.SIGTERM)}


def machine_capacity(cpu: bool) -> tuple:
    """(how many worker processes this machine holds, what it counts): its GPUs when CUDA is in use, else
    the CPU cores this process may run on."""
    if not cpu:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count(), "GPU(s)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU core(s)"


def check_capacity(nproc_per_node: Any, cpu: bool, oversubscribe: bool) -> None:
    """Refuse more worker processes on this machine than it has GPUs or cores, unless told to oversubscribe:
    each worker is a whole Python process with torch loaded (hundreds of MB), and a mistyped count would
    start workers until memory runs out."""
    nproc = str(nproc_per_node).strip()
    if oversubscribe or not nproc.isdigit():
        return
    capacity, what = machine_capacity(cpu)
    if int(nproc) > capacity:
        raise LaunchError(f"--nproc-per-node={nproc} would start more worker processes than this machine has "
                          f"{what} ({capacity}). Start at most {capacity}, or pass --oversubscribe to start "
                          f"{nproc} anyway.")


def check_xla_launch(args: argparse.Namespace) -> Optional[int]:
    """The replicas a `--tpu` launch starts (None: every device the runtime has); LaunchError for what torch_xla's
    launcher cannot do."""
    if args.cpu:
        raise LaunchError("--cpu and --tpu ask for two different devices; pass one of them.")
    if args.strategy not in (None, "xla", "xla_spmd"):
        raise LaunchError(f"--strategy {args.strategy} with --tpu: XLA devices train with --strategy xla (a replica per "
                          f"device) or xla_spmd (one process over every device).")
    if str(args.nnodes).split(":")[-1] != "1":
        raise LaunchError(f"--nnodes={args.nnodes} with --tpu: run the same command on every TPU host; torch_xla's "
                          f"runtime joins the hosts itself.")
    if args.module or args.no_python:
        raise LaunchError("--module / --no-python with --tpu: torch_xla's launcher runs a Python script; pass its path.")
    nproc = str(args.nproc_per_node).strip()
    if not nproc.lstrip("+-").isdigit() or int(nproc) < 1:
        raise LaunchError(f"--nproc-per-node={nproc!r} with --tpu must be a whole number >= 1 (XLA replicas).")
    if args.num_processes is not None and args.num_processes < 1:
        raise LaunchError(f"--num-processes={args.num_processes} must be a whole number >= 1.")
    replicas = args.num_processes if args.num_processes is not None else (int(nproc) if int(nproc) > 1 else None)
    if args.strategy == "xla_spmd" and replicas not in (None, 1):
        raise LaunchError(f"--strategy xla_spmd drives every XLA device from one process; leave out --nproc-per-node "
                          f"{replicas} (on XLA's CPU device set CPU_NUM_DEVICES for the number of devices).")
    return replicas


def _launch_xla(args: argparse.Namespace, settings: Dict[str, str]) -> int:
    from fabric_lite.launch.xla_launch import launch_xla_script

    replicas = check_xla_launch(args)
    return launch_xla_script(args.training_script, args.training_script_args, replicas, settings,
                             args.main_training_function, spmd=args.strategy == "xla_spmd")


class _Entrypoint:
    """Run the user's function in a worker with this launch's settings in the environment."""

    def __init__(self, function: Callable[..., Any], env: Dict[str, str]):
        self.function = function
        self.env = env
        functools.update_wrapper(self, function)  # torch elastic reads the entrypoint's names

    def __call__(self, *args: Any) -> Any:
        os.environ.update(self.env)
        return self.function(*args)


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: Optional[int] = None,
    mixed_precision: str = "no",
    use_port: Optional[str] = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    master_port: Optional[int] = None,
    start_method: str = "fork",
) -> Optional[List[Any]]:
    """Run `function(*args)` on `num_processes` processes (forked, so notebook-defined functions work).

    Returns the list of each rank's return value. With one process (or None on a CPU-only machine)
    the function runs right here. Where PJRT_DEVICE is set, XLA replicas run it, started by torch_xla's
    launcher (on XLA's CPU device `num_processes` of them; on a TPU one per device).
    """
    import torch

    env = settings_env(mixed_precision, None, False)
    if read_xla_settings().names_device:  # PJRT_DEVICE is set: XLA replicas, started by torch_xla's launcher
        from fabric_lite.launch.xla_launch import launch_xla_function

        return launch_xla_function(function, args, num_processes, env, start_method=start_method)
    if num_processes is None:
        num_processes = torch.cuda.device_count() or 1
    if num_processes == 1 and num_nodes == 1:
        with patched_environ(env):
            return [function(*args)]
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialized in this process before notebook_launcher, so forked workers cannot use it. "
            "Restart the notebook and keep every CUDA call (model.cuda(), torch.cuda.*) inside the function."
        )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = int(master_port or use_port or free_port())
    config = LaunchConfig(
        min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes,
        run_id=f"fabric-lite-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static" if num_nodes == 1 else "c10d",
        rdzv_endpoint=f"{master_addr}:{port}",
        rdzv_configs={"rank": node_rank} if num_nodes == 1 else {},
        max_restarts=max_restarts, monitor_interval=monitor_interval, start_method=start_method,
    )
    results = elastic_launch(config, _Entrypoint(function, env))(*args)
    return [results[rank] for rank in sorted(results)]
