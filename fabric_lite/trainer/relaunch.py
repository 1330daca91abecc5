"""`Trainer(devices=N)` started with plain `python train.py`: the script starts itself again on N processes.

Under torch's elastic launcher (one process per device), or as XLA replicas under torch_xla's launcher; the first
process waits for them and exits with their code.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

__all__ = ["xla_replicas", "relaunch_if_needed"]


def xla_replicas(accelerator: str, strategy: Any) -> Optional[bool]:
    """Whether this Trainer trains XLA replicas (True), one process over every device (None: SPMD), or neither
    (False), from what it was given: the launcher to start differs."""
    from fabric_lite.strategies import Strategy, strategy_class
    from fabric_lite.strategies.environments import read_xla_settings

    if isinstance(strategy, Strategy):
        cls: Any = type(strategy)
    else:
        cls = None if str(strategy).lower() == "auto" else strategy_class(str(strategy))
    if cls is not None and cls.drives_all_devices:
        return None
    name = str(accelerator).lower()
    return bool((cls is not None and cls.runtime_device_type == "xla") or name in ("tpu", "xla")
                or (name == "auto" and read_xla_settings().wants_xla))


def relaunch_if_needed(devices: Union[int, str], num_nodes: int, xla: Optional[bool] = False) -> None:
    """`Trainer(devices=N)` in a script started with plain `python train.py`: start the script again
    under torch's elastic launcher on N processes, or as N XLA replicas under torch_xla's launcher (`xla`)
    (this process waits for them and exits with their code)."""
    import sys

    from fabric_lite.strategies.environments import detect_process, read_launch_settings

    process = detect_process()
    if not isinstance(devices, int) or devices <= 1 or process.is_distributed or xla is None:
        return
    if process.started_by_ray:  # Ray starts, places and restarts the processes: never a second launcher under it
        raise RuntimeError(
            f"Trainer(devices={devices}) in a single Ray process ({process.source}): under Ray, Ray starts the "
            f"processes. Run the training function in Ray Train's TorchTrainer(train_fn, scaling_config="
            f"ScalingConfig(num_workers={devices})) and leave `devices` out (or 'auto'), or pass devices=1.")
    if xla and read_launch_settings().accelerator == "xla":
        return  # a replica that torch_xla's launcher started (replicas that are threads share one environment)
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or not script.endswith(".py") or os.path.basename(sys.argv[0]) != os.path.basename(script):
        raise RuntimeError(
            f"Trainer(devices={devices}) needs {devices} processes, and this process was not started from a script "
            f"it can start again (a notebook or an interactive session). Use notebook_launcher(fn, "
            f"num_processes={devices}), or run `fabric-lite launch{' --tpu' if xla else ''} --nproc-per-node {devices} "
            f"train.py`."
        )
    if not os.path.isfile(script):  # moved or deleted since it started: every worker would fail to open it
        raise RuntimeError(
            f"Trainer(devices={devices}) starts this script again on {devices} processes, but {script} no longer "
            f"exists (moved or deleted while it ran). Put it back, or start it with `fabric-lite launch"
            f"{' --tpu' if xla else ''} --nproc-per-node {devices} PATH/TO/SCRIPT.py`.")
    import subprocess

    from fabric_lite.launch.launcher import torchrun_command

    if xla:  # (torch_xla's launcher, without `fabric-lite launch`'s config file: as torchrun below)
        cmd = [sys.executable, "-m", "fabric_lite.launch.xla_launch", str(devices), script, *sys.argv[1:]]
    else:  # (the script's own arguments pass through untouched)
        cmd = torchrun_command(devices, num_nodes, script, sys.argv[1:])
    raise SystemExit(subprocess.call(cmd))
