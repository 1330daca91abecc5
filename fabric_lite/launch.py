"""Starting several processes: `fabric-lite launch` (over torch.distributed.run) and `notebook_launcher`.

Both use PyTorch's own elastic machinery; settings for the Accelerator travel as environment
variables that `environments.read_launch_settings` reads in each worker.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from fabric_lite.environments import ENV_GRAD_ACCUM, ENV_MIXED_PRECISION, ENV_USE_CPU
from fabric_lite.precision import resolve_precision

__all__ = ["notebook_launcher", "launch_command_parser", "launch_command", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings_env(mixed_precision: Optional[str], gradient_accumulation_steps: Optional[int],
                  cpu: bool) -> Dict[str, str]:
    env: Dict[str, str] = {}
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
def _patched_environ(values: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
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
    parser.prog = "fabric-lite launch"
    parser.description = (
        "Start a training script on one or many processes (a front over torch.distributed.run; all of its "
        "flags work). Example: fabric-lite launch --nproc-per-node 2 train.py --epochs 3"
    )
    group = parser.add_argument_group("fabric_lite settings (read by Accelerator() in each worker)")
    group.add_argument("--cpu", action="store_true", help="Train on CPU even where a GPU is present.")
    group.add_argument("--mixed-precision", "--mixed_precision", default=None,
                       help="no | fp16 | bf16 (or 32-true, 16-mixed, bf16-mixed, bf16-true).")
    group.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=int, default=None)
    return parser


def launch_command(argv: Sequence[str]) -> int:
    from torch.distributed.run import run

    parser = launch_command_parser()
    args = parser.parse_args(list(argv))
    try:
        env = _settings_env(args.mixed_precision, args.gradient_accumulation_steps, args.cpu)
    except ValueError as err:
        parser.error(str(err))  # exits 2 with the message, no traceback
    for name in ("cpu", "mixed_precision", "gradient_accumulation_steps"):
        delattr(args, name)
    with _patched_environ(env):
        run(args)
    return 0


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
    the function runs right here.
    """
    import torch

    if num_processes is None:
        num_processes = torch.cuda.device_count() or 1
    env = _settings_env(mixed_precision, None, False)
    if num_processes == 1 and num_nodes == 1:
        with _patched_environ(env):
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
