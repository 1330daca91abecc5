"""The `fabric-lite` command."""

from __future__ import annotations

import re
import sys
from typing import Callable, Dict, List, Optional

USAGE = """usage: fabric-lite <command> [options]

commands:
  config    answer a few questions (or pass flags) and write the launch config file
            (fabric-lite config --help); `config update` brings an existing one up to date
  launch    start a training script on one or many processes (fabric-lite launch --help)
  explain   print the plan a launch would run (processes, precision, sharding, global batch,
            checkpoints, settings given twice or ignored) from a one-process dry run;
            takes the same flags as launch (fabric-lite explain --help)
  test      check this setup: collectives, DDP training parity, checkpoint round-trip
  env       print versions, devices and the config file in force, ready for a bug report
  consolidate CHECKPOINT OUT
            write a checkpoint's model weights as one file a plain nn.Module loads
            (OUT ending in .safetensors: safetensors; otherwise torch.save)
  merge-weights CHECKPOINT OUTPUT_DIR
            Accelerate's spelling: OUTPUT_DIR/model.safetensors (--unsafe_serialization:
            pytorch_model.bin); --remove_checkpoint_dir deletes CHECKPOINT afterwards
  estimate-memory MODEL_NAME
            the memory a model takes per dtype (largest layer, total, training with Adam),
            built from its config without allocating weights
  tpu-config
            run setup commands on every worker of a Cloud TPU VM pod (through gcloud)
"""


def _env(args: List[str]) -> int:
    import os
    import platform

    import torch

    import fabric_lite
    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.launch.config_file import (
        AccelerateConfig, ConfigError, accelerate_config_path, default_config_path, find_config, load_config,
    )
    from fabric_lite.strategies.environments import detect_node_layout, read_launch_environment
    from fabric_lite.utils.imports import REPORTED_PACKAGES

    parser = CliParser(prog="fabric-lite env", description="Print versions, devices and config.")
    parser.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                        help="a fabric_lite or an Accelerate config file (default: the one `fabric-lite launch` reads)")
    parsed = parser.parse_args(args)
    lines = [
        f"fabric_lite {fabric_lite.__version__}",
        f"python      {platform.python_version()} ({platform.platform()})",
        f"torch       {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible)",
        f"distributed gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}",
    ]
    try:
        lines.append(f"processes   {read_launch_environment().process.source}")
    except ValueError as err:
        lines.append(f"processes   -- INVALID: {err}")
    try:
        layout = detect_node_layout()
    except ValueError as err:
        lines.append(f"cluster     -- INVALID: {err}")
    else:
        if layout is not None:
            head = (f"{layout.master_addr}:{layout.master_port}" if layout.master_port is not None
                    else f"{layout.master_addr} (port not said)")
            per_node = (f"{layout.nproc_per_node} process(es) per node" if layout.nproc_per_node is not None
                        else "processes per node not said")
            lines.append(f"cluster     {layout.source}: node {layout.node_rank} of {layout.nnodes}, head {head}, "
                         f"{per_node}")
    for name in REPORTED_PACKAGES:
        try:
            from importlib.metadata import version

            lines.append(f"{name:<11} {version(name)}")
        except Exception:
            lines.append(f"{name:<11} not installed")
    path = find_config(parsed.config_file, os.environ)
    if path is None:
        lines.append(f"config      no config file (none at {default_config_path(os.environ)}, nor Accelerate's at "
                     f"{accelerate_config_path(os.environ)}; write one with `fabric-lite config`)")
    else:
        try:
            config = load_config(path)
            verdict = ""
            if isinstance(config, AccelerateConfig):
                verdict = f" (Accelerate's format: {config.summary()})"
                if config.ignored:
                    verdict += f"; ignored, no meaning here: {', '.join(config.ignored)}"
        except ConfigError as err:
            verdict = f" -- INVALID: {err}"
        lines.append(f"config      {path}{verdict}")
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            lines += ["  " + line for line in text.rstrip("\n").splitlines()]
        except OSError:
            pass
    print("\n".join(lines))
    return 0


def _consolidate(args: List[str]) -> int:
    import pickle

    from fabric_lite.checkpoint.state import export_weights
    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.strategies import registry  # noqa: F401 (registers the strategies' checkpoint engines)

    parser = CliParser(
        prog="fabric-lite consolidate",
        description="Write the model weights of a fabric_lite checkpoint (a save_state / Trainer checkpoint "
                    "directory, any fsspec URL) as one state dict: model.load_state_dict(...) takes it.")
    parser.add_argument("checkpoint")
    parser.add_argument("out", help="a .safetensors file, any other name for a torch.save file, or a directory "
                                    "(model_INDEX.pt inside it); missing directories are made")
    parser.add_argument("--model-index", "--model_index", type=int, default=0, help="which prepared model (default 0)")
    parsed = parser.parse_args(args)
    try:
        count, written = export_weights(parsed.checkpoint, parsed.out, parsed.model_index)
    except ImportError as err:  # safetensors asked for and missing: its message says what to install
        print(f"fabric-lite consolidate: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{parsed.checkpoint}: the weights of model {parsed.model_index} hold objects that safe loading "
            f"(weights_only=True) refuses ({refused_object(err)}); nothing was written. consolidate reads tensors "
            f"only: if you trust this checkpoint, load it in Python with accelerator.load_state(..., "
            f"weights_only=False) and save the model's state_dict().") from err
    print(f"wrote {count} tensors to {written}")
    return 0


def _merge_weights(args: List[str]) -> int:
    """`accelerate merge-weights`, over the same code as `consolidate`."""
    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.utils.fsdp import merge_fsdp_weights

    parser = CliParser(
        prog="fabric-lite merge-weights",
        description="Write the whole model weights of a (sharded) checkpoint that accelerator.save_state wrote as "
                    "OUTPUT_DIR/model.safetensors (or pytorch_model.bin): one state dict a plain nn.Module loads. "
                    "CHECKPOINT is the checkpoint directory, or a model directory inside it named as Accelerate "
                    "names them (pytorch_model_fsdp_<i>): model i. Runs on the CPU, without a process group.")
    parser.add_argument("checkpoint_directory")
    parser.add_argument("output_path", help="the directory to write into (made if missing)")
    parser.add_argument("--unsafe-serialization", "--unsafe_serialization", action="store_false",
                        dest="safe_serialization", help="write pytorch_model.bin (torch.save) instead of safetensors")
    parser.add_argument("--remove-checkpoint-dir", "--remove_checkpoint_dir", action="store_true",
                        help="delete CHECKPOINT once the weights are written")
    parsed = parser.parse_args(args)
    written = merge_fsdp_weights(parsed.checkpoint_directory, parsed.output_path,
                                 safe_serialization=parsed.safe_serialization,
                                 remove_checkpoint_dir=parsed.remove_checkpoint_dir)
    print(f"wrote the merged weights to {written}")
    return 0


def _config(args: List[str]) -> int:
    import argparse
    import os

    if args[:1] == ["update"]:
        from fabric_lite.cli.config_update import update_command

        return update_command(args[1:])

    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.launch.config_file import (
        COMPUTE_ENVIRONMENTS, MIXED_PRECISIONS, STRATEGIES, ConfigError, LaunchConfigFile, default_config_path,
        dump_config, questionnaire, save_config, validate,
    )

    parser = CliParser(
        prog="fabric-lite config",
        description="Write the config file `fabric-lite launch` and `fabric-lite test` read their defaults from. "
                    "Without options it asks a few questions; with --default or any setting below it asks nothing "
                    "(for scripts). Example: fabric-lite config --nproc-per-node 2 --mixed-precision bf16. Every flag "
                    "takes dashes or underscores (--mixed_precision). --num-processes here counts the processes on "
                    "each machine, as the file's nproc_per_node does. `fabric-lite config update` brings an "
                    "existing file up to date (fabric-lite config update --help).")
    parser.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                        help="where to write (default: $FABRIC_LITE_CONFIG_DIR/default_config.yaml, else "
                             "$XDG_CONFIG_HOME/fabric_lite/..., else ~/.config/fabric_lite/...)")
    parser.add_argument("--default", action="store_true", help="write the default config without asking")
    settings = parser.add_argument_group("settings (any of these: no questions)")
    settings.add_argument("--compute-environment", "--compute_environment", choices=COMPUTE_ENVIRONMENTS)
    settings.add_argument("--nnodes", "--num-machines", "--num_machines", dest="nnodes", type=str)
    settings.add_argument("--node-rank", "--node_rank", "--machine-rank", "--machine_rank", dest="node_rank", type=str)
    settings.add_argument("--master-addr", "--master_addr", "--main-process-ip", "--main_process_ip", dest="master_addr")
    settings.add_argument("--master-port", "--master_port", "--main-process-port", "--main_process_port",
                          dest="master_port", type=str)
    settings.add_argument("--nproc-per-node", "--nproc_per_node", "--num-processes", "--num_processes",
                          dest="nproc_per_node", type=str)
    settings.add_argument("--strategy", help="/".join(STRATEGIES))
    settings.add_argument("--mixed-precision", "--mixed_precision", help="/".join(MIXED_PRECISIONS))
    settings.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=str)
    settings.add_argument("--cpu", dest="use_cpu", action=argparse.BooleanOptionalAction, default=None)
    settings.add_argument("--use-cpu", "--use_cpu", dest="use_cpu", action="store_const", const=True,
                          default=argparse.SUPPRESS, help="= --cpu")
    parsed = parser.parse_args(args)
    path = parsed.config_file or default_config_path(os.environ)
    given = {k: v for k, v in vars(parsed).items()
             if k not in ("config_file", "default", "command_line") and v is not None}
    defaults = LaunchConfigFile(nproc_per_node=_default_nproc())
    try:
        if given or parsed.default:
            raw = {**defaults.to_dict(), **given}
            if "compute_environment" not in given and str(given.get("nnodes", "1")).strip() not in ("1", "+1"):
                raw["compute_environment"] = "multi_node"
            config = validate(raw)
        else:
            print(f"Answer each question (Enter takes the value in brackets). The answers go to {path}.")
            config = questionnaire(input, print, defaults)
        save_config(config, path)
    except ConfigError as err:
        print(f"fabric-lite config: error: {err}", file=sys.stderr)
        return 2
    except (EOFError, KeyboardInterrupt):
        print("\nfabric-lite config: stopped before the last answer; nothing written.", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"fabric-lite config: error: cannot write {path}: {one_line(str(err))}", file=sys.stderr)
        return 2
    print(f"Configuration saved at {path}")
    if not (given or parsed.default):
        print(dump_config(config).rstrip("\n"))
    return 0


def _default_nproc() -> int:
    """One process per GPU, else one (several processes on CPU only pay off in rare cases)."""
    import torch

    return torch.cuda.device_count() or 1


def _test(args: List[str]) -> int:
    import os
    import shutil
    import tempfile

    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.launch.config_file import ConfigError, find_config, load_config
    from fabric_lite.cli.launch_command import launch_command

    parser = CliParser(
        prog="fabric-lite test",
        description="Check this setup end to end: start the configured number of processes on this machine "
                    "(2 on CPU without a config file) through `fabric-lite launch`, run every collective, a "
                    "short DDP training compared with one process, and a checkpoint round-trip.")
    parser.add_argument("--config-file", "--config_file", default=None, metavar="PATH")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--num-processes", "--num_processes",
                        dest="nproc_per_node", type=int, default=None,
                        help="processes to start on this machine (default: the config's processes per machine, else 2)")
    parsed = parser.parse_args(args)
    if parsed.nproc_per_node is not None and parsed.nproc_per_node < 1:
        print(f"fabric-lite test: error: --nproc-per-node={parsed.nproc_per_node} must be >= 1.", file=sys.stderr)
        return 2
    path = find_config(parsed.config_file, os.environ)
    launch_args: List[str] = []
    if path is not None:
        try:
            config = load_config(path)  # a bad file: its one-line error, not a launch attempt
        except ConfigError as err:
            print(f"fabric-lite test: error: {err}", file=sys.stderr)
            return 2
        launch_args += ["--config-file", str(path)]
        if parsed.nproc_per_node is None:  # the config's count per machine (an Accelerate total is divided)
            launch_args += ["--nproc-per-node", str(config.nproc_per_node)]
    else:
        launch_args += ["--nproc-per-node", "2", "--cpu"]
    if parsed.nproc_per_node is not None:
        launch_args += ["--nproc-per-node", str(parsed.nproc_per_node)]
    # Whatever the config says about machines, the check runs on this one, at a free port.
    launch_args += ["--nnodes", "1", "--node-rank", "0", "--standalone"]
    workdir = tempfile.mkdtemp(prefix="fabric-lite-test-")
    try:
        code = launch_command([*launch_args, "-m", "fabric_lite.cli.selftest", "--workdir", workdir])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if code == 0:
        print("All checks passed.")
    else:
        print("Some checks failed (see above).", file=sys.stderr)
    return code


def _launch(args: List[str]) -> int:
    from fabric_lite.cli.launch_command import launch_command

    return launch_command(args)


def _explain(args: List[str]) -> int:
    from fabric_lite.cli.explain import explain_command

    return explain_command(args)


COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "launch": _launch, "explain": _explain, "env": _env, "config": _config, "test": _test,
    "consolidate": _consolidate, "merge-weights": _merge_weights,
    "estimate-memory": lambda args: _lazy("estimate", "estimate_command", args),
    "tpu-config": lambda args: _lazy("tpu", "tpu_command", args),
}


def _lazy(module: str, function: str, args: List[str]) -> int:
    """Run `function` of fabric_lite.cli.`module`, imported only when its command runs."""
    import importlib

    return getattr(importlib.import_module(f"fabric_lite.cli.{module}"), function)(args)


def one_line(text: str) -> str:
    """`text` as one line: terminal colour codes out, its lines joined, torch's paragraph on a refused unpickling
    cut down to what was refused."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return _cut_torch_refusal(" ".join(line.strip() for line in text.splitlines() if line.strip()))


def _cut_torch_refusal(text: str) -> str:
    """torch's UnpicklingError for what weights_only loading refuses is a paragraph of advice around one fact
    ("Unsupported global: GLOBAL mod.Class ..."): keep the fact and what follows torch's paragraph."""
    start = text.find("Weights only load failed.")
    mark = text.find("WeightsUnpickler error: ", max(start, 0))
    if start < 0 or mark < 0:
        return text
    rest = text[mark + len("WeightsUnpickler error: "):]
    ends = [i for i in (rest.find(" Please use "), rest.find(" Check the documentation of torch.load")) if i >= 0]
    fact = rest[:min(ends)] if ends else rest
    link = rest.find("torch.load.html")
    after = rest[link + len("torch.load.html"):].lstrip(".") if link >= 0 else rest[len(fact):]
    if not ends:
        return text[:start] + fact
    return f"{text[:start]}{fact.rstrip('. ')}{'.' if after.strip() else ''}{after}"


def refused_object(err: BaseException) -> str:
    """What safe loading refused, from torch's long UnpicklingError."""
    return one_line(str(err)).rstrip(". ")


def expected_failure(err: BaseException) -> Optional[str]:
    """The one-line message of a failure a command can meet in ordinary use (a bad value, a path that cannot be
    used, a checkpoint that cannot be read, a file safe loading refuses), or None for anything else: a bug,
    which keeps its traceback."""
    import pickle

    if isinstance(err, pickle.UnpicklingError):
        return (f"a file holds objects that safe loading (weights_only=True) refuses ({refused_object(err)}); "
                f"load it only if you trust where it came from.")
    if isinstance(err, (ValueError, OSError)):
        return one_line(str(err)) or type(err).__name__
    from fabric_lite.checkpoint.files import CheckpointError

    if isinstance(err, CheckpointError):
        return one_line(str(err))
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    run = COMMANDS.get(command)
    if run is None:
        print(f"fabric-lite: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return run(rest)
    except Exception as err:  # one place for every command: what a user can fix is one line, not a traceback
        message = expected_failure(err)
        if message is None:
            raise
        print(f"fabric-lite {command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
