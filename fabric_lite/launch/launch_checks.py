"""What `fabric-lite launch` refuses before it starts a worker: the flags torchrun would only report with a
traceback (or a hang), a script path that is not there, more workers than the machine holds, and fp8 without a GPU
that computes in it (a runtime that starts its own replicas checks its launches in its own launch file). Each
refusal is a `LaunchError` in one sentence."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from typing import Any, Optional

from fabric_lite.launch.config_values import LaunchConfigFile
from fabric_lite.strategies.precision import resolve_precision
from fabric_lite.strategies.registry import runs_one_process

__all__ = ["LaunchError", "check_mixed_precision", "check_launch", "check_script", "nodes_said", "machine_capacity",
           "check_capacity"]


class LaunchError(ValueError):
    """A launch that cannot work, found before starting anything; the message is one line."""


def check_mixed_precision(args: argparse.Namespace, config: Optional[LaunchConfigFile] = None) -> None:
    """--mixed-precision (or the config's mixed_precision) fp8: the Accelerator's own check of this machine's GPUs
    (`--cpu`: of a run on the CPU), before any worker starts; LaunchError with its words where none computes in fp8.
    An Accelerate config's fp8_config backend other than torchao is named with what it would need."""
    if args.mixed_precision is None or resolve_precision(args.mixed_precision) != "fp8":
        return
    from fabric_lite.strategies.fp8 import INSTALL, hardware_problem, machine_problem, package_problem

    problem = hardware_problem("cpu") if args.cpu else machine_problem()
    if problem is None:
        return
    backend = getattr(config, "fp8_backend", None)
    if backend == "TE":
        te = "not installed here: " + INSTALL["te"] if package_problem("te") else "installed"
        problem += (" The config's fp8_config asks for TransformerEngine (backend: TE), which the launch does not pass "
                    "on: the workers train fp8 with torchao unless the script passes kwargs_handlers=[TERecipeKwargs("
                    f"...)], which needs an fp8 GPU too, and transformer_engine ({te}).")
    elif backend not in (None, "AO"):
        problem += f" (The config's fp8_config backend {backend} is not used here: fp8 trains with torchao.)"
    raise LaunchError(f"--mixed-precision fp8: {problem}")


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
                          f"{nproc} per node on {nodes_said(args.nnodes)} node(s). Use --strategy ddp (or leave it out), or "
                          f"--nproc-per-node 1.")
    # On the machine that hosts the rendezvous store (static rendezvous, node 0) a port in use would
    # surface as a traceback from deep inside c10d, or a hang: look before starting.
    if static and not args.rdzv_endpoint and args.master_port is not None and args.node_rank == 0:
        if _port_taken(args.master_addr, args.master_port):
            raise LaunchError(f"--master-port={args.master_port} is already in use on {args.master_addr}; pick a "
                              f"free port, or leave --master-port out on a single machine (a free one is chosen).")


def check_script(args: argparse.Namespace) -> None:
    """Refuse a training script path that is not there, or a directory Python cannot run, before any process
    starts (torchrun would start every worker only to have each fail to open it). A module (-m) or a program
    (--no-python) is looked up by the workers themselves, so it is not checked here."""
    if args.module or args.no_python:
        return
    script = args.training_script
    if os.path.isfile(script):
        return
    if os.path.isdir(script):
        if os.path.isfile(os.path.join(script, "__main__.py")):
            return  # what `python folder/` runs
        raise LaunchError(f"the training script {script} is a directory (with no __main__.py); pass the Python file "
                          f"inside it to run, e.g. {os.path.join(script, 'train.py')}, or -m package.module.")
    where = "" if os.path.isabs(script) else f" (looked for from {os.getcwd()})"
    raise LaunchError(f"the training script {script} does not exist{where}; check the path, or pass -m "
                      f"package.module to run a module.")


def nodes_said(nnodes: Any) -> str:
    """--nnodes as a person reads it: torchrun's default "1:1" is 1; a range MIN:MAX stays one."""
    low, _, high = str(nnodes).partition(":")
    return low if not high or low == high else f"{low}:{high}"


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

