"""The `fabric-lite` command."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: fabric-lite <command> [options]

commands:
  launch    start a training script on one or many processes (fabric-lite launch --help)
  env       print versions and devices, ready to paste into a bug report
  consolidate CHECKPOINT OUT
            write a checkpoint's model weights as one file a plain nn.Module loads
            (OUT ending in .safetensors: safetensors; otherwise torch.save)
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


def _consolidate(args: List[str]) -> int:
    import argparse

    from fabric_lite.checkpoint_io import CheckpointError
    from fabric_lite.state_io import export_weights

    parser = argparse.ArgumentParser(
        prog="fabric-lite consolidate",
        description="Write the model weights of a fabric_lite checkpoint (a save_state / Trainer checkpoint "
                    "directory, any fsspec URL) as one state dict: model.load_state_dict(...) takes it.")
    parser.add_argument("checkpoint")
    parser.add_argument("out", help="a .safetensors file, or any other name for a torch.save file")
    parser.add_argument("--model-index", type=int, default=0, help="which prepared model (default 0)")
    parsed = parser.parse_args(args)
    try:
        count = export_weights(parsed.checkpoint, parsed.out, parsed.model_index)
    except (CheckpointError, ValueError, ImportError) as err:
        print(f"fabric-lite consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {count} tensors to {parsed.out}")
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
    if command == "consolidate":
        return _consolidate(rest)
    print(f"fabric-lite: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
