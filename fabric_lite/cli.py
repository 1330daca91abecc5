"""The `fabric-lite` command."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: fabric-lite <command> [options]

commands:
  launch    start a training script on one or many processes (fabric-lite launch --help)
  env       print versions and devices, ready to paste into a bug report
"""


def _env() -> int:
    import platform

    import torch

    import fabric_lite

    lines = [
        f"fabric_lite {fabric_lite.__version__}",
        f"python      {platform.python_version()} ({platform.platform()})",
        f"torch       {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible)",
        f"distributed gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}",
    ]
    for name in ("numpy", "fsspec", "tensorboard", "safetensors", "deepspeed", "torch_xla"):
        try:
            from importlib.metadata import version

            lines.append(f"{name:<11} {version(name)}")
        except Exception:
            lines.append(f"{name:<11} not installed")
    print("\n".join(lines))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "launch":
        from fabric_lite.launch import launch_command

        return launch_command(rest)
    if command == "env":
        return _env()
    print(f"fabric-lite: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
