"""`Trainer(devices=N)` started with plain `python train.py`: the script starts itself again on N processes.

Under the re-launcher of the strategy's runtime: torch's elastic launcher (one process per device), or a device
runtime's own launcher (replicas); one SPMD process is never re-launched. The first process waits for them and
exits with their code.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from fabric_lite.strategies.connector import runtime_class  # the runtime a Trainer's arguments give, re-launched by
from fabric_lite.strategies.environments import LaunchEnvironment

__all__ = ["runtime_class", "relaunch_if_needed"]


def relaunch_if_needed(devices: Union[int, str], num_nodes: int, runtime: Any = None,
                       launch_env: Optional[LaunchEnvironment] = None) -> None:
    """`Trainer(devices=N)` in a script started with plain `python train.py`: start the script again on N
    processes with `runtime`'s re-launcher (a Runtime class; None: process per device, under torch's elastic
    launcher); this process waits for them and exits with their code. `launch_env`: the launch environment the
    Trainer read (None: read it here)."""
    from fabric_lite.strategies.runtime import SPMD, Runtime

    runtime = Runtime if runtime is None else runtime
    import sys

    if launch_env is None:
        from fabric_lite.strategies.environments import read_launch_environment

        launch_env = read_launch_environment()
    process = launch_env.process
    if not isinstance(devices, int) or devices <= 1 or process.is_distributed or runtime.kind == SPMD:
        return
    if process.started_by_ray:  # Ray starts, places and restarts the processes: never a second launcher under it
        raise RuntimeError(
            f"Trainer(devices={devices}) in a single Ray process ({process.source}): under Ray, Ray starts the "
            f"processes. Run the training function in Ray Train's TorchTrainer(train_fn, scaling_config="
            f"ScalingConfig(num_workers={devices})) and leave `devices` out (or 'auto'), or pass devices=1.")
    if runtime.started_by_launcher(launch_env.launch):
        return
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or not script.endswith(".py") or os.path.basename(sys.argv[0]) != os.path.basename(script):
        raise RuntimeError(
            f"Trainer(devices={devices}) needs {devices} processes, and this process was not started from a script "
            f"it can start again (a notebook or an interactive session). Use notebook_launcher(fn, "
            f"num_processes={devices}), or run `fabric-lite launch{runtime.launch_flags} --nproc-per-node {devices} "
            f"train.py`."
        )
    if not os.path.isfile(script):  # moved or deleted since it started: every worker would fail to open it
        raise RuntimeError(
            f"Trainer(devices={devices}) starts this script again on {devices} processes, but {script} no longer "
            f"exists (moved or deleted while it ran). Put it back, or start it with `fabric-lite launch"
            f"{runtime.launch_flags} --nproc-per-node {devices} PATH/TO/SCRIPT.py`.")
    import subprocess

    # (the script's own arguments pass through untouched)
    command = runtime.relaunch_command(devices, num_nodes, script, sys.argv[1:])
    if command is None:
        from fabric_lite.launch.launcher import torchrun_command

        command = torchrun_command(devices, num_nodes, script, sys.argv[1:])
    raise SystemExit(subprocess.call(command))
