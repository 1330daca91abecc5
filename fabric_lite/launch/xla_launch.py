"""Starting XLA replicas with torch_xla's own launcher: `fabric-lite launch --tpu` and `notebook_launcher`.

torch_xla starts one process per TPU chip and, inside it, one thread per device the process addresses
(XLA's CPU device, TPU v2/v3 cores). Each replica runs the training script as ``__main__`` (or the
function `--main-training-function` names, as Accelerate's TPU launcher does); the Accelerator inside
asks torch_xla's runtime where it is. On XLA's CPU device the number of replicas is CPU_NUM_DEVICES,
which `--nproc-per-node` sets.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import runpy
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

from fabric_lite.launch.launch_checks import LaunchError
from fabric_lite.launch.worker_env import patched_environ, settings_env
from fabric_lite.strategies.environments import ENV_ACCELERATOR, read_launch_environment
from fabric_lite.strategies.xla_env import XLASettings, xla_settings

__all__ = ["launch_xla_script", "launch_xla_function", "xla_replica_env", "check_xla_launch", "asked_for",
           "one_process", "EXPLAIN_REFUSAL", "RUNTIME_VARIABLES"]

# What a launch names this runtime by, as `cli/launch_flags.py` asks (the registry names this module for "xla").
STRATEGIES = ("xla", "xla_spmd")
RUNTIME_VARIABLES = ("PJRT_DEVICE",)  # (set: notebook_launcher starts XLA replicas; debug_launcher removes it)
EXPLAIN_REFUSAL = ("explain plans launches over torchrun; an XLA launch (--tpu, --strategy xla or xla_spmd) is "
                   "not planned here. Start it with `fabric-lite launch --tpu ...`; the README's TPU section says "
                   "what each replica runs.")


def asked_for(args: Any) -> bool:
    """Whether a launch's flags (`fabric-lite launch`'s parsed arguments) ask for XLA replicas: --tpu, or an XLA
    strategy."""
    return bool(getattr(args, "tpu", False)) or getattr(args, "strategy", None) in STRATEGIES


def one_process(strategy: Optional[str]) -> bool:
    """Whether one process drives every device (xla_spmd), so the script runs in the launching process."""
    return strategy == "xla_spmd"


def xla_replica_env(num_processes: Optional[int], settings: Dict[str, str],
                    xla: Optional[XLASettings] = None) -> Dict[str, str]:
    """The environment the replicas need: the launch's settings, XLA as the accelerator, and on XLA's CPU
    device as many devices as replicas were asked for. `xla`: what the launch environment tells the runtime
    (None: read it here; a launcher has no door). Raises ValueError for a count that cannot be."""
    env = dict(settings)
    env[ENV_ACCELERATOR] = "xla"
    xla = xla if xla is not None else xla_settings(read_launch_environment())
    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"--nproc-per-node={num_processes} must be >= 1.")
        if xla.pjrt_device == "CPU":
            env["CPU_NUM_DEVICES"] = str(num_processes)
        elif xla.pjrt_device is None:
            raise ValueError(
                f"{num_processes} XLA replicas were asked for, but PJRT_DEVICE is not set. On a TPU set PJRT_DEVICE=TPU "
                f"(torch_xla then starts one replica per TPU device and --nproc-per-node must be left out); for XLA's "
                f"CPU device set PJRT_DEVICE=CPU.")
    return env


def check_xla_launch(args: Any) -> Optional[int]:
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
        raise LaunchError(f"--num_processes={args.num_processes} must be a whole number >= 1.")
    replicas = args.num_processes if args.num_processes is not None else (int(nproc) if int(nproc) > 1 else None)
    if args.strategy == "xla_spmd" and replicas not in (None, 1):
        raise LaunchError(f"--strategy xla_spmd drives every XLA device from one process; leave out --nproc-per-node "
                          f"{replicas} (on XLA's CPU device set CPU_NUM_DEVICES for the number of devices).")
    return replicas


_SCRIPT_LOCK = threading.Lock()


def _script_module(script: str) -> Any:
    """The script imported once in this process, as a module of its own name (replicas that are threads share
    it), so that what it defines pickles by name (object collectives, torch.save)."""
    name = os.path.splitext(os.path.basename(script))[0]
    with _SCRIPT_LOCK:
        module = sys.modules.get(name)
        if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(script):
            spec = importlib.util.spec_from_file_location(name, script)
            if spec is None or spec.loader is None:
                raise ImportError(f"{script} cannot be imported as a Python module.")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    return module


class _ScriptReplica:
    """One replica: the script as __main__ (or its training function), with the launch's settings.

    Replicas that are threads of one process each run the script as __main__, one after the other's start: a
    class the script defines then does not pickle by name (`__main__` is one module for all threads). Object
    collectives of such classes need `--main-training-function`, which imports the script once as a module."""

    def __init__(self, script: str, argv: Sequence[str], env: Dict[str, str], function: Optional[str]) -> None:
        self.script, self.argv, self.env, self.function = script, list(argv), env, function

    def __call__(self, index: int) -> None:
        os.environ.update(self.env)  # (replicas that are threads share it: the values are the same)
        sys.argv = [self.script, *self.argv]
        folder = os.path.dirname(os.path.abspath(self.script))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            if self.function is None:
                runpy.run_path(self.script, run_name="__main__")
                return
            train = getattr(_script_module(self.script), self.function, None)
            if not callable(train):
                raise ValueError(f"--main-training-function={self.function!r}: {self.script} defines no function of that "
                                 f"name. Pass the name of the function that trains, or leave the flag out to run the "
                                 f"script as __main__.")
            train()
        except SystemExit as stop:  # a script's sys.exit(0) ends its replica, not the launch
            if stop.code not in (None, 0):
                _replica_failed()
                raise RuntimeError(f"replica {index} exited with {stop.code!r}") from None
        except BaseException:
            _replica_failed()
            raise


def _replica_failed() -> None:
    """Say why this replica failed (the launch reports only one replica's error), and let replicas that are
    threads of this process stop waiting for it."""
    from fabric_lite.strategies.xla import abort_replica_barriers

    traceback.print_exc()
    abort_replica_barriers()


def launch_xla_script(script: str, argv: Sequence[str], num_processes: Optional[int], settings: Dict[str, str],
                      main_function: Optional[str] = None, spmd: bool = False) -> int:
    """`fabric-lite launch --tpu`: run the script on every XLA replica; 0 when all finished, else 1.
    `spmd`: one process drives every device (strategy xla_spmd), so the script runs right here."""
    from fabric_lite.strategies.xla import import_torch_xla

    try:
        env = xla_replica_env(num_processes, settings)
        torch_xla = import_torch_xla()
    except (ValueError, ImportError) as err:
        print(f"fabric-lite launch: error: {err}", file=sys.stderr)
        return 2
    replica = _ScriptReplica(script, argv, env, main_function)
    try:
        with patched_environ(env):  # read by torch_xla's launcher itself (CPU_NUM_DEVICES, PJRT_DEVICE)
            if spmd:
                import torch_xla.runtime as xr

                xr.use_spmd()  # before the script's first tensor reaches a device
                replica(0)
            else:
                torch_xla.launch(replica, args=(), debug_single_process=num_processes == 1)
    except Exception as err:  # the replica's own traceback is already on stderr
        print(f"fabric-lite launch: a replica failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


class _FunctionReplica:
    """One replica of notebook_launcher's function; its return value goes to a file the launcher reads."""

    def __init__(self, function: Callable[..., Any], args: Sequence[Any], env: Dict[str, str], out_dir: str) -> None:
        self.function, self.args, self.env, self.out_dir = function, tuple(args), env, out_dir

    def __call__(self, index: int) -> None:
        os.environ.update(self.env)
        try:
            result = self.function(*self.args)
        except BaseException:
            _replica_failed()
            raise
        with open(os.path.join(self.out_dir, f"{index}.pkl"), "wb") as f:
            pickle.dump(result, f)


def launch_xla_function(function: Callable[..., Any], args: Sequence[Any], num_processes: Optional[int],
                        settings: Dict[str, str], start_method: str = "fork") -> List[Any]:
    """notebook_launcher on XLA: `function(*args)` on every replica; their return values, by replica."""
    from fabric_lite.strategies.xla import import_torch_xla

    env = xla_replica_env(num_processes, settings)
    torch_xla = import_torch_xla()
    with patched_environ(env), tempfile.TemporaryDirectory(prefix="fabric-lite-xla-") as out_dir:
        torch_xla.launch(_FunctionReplica(function, args, env, out_dir), args=(), start_method=start_method,
                         debug_single_process=num_processes == 1)
        names = sorted((n for n in os.listdir(out_dir) if n.endswith(".pkl")), key=lambda n: int(n[:-4]))
        results = []
        for name in names:  # written just now by this launch's own replicas
            with open(os.path.join(out_dir, name), "rb") as f:
                results.append(pickle.load(f))
    return results


# The names `fabric-lite launch` and notebook_launcher call a runtime that starts its own replicas by.
check_launch_args = check_xla_launch
launch_script = launch_xla_script
launch_function = launch_xla_function


if __name__ == "__main__":  # `python -m fabric_lite.launch.xla_launch N script.py [args]`: Trainer(devices=N)'s relaunch
    sys.exit(launch_xla_script(sys.argv[2], sys.argv[3:], int(sys.argv[1]), settings_env(None, None, False)))
