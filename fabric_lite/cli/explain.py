"""`fabric-lite explain`: run a script in one process up to its first prepare(loader) / fit and print the plan."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Mapping, Optional, Sequence

from fabric_lite.explain.request import mark_explained, was_explained


# -- `fabric-lite explain` -------------------------------------------------------------------------

def _flag_given(argv: Sequence[str], script: str, *names: str) -> bool:
    """Whether one of the flag `names` appears on the command line before the script."""
    head = list(argv)[:list(argv).index(script)] if script in argv else list(argv)
    return any(tok == n or tok.startswith(n + "=") for tok in head for n in names)


def _error(message: str) -> int:
    print(f"fabric-lite explain: error: {message}", file=sys.stderr)
    return 2


def explain_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> int:
    """`fabric-lite explain [launch flags] train.py [args]`: the launch's plan from a one-process dry run."""
    import runpy

    from torch.distributed.run import determine_local_world_size

    from fabric_lite.strategies.environments import ENV_EXPLAIN, ENV_STRATEGY, detect_node_layout
    from fabric_lite.cli.launch_command import config_notice, parse_with_config
    from fabric_lite.cli.launch_flags import launch_command_parser, replica_runtime, resolve_accelerate_flags
    from fabric_lite.launch.launch_checks import check_launch, check_script, nodes_said
    from fabric_lite.launch.launcher import free_port
    from fabric_lite.launch.worker_env import patched_environ, settings_env

    env = os.environ if env is None else env
    parser = launch_command_parser()
    parser.prog = "fabric-lite explain"
    parser.description = (
        "Print the plan of a launch without running it: world size and node layout, strategy, precision, how "
        "data is sharded, the effective global batch, where checkpoints go, and settings given twice or ignored. "
        "Takes every `fabric-lite launch` flag; the script runs in ONE process up to its first "
        "Accelerator.prepare(...) with a dataloader or Trainer.fit(...), then stops with status 0. "
        "Example: fabric-lite explain --nproc-per-node 2 --mixed-precision bf16 train.py --epochs 3"
    )
    parser.add_argument(
        "--rehearse", action="store_true",
        help="Go on past the plan: run ONE real training step of the script as rank 0 of the whole planned world "
             "(e.g. --num_processes 512) on torch's fake process group, in this one process, and print the bytes "
             "rank 0 holds (parameters, gradients, optimizer state) and the collectives the step issues. The "
             "strategy builds its real mesh for that world: layouts that cannot work fail here, before any "
             "machine is used.")
    argv = list(argv)
    try:  # `flags`: the command line alone, to tell a flag from a config default
        flags, args, config_path, config = parse_with_config(parser, argv, env)
    except ValueError as err:  # a config file (ConfigError) or a cluster engine's variables that cannot be used
        return _error(str(err))
    total = args.num_processes  # (Accelerate's total over every machine; resolved into --nproc-per-node below)
    try:
        worker_env, ignored = resolve_accelerate_flags(args, config)
    except ValueError as err:
        return _error(f"{err} (the real launch would stop here too)")
    runtime = replica_runtime(args)
    if runtime is not None:  # (a runtime that starts its own replicas: not torchrun's plan)
        return _error(runtime.EXPLAIN_REFUSAL)
    try:
        check_launch(args)
        settings: Dict[str, Optional[str]] = dict(settings_env(args.mixed_precision, args.gradient_accumulation_steps,
                                                                args.cpu))
        settings.update(worker_env)
        per_node = determine_local_world_size(str(args.nproc_per_node))
    except ValueError as err:
        return _error(f"{err} (the real launch would stop here too)")
    if args.no_python:
        return _error("--no-python: explain runs a Python script (or -m module) in this interpreter.")
    try:
        check_script(args)
    except ValueError as err:
        return _error(str(err))
    script = args.training_script
    nnodes_spec = "1" if args.standalone else nodes_said(args.nnodes)  # torchrun's default "1:1" is 1
    nodes = int(nnodes_spec.split(":")[-1])
    in_file = "the config file"
    origins: Dict[str, str] = {}
    if args.mixed_precision is not None:
        origins["mixed_precision"] = (f"--mixed-precision {flags.mixed_precision}" if flags.mixed_precision is not None
                                      else f"{in_file} (mixed_precision: {args.mixed_precision})")
    if args.gradient_accumulation_steps is not None:
        origins["gradient_accumulation_steps"] = (
            f"--gradient-accumulation-steps {flags.gradient_accumulation_steps}"
            if flags.gradient_accumulation_steps is not None
            else f"{in_file} (gradient_accumulation_steps: {args.gradient_accumulation_steps})")
    origins["cpu"] = "--cpu" if flags.cpu else f"{in_file} (use_cpu: true)"
    if args.strategy is not None:
        settings[ENV_STRATEGY] = args.strategy
        origins["strategy"] = (f"--strategy {flags.strategy}" if flags.strategy is not None
                               else f"{in_file} (strategy: {args.strategy})")
    if config is not None:
        print(config_notice("fabric-lite explain", config_path, config), file=sys.stderr)
    if ignored:
        print(f"fabric-lite explain: ignoring Accelerate flags that have no meaning here: {', '.join(ignored)}",
              file=sys.stderr)

    layout = detect_node_layout()  # a cluster engine's variables win over the config file (parse_with_config)

    def where(flag: str, key: str, value: Any) -> str:
        if _flag_given(argv, script, flag, flag.replace("-", "_").replace("__", "--")):
            return f"{flag} {value}"
        if layout is not None and (key == "nnodes" or (key == "nproc_per_node" and layout.nproc_per_node)):
            return f"{layout.source}'s variables ({flag} {value})"
        return f"{in_file} ({key}: {value})" if config is not None else f"the default {flag} {value}"

    if total is not None and not _flag_given(argv, script, "--nproc-per-node", "--nproc_per_node"):
        total_origin = (f"--num_processes {total}" if _flag_given(argv, script, "--num-processes", "--num_processes")
                        else f"{in_file} (num_processes: {total})")
        nproc_origin = f"{total_origin} over {nnodes_spec} machine(s) = {args.nproc_per_node} per machine"
    else:
        nproc_origin = where("--nproc-per-node", "nproc_per_node", args.nproc_per_node)
    if str(args.nproc_per_node) != str(per_node):
        nproc_origin += f" = {per_node}"
    nnodes_origin = (f"--num_machines {nnodes_spec}" if _flag_given(argv, script, "--num-machines", "--num_machines")
                     else where("--nnodes", "nnodes", nnodes_spec))
    source = f"torchrun, as `fabric-lite launch` would start it ({nproc_origin}, {nnodes_origin})"
    if ":" in nnodes_spec:
        source += f"; an elastic range of nodes: planned with the maximum, {nodes}"
    request = {
        "nproc_per_node": per_node, "nnodes": nodes, "source": source, "origins": origins,
        "nproc_origin": nproc_origin, "nnodes_origin": nnodes_origin,
        "config": str(config_path) if config_path is not None else None,
        "master": (f"{args.master_addr}:{args.master_port or '<port>'} (this machine is node {args.node_rank})"
                   if nodes > 1 else None),
    }
    world = per_node * nodes if args.rehearse else 1
    if args.rehearse:
        request["rehearse"] = world
    # This process plays rank 0 of a one-process torchrun job (a 'ddp' strategy can start its group of one), or,
    # rehearsing, rank 0 of the whole world on the fake process group started below.
    settings.update({ENV_EXPLAIN: json.dumps(request), "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0",
                     "LOCAL_WORLD_SIZE": str(per_node if args.rehearse else 1), "GROUP_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": None,
                     "TORCHELASTIC_RUN_ID": None})
    if args.rehearse:
        from fabric_lite.explain import rehearsal

        try:
            rehearsal.start_fake_world(world)
        except RuntimeError as err:
            return _error(str(err))
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    mark_explained(False)
    code: Any = 0
    try:
        # Accelerator and Trainer see the planned launch in the environment: they record their arguments
        # (`explain_arguments`) and leave the devices / nodes checks to the plan.
        with patched_environ(settings):
            sys.argv = [script, *args.training_script_args]
            try:
                if args.module:
                    sys.path.insert(0, os.getcwd())
                    runpy.run_module(script, run_name="__main__", alter_sys=True)
                else:
                    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                code = exc.code
            except Exception:  # the script's own error: its traceback, as `python train.py` shows it
                import traceback

                traceback.print_exc()
                return 1
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        if args.rehearse:
            rehearsed = rehearsal.finish()
            rehearsal.end_fake_world()
    if args.rehearse and (rehearsed is None or rehearsed.report is None) and code in (0, None):
        print(rehearsal.no_step_message(script), file=sys.stderr)
        return 1
    if was_explained():
        return 0 if code in (0, None) else (code if isinstance(code, int) else 1)
    status = code if code not in (None,) else 0
    print(f"fabric-lite explain: {script} ended (status {status}) without calling Accelerator.prepare(...) with a "
          f"dataloader or Trainer.fit(...): there was nothing to explain, and what it did ran for real.",
          file=sys.stderr)
    return status if isinstance(status, int) and status != 0 else 1
