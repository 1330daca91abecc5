"""Starting several processes: over torch.distributed.run (`run_torchrun`, `torchrun_command`) and from a
notebook (`notebook_launcher`).

Both use PyTorch's own elastic machinery; settings for the Accelerator travel as environment variables
(`worker_env.settings_env`) that `environments.read_launch_settings` reads in each worker. The command line
that drives this, `fabric-lite launch`, lives in `cli/launch_command.py`; this module takes plain values.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from fabric_lite.launch.worker_env import patched_environ, settings_env
from fabric_lite.strategies.environments import detect_node_layout

__all__ = ["notebook_launcher", "free_port", "torchrun_command", "run_torchrun", "preempted_together",
           "settings_env", "patched_environ"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: argparse.Namespace, settings: Mapping[str, str], debug: bool = False) -> int:
    """Run torch.distributed.run with its own namespace `args` and the workers' `settings` in the environment;
    the exit status: 0, EXIT_PREEMPTED where every worker stopped for preemption, 1 where a worker failed (torchrun's
    summary on stderr; `debug`: this process's traceback too), 128 + N when this process got signal N."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from fabric_lite.launch.preemption import EXIT_PREEMPTED

    with patched_environ(settings):
        try:
            run(args)
        except ChildFailedError as err:
            codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
            if preempted_together(codes):
                print(f"fabric-lite launch: every worker stopped for preemption after saving (exit {EXIT_PREEMPTED}); "
                      f"requeue the job to resume.", file=sys.stderr)
                return EXIT_PREEMPTED
            if debug:  # --debug: the launcher's own stack too
                import traceback

                traceback.print_exc()
            # the worker's own traceback is already on stderr; this is torchrun's summary of who failed
            print(err.format_msg(), file=sys.stderr)
            return 1
        except SignalException as err:  # this launcher was told to stop (the workers were stopped with it)
            print(f"fabric-lite launch: stopped by {err.sigval.name}; the workers were sent it too.", file=sys.stderr)
            return 128 + int(err.sigval)
    return 0


def torchrun_command(nproc_per_node: Any, nnodes: Any, script: str, script_args: Sequence[str] = (),
                     master_port: Optional[int] = None, master_addr: Optional[str] = None,
                     python: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The argv that starts `script` with `script_args` under torch.distributed.run on `nproc_per_node`
    processes per machine: ``python -m torch.distributed.run --nproc-per-node N ... -- script args...``.

    The ``--`` matters: torchrun's parser abbreviates long options, and would read a script argument
    such as ``--run`` as its own ``--run-path`` (or refuse it as ambiguous); after ``--`` it reads none.

    On one machine the processes meet on 127.0.0.1, at a free port where `master_port` is None. Where a cluster
    engine describes the nodes (SkyPilot, a Kubeflow TrainJob: `detect_node_layout` of `env`, default the process
    environment), this node starts as its node rank, and the processes meet at the head's address and port
    (`master_addr` / `master_port`, where given, win); `nnodes` must then be the engine's node count: ValueError
    otherwise, before anything starts."""
    layout = detect_node_layout(env)
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
           "--nnodes", str(nnodes)]
    if layout is not None:
        if str(nnodes).strip() != str(layout.nnodes):
            raise ValueError(f"num_nodes={nnodes}, but {layout.source} runs this job on {layout.nnodes} node(s) "
                             f"(this one is node {layout.node_rank}); pass num_nodes={layout.nnodes} "
                             f"(Trainer(num_nodes={layout.nnodes}, ...)).")
        cmd += ["--node-rank", str(layout.node_rank)]
        master_addr = layout.master_addr if master_addr is None else master_addr
        if master_port is None:
            master_port = layout.master_port
    if master_port is None:  # one machine: a free port; several: torchrun's usual one, the same on every node
        master_port = 29500 if layout is not None and layout.nnodes > 1 else free_port()
    return cmd + ["--master-addr", master_addr or "127.0.0.1", "--master-port", str(master_port),
                  "--", str(script), *map(str, script_args)]


def preempted_together(codes: Mapping[int, int]) -> bool:
    """Whether failed workers' exit codes mean "preempted, saved, requeue me": every worker exited with
    EXIT_PREEMPTED, or some did and the others were stopped by the agent's SIGTERM as it took the job down
    (a save is agreed by every worker before any exits, so a worker stopped then has already saved)."""
    import signal

    from fabric_lite.launch.preemption import EXIT_PREEMPTED

    values = set(codes.values())
    return EXIT_PREEMPTED in values and values <= {EXIT_PREEMPTED, -int(signal.SIGTERM)}


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
    the function runs right here. Where the environment names a runtime that starts its own replicas
    (`replica_runtime`), its launcher starts them.
    """
    import torch

    env = settings_env(mixed_precision, None, False)
    runtime = replica_runtime()
    if runtime is not None:  # the environment names a runtime that starts its own replicas
        return runtime.launch_function(function, args, num_processes, env, start_method=start_method)
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


def replica_runtime() -> Any:
    """The launch module of the device runtime that starts its own replicas where the launch environment names its
    device (the registry's `register_runtime`), else None. With `runtime_unset`, the one place launch/ reaches the
    runtimes."""
    from fabric_lite.strategies.environments import read_launch_environment
    from fabric_lite.strategies.registry import runtime_launcher

    for name, settings in read_launch_environment().runtimes.items():  # (notebook_launcher: no door)
        if getattr(settings, "names_device", False):
            return runtime_launcher(name)
    return None


def runtime_unset() -> Dict[str, Optional[str]]:
    """The variables to remove so that no runtime of its own starts the replicas (`patched_environ` takes it)."""
    from fabric_lite.strategies.registry import runtime_launcher, runtimes

    return {name: None for entry in runtimes() for name in runtime_launcher(entry.name).RUNTIME_VARIABLES}
