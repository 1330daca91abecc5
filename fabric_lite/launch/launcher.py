"""Starting several processes: `fabric-lite launch` (over torch.distributed.run) and `notebook_launcher`.

Both use PyTorch's own elastic machinery; settings for the Accelerator travel as environment
variables that `environments.read_launch_settings` reads in each worker. `fabric-lite launch` takes
its defaults from the config file `fabric-lite config` wrote (see `config_file`); flags win.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import sys
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from fabric_lite.cli.parsing import CliParser
from fabric_lite.launch.config_file import (
    STRATEGIES, AccelerateConfig, ConfigError, LaunchConfigFile, deepspeed_strategy, find_config, load_config,
    read_deepspeed_json,
)
from fabric_lite.strategies.environments import (
    ENV_GRAD_ACCUM, ENV_LAUNCHED, ENV_MIXED_PRECISION, ENV_STRATEGY, ENV_USE_CPU, NodeLayout, detect_node_layout,
    read_xla_settings, torchrun_master_port,
)
from fabric_lite.launch.launch_checks import (
    LaunchError, check_capacity, check_launch, check_mixed_precision, check_script, check_xla_launch,
)
from fabric_lite.launch.lifeline import ENV_LAUNCHER_PID
from fabric_lite.strategies.precision import resolve_precision

__all__ = ["notebook_launcher", "launch_command_parser", "launch_command", "free_port", "torchrun_command",
           "resolve_accelerate_flags", "config_notice", "check_script"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(mixed_precision: Optional[str], gradient_accumulation_steps: Optional[int],
                  cpu: bool) -> Dict[str, str]:
    env: Dict[str, str] = {ENV_LAUNCHED: "1"}
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
def patched_environ(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (str) or remove (None) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Accelerate's `accelerate launch` flags that set nothing here: accepted (a command line written for
# Accelerate runs unchanged) and named in one line per run. (flag, takes a value)
IGNORED_ACCELERATE_FLAGS = (
    ("--quiet", False), ("--ipex", False), ("--use_xpu", False), ("--enable_cpu_affinity", False),
    ("--dynamo_backend", True), ("--dynamo_mode", True), ("--dynamo_use_fullgraph", False),
    ("--dynamo_use_dynamic", False), ("--dynamo_use_regional_compilation", False),
    ("--tpu_cluster", False), ("--tpu_use_cluster", False), ("--no_tpu_cluster", False), ("--tpu_use_sudo", False),
    ("--vm", True), ("--env", True), ("--downcast_bf16", False),
    ("--gradient_clipping", True), ("--zero3_init_flag", True), ("--zero3_save_16bit_model", True),
    ("--offload_optimizer_nvme_path", True), ("--offload_param_nvme_path", True), ("--deepspeed_hostfile", True),
    ("--deepspeed_exclusion_filter", True), ("--deepspeed_inclusion_filter", True),
    ("--deepspeed_multinode_launcher", True), ("--deepspeed_moe_layer_cls_names", True),
    ("--fsdp_offload_params", True), ("--fsdp_min_num_params", True), ("--fsdp_sharding_strategy", True),
    ("--fsdp_auto_wrap_policy", True), ("--fsdp_transformer_layer_cls_to_wrap", True),
    ("--fsdp_backward_prefetch_policy", True), ("--fsdp_backward_prefetch", True), ("--fsdp_state_dict_type", True),
    ("--fsdp_forward_prefetch", True), ("--fsdp_use_orig_params", True), ("--fsdp_cpu_ram_efficient_loading", True),
    ("--fsdp_sync_module_states", True), ("--fsdp_activation_checkpointing", True), ("--fsdp_version", True),
    ("--fsdp_reshard_after_forward", True),
    ("--megatron_lm_tp_degree", True), ("--megatron_lm_pp_degree", True), ("--megatron_lm_num_micro_batches", True),
    ("--megatron_lm_sequence_parallelism", True), ("--megatron_lm_recompute_activations", True),
    ("--megatron_lm_use_distributed_optimizer", True), ("--megatron_lm_gradient_clipping", True),
    ("--fp8_backend", True), ("--fp8_use_autocast_during_eval", False), ("--fp8_margin", True),
    ("--fp8_interval", True), ("--fp8_format", True), ("--fp8_amax_history_len", True),
    ("--fp8_amax_compute_algo", True), ("--fp8_override_linear_precision", True), ("--fp8_opt_level", True),
    ("--aws_access_key_id", True), ("--aws_secret_access_key", True),
    ("--mpirun_hostfile", True), ("--mpirun_ccl", True),
)
# Values of an ignored flag that ask for nothing (`--dynamo_backend no`): not worth a notice.
_INERT_VALUES = ("", "no", "none", "false", "0", "default")
_IGNORED_PREFIX = "ignored_"


def launch_command_parser() -> CliParser:
    """torchrun's own flags, Accelerate's spellings of them, and fabric_lite's settings.

    Every torchrun flag works unchanged (same names, same defaults). Only the options before the
    training script are read; the script's own arguments reach it untouched."""
    from torch.distributed.run import get_args_parser

    parser = CliParser(
        prog="fabric-lite launch", parents=[get_args_parser()], add_help=False,
        script="training_script", script_args="training_script_args",
        usage="%(prog)s [options] training_script [training_script_args ...]",
        description=(
            "Start a training script on one or many processes (a front over torch.distributed.run; all of its "
            "flags work, and so do `accelerate launch`'s). Example: fabric-lite launch --nproc-per-node 2 train.py "
            "--epochs 3. Defaults come from the config file that `fabric-lite config` writes (else from Accelerate's "
            "default_config.yaml); flags given here win over it. Every flag takes dashes or underscores "
            "(--num-processes, --num_processes); nothing after the script is read here."),
    )
    # No port given: None (then _free_port_rendezvous), as torch >= 2.13 does; older torch says 29500.
    # torchrun's PET_MASTER_PORT still gives the default.
    parser.set_defaults(master_port=torchrun_master_port())
    group = parser.add_argument_group("fabric_lite settings (read by Accelerator() in each worker)")
    group.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                       help="YAML file of defaults: one `fabric-lite config` wrote, or Accelerate's (default: "
                            "fabric_lite's, else $HF_HOME/accelerate/default_config.yaml, if any).")
    group.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=False,
                       help="Train on CPU even where a GPU is present (--no-cpu overrides a config's use_cpu).")
    group.add_argument("--mixed-precision", "--mixed_precision", default=None,
                       help="no | fp16 | bf16 | fp8 (or 32-true, 16-mixed, bf16-mixed, bf16-true). fp8 needs an NVIDIA "
                            "GPU of compute capability 8.9+ (H100, L4, ...): refused before the workers start where "
                            "this machine has none.")
    group.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=int, default=None)
    group.add_argument("--oversubscribe", action="store_true", default=False,
                       help="Start more processes per node than the machine has GPUs (or CPU cores, on CPUs).")
    group.add_argument("--strategy", default=None, choices=STRATEGIES,
                       help="What Accelerator(strategy='auto') / Trainer(strategy='auto') become in the workers.")
    acc = parser.add_argument_group(
        "Accelerate's flags (`accelerate launch ...` works as `fabric-lite launch ...`)",
        "Flags of `accelerate launch` that mean nothing here (--ipex, --dynamo_backend, --fsdp_*, --fp8_*, "
        "--megatron_lm_*, --tpu_cluster, ...) are accepted, and named in one line when given.")
    acc.add_argument("--num-processes", "--num_processes", type=int, default=None, metavar="N",
                     help="Processes over EVERY machine, as Accelerate counts: --nproc-per-node becomes "
                          "N / --num-machines. With --tpu: XLA replicas to start (default: every device).")
    acc.add_argument("--num-machines", "--num_machines", dest="nnodes", default=argparse.SUPPRESS, metavar="N",
                     help="= --nnodes")
    acc.add_argument("--machine-rank", "--machine_rank", dest="node_rank", type=int, default=argparse.SUPPRESS,
                     metavar="RANK", help="= --node-rank")
    acc.add_argument("--main-process-ip", "--main_process_ip", dest="master_addr", default=argparse.SUPPRESS,
                     metavar="ADDR", help="= --master-addr")
    acc.add_argument("--main-process-port", "--main_process_port", dest="master_port", type=int,
                     default=argparse.SUPPRESS, metavar="PORT", help="= --master-port")
    acc.add_argument("--use-cpu", "--use_cpu", dest="cpu", action="store_const", const=True,
                     default=argparse.SUPPRESS, help="= --cpu")
    acc.add_argument("--multi-gpu", "--multi_gpu", action="store_true", default=False,
                     help="Processes on GPUs with DDP (what a launch of several processes does anyway); without "
                          "--num_processes, one process per GPU.")
    acc.add_argument("--gpu-ids", "--gpu_ids", default=None, metavar="IDS",
                     help="GPUs the workers may use, e.g. 0,1 (CUDA_VISIBLE_DEVICES); 'all': every one.")
    acc.add_argument("--num-cpu-threads-per-process", "--num_cpu_threads_per_process", type=int, default=None,
                     metavar="N", help="OMP_NUM_THREADS in each worker.")
    acc.add_argument("--same-network", "--same_network", action="store_true", default=False,
                     help="Accepted; the machines meet at --main_process_ip:--main_process_port either way.")
    acc.add_argument("--use-deepspeed", "--use_deepspeed", action="store_true", default=False,
                     help="= --strategy deepspeed (with --zero_stage N: deepspeed_stage_N).")
    acc.add_argument("--deepspeed-config-file", "--deepspeed_config_file", default=None, metavar="JSON",
                     help="Implies --use_deepspeed; its zero_optimization.stage / offload and "
                          "gradient_accumulation_steps are read, the rest is not.")
    acc.add_argument("--zero-stage", "--zero_stage", type=int, default=None, choices=(0, 1, 2, 3))
    acc.add_argument("--offload-optimizer-device", "--offload_optimizer_device", default=None, metavar="DEVICE",
                     help="cpu / nvme: the _offload variant of the DeepSpeed stage.")
    acc.add_argument("--offload-param-device", "--offload_param_device", default=None, metavar="DEVICE",
                     help="cpu / nvme: the _offload variant of DeepSpeed stage 3.")
    acc.add_argument("--use-fsdp", "--use_fsdp", action="store_true", default=False, help="= --strategy fsdp")
    acc.add_argument("--use-megatron-lm", "--use_megatron_lm", action="store_true", default=False,
                     help="Refused: fabric_lite has no Megatron-LM.")
    acc.add_argument("--debug", action="store_true", default=False,
                     help="Print the launcher's own traceback too when a worker fails.")
    for flag, takes_value in IGNORED_ACCELERATE_FLAGS:
        dest = _IGNORED_PREFIX + flag[2:]
        names = ["-q", flag] if flag == "--quiet" else [flag]
        if takes_value:
            acc.add_argument(*names, dest=dest, default=None, action="append", help=argparse.SUPPRESS)
        else:
            acc.add_argument(*names, dest=dest, action="store_true", default=False, help=argparse.SUPPRESS)
    xla = parser.add_argument_group("XLA / TPU (torch_xla's launcher instead of torchrun)")
    xla.add_argument("--tpu", action="store_true", default=False,
                     help="Start XLA replicas with torch_xla's launcher (implied by --strategy xla / xla_spmd). "
                          "With PJRT_DEVICE=CPU, --nproc-per-node (or --num-processes) sets how many.")
    xla.add_argument("--main-training-function", "--main_training_function", default=None, metavar="NAME",
                     help="Call this function of the script in each replica instead of running it as __main__.")
    return parser


# The namespace attributes fabric_lite adds to torchrun's; removed before torchrun's run() sees them.
def _own_attributes(args: argparse.Namespace) -> List[str]:
    from torch.distributed.run import get_args_parser

    torchrun = set(vars(get_args_parser().parse_args(["x"])))
    return [name for name in vars(args) if name not in torchrun]


def _config_defaults(config: LaunchConfigFile, env: Mapping[str, str]) -> Dict[str, Any]:
    """Parser defaults from a config file; torchrun's PET_* variables, where set, still win (and so does a cluster
    engine's node layout: `_layout_defaults`)."""
    values: Dict[str, Any] = {
        "nproc_per_node": str(config.nproc_per_node), "nnodes": str(config.nnodes), "node_rank": config.node_rank,
        "master_addr": config.master_addr, "master_port": config.master_port,
    }
    if isinstance(config, AccelerateConfig):
        if config.num_processes is not None:  # Accelerate's total: divided by the final --nnodes
            values["num_processes"] = config.num_processes
        if config.rdzv_backend is not None:
            values["rdzv_backend"] = config.rdzv_backend
    values = {k: v for k, v in values.items()
              if f"PET_{k.upper()}" not in env and not (k == "num_processes" and "PET_NPROC_PER_NODE" in env)}
    values.update(mixed_precision=config.mixed_precision, cpu=config.use_cpu,
                  gradient_accumulation_steps=config.gradient_accumulation_steps, strategy=config.strategy)
    if isinstance(config, AccelerateConfig):
        values.update(tpu=config.tpu, main_training_function=config.main_training_function, gpu_ids=config.gpu_ids)
    return values


def _layout_defaults(layout: Optional[NodeLayout], env: Mapping[str, str]) -> Dict[str, Any]:
    """Parser defaults from the nodes a cluster engine describes (SkyPilot's variables: `detect_node_layout`).

    Like torchrun's PET_* variables they describe the machines this launch runs on, so they win over a config
    file's values (which always name a layout, one machine on 127.0.0.1 unless edited) and lose to flags. A PET_*
    variable that is set still gives its own setting (torchrun's parser read it already)."""
    if layout is None:
        return {}
    values: Dict[str, Any] = {"nnodes": str(layout.nnodes), "node_rank": layout.node_rank,
                              "master_addr": layout.master_addr, "master_port": layout.master_port}
    if layout.nproc_per_node is not None:
        values["nproc_per_node"] = str(layout.nproc_per_node)
    return {k: v for k, v in values.items() if v is not None and f"PET_{k.upper()}" not in env}


def config_notice(command: str, config_path: Any, config: Optional[LaunchConfigFile]) -> str:
    """The one stderr line that says which config file a launch uses (and, for Accelerate's, what of it is
    ignored)."""
    if isinstance(config, AccelerateConfig):
        line = f"{command}: using Accelerate config file {config_path}"
        if config.ignored:
            line += f"; ignored, no meaning here: {', '.join(config.ignored)}"
        return line
    return f"{command}: using config file {config_path}"


def _is_off(value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, list):
        return all(_is_off(v) for v in value)
    return isinstance(value, str) and value.strip().lower() in _INERT_VALUES


def _max_nodes(nnodes: Any, flag: str = "--nnodes") -> int:
    parts = str(nnodes).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise LaunchError(f"{flag}={nnodes!r} must be a number of machines (2) or a range MIN:MAX (1:4).")
    return int(parts[-1])


def resolve_accelerate_flags(args: argparse.Namespace, config: Optional[LaunchConfigFile] = None
                             ) -> Tuple[Dict[str, str], List[str]]:
    """Turn Accelerate's flags (and an Accelerate config's values among the defaults) into torchrun's and
    fabric_lite's settings, in `args`. Returns (environment variables for the workers, the Accelerate
    flags given that set nothing here). LaunchError for what no launch can run.

    --num_processes is the total over every machine (Accelerate's meaning): --nproc-per-node becomes
    num_processes / nnodes, for torchrun launches; for XLA launches (--tpu) it stays the replica count.
    A flag on the command line wins over the config file (--nproc-per-node over a config's num_processes)."""
    given = getattr(args, "command_line", frozenset())
    ignored = [flag for flag, _ in IGNORED_ACCELERATE_FLAGS
               if not _is_off(getattr(args, _IGNORED_PREFIX + flag[2:], None))]
    if args.use_megatron_lm:
        raise LaunchError("--use_megatron_lm: fabric_lite has no Megatron-LM; train with --use_fsdp or "
                          "--use_deepspeed instead.")
    if args.multi_gpu:
        for flag, on in (("--cpu", "cpu" in given and args.cpu), ("--tpu", args.tpu)):
            if on:
                raise LaunchError(f"--multi_gpu and {flag} ask for two different devices; pass one of them.")
        args.cpu = False  # over a config file's use_cpu
    _resolve_paradigm(args, given)
    xla = args.tpu or args.strategy in ("xla", "xla_spmd")
    if not xla:
        counted = "num_processes" in given or "nproc_per_node" not in given
        if args.num_processes is not None and counted:
            total = args.num_processes
            if total < 1:
                raise LaunchError(f"--num_processes={total} must be a whole number >= 1.")
            parts = str(args.nnodes).split(":")
            if len(parts) == 2 and parts[0].strip() != parts[1].strip():
                raise LaunchError(f"--num_processes counts processes over every machine, which an elastic range "
                                  f"--nnodes={args.nnodes} leaves open; give --nproc-per-node (per machine) instead.")
            machines = _max_nodes(args.nnodes)
            if machines < 1 or total % machines:
                raise LaunchError(f"--num_processes={total} is the total over {machines} machine(s) (--num_machines) "
                                  f"and must divide evenly among them; give a multiple of {machines}, or "
                                  f"--nproc-per-node for the count on each machine.")
            per_node = str(total // machines)
            if "nproc_per_node" in given and str(args.nproc_per_node).strip() != per_node:
                raise LaunchError(f"--num_processes={total} over {machines} machine(s) means {per_node} per machine, "
                                  f"but --nproc-per-node={args.nproc_per_node}; pass one of them.")
            args.nproc_per_node = per_node
        elif args.multi_gpu and config is None and not ({"nproc_per_node", "num_processes"} & given):
            import torch

            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                raise LaunchError("--multi_gpu without --num_processes starts one process per GPU, and this machine "
                                  "has none; pass --num_processes N (on CPUs: --cpu --num_processes N).")
            args.nproc_per_node = "gpu"
        args.num_processes = None
        if args.rdzv_backend != "static" and not args.rdzv_endpoint and not args.standalone \
                and args.master_port is not None and _max_nodes(args.nnodes) > 1:
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"  # where Accelerate's machines meet
    env: Dict[str, str] = {}
    if args.gpu_ids is not None and args.gpu_ids.strip().lower() not in ("", "all") and not args.cpu:
        ids = [i for i in args.gpu_ids.replace(" ", "").split(",") if i]
        nproc = str(args.nproc_per_node).strip()
        if nproc.isdigit() and int(nproc) > len(ids) and not args.oversubscribe:
            raise LaunchError(f"--gpu_ids {args.gpu_ids} names {len(ids)} GPU(s) for {nproc} processes per machine; "
                              f"name more GPUs, start fewer processes, or pass --oversubscribe.")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if args.num_cpu_threads_per_process is not None:
        if args.num_cpu_threads_per_process < 1:
            raise LaunchError(f"--num_cpu_threads_per_process={args.num_cpu_threads_per_process} must be >= 1.")
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    return env, ignored


def _resolve_paradigm(args: argparse.Namespace, given: frozenset) -> None:
    """--use_deepspeed (--zero_stage, --offload_*_device, --deepspeed_config_file) / --use_fsdp -> --strategy."""
    deepspeed = args.use_deepspeed or args.deepspeed_config_file is not None or args.zero_stage is not None
    if deepspeed and args.use_fsdp:
        raise LaunchError("--use_deepspeed and --use_fsdp ask for two different strategies; pass one of them.")
    if deepspeed:
        stage, steps = args.zero_stage, None
        offload_optimizer = str(args.offload_optimizer_device or "none").lower() in ("cpu", "nvme")
        offload_params = str(args.offload_param_device or "none").lower() in ("cpu", "nvme")
        if args.deepspeed_config_file is not None:
            try:
                found = read_deepspeed_json(args.deepspeed_config_file)
            except ConfigError as err:
                raise LaunchError(f"--deepspeed_config_file: {err}") from None
            stage = found.get("stage", stage) if stage is None else stage
            offload_optimizer = offload_optimizer or found["offload_optimizer"]
            offload_params = offload_params or found["offload_params"]
            steps = found.get("gradient_accumulation_steps")
        try:
            name, _ = deepspeed_strategy(stage, offload_optimizer, offload_params, "--zero_stage")
        except ConfigError as err:
            raise LaunchError(str(err)) from None
        wanted, flag = name, "--use_deepspeed"
        if steps is not None and "gradient_accumulation_steps" not in given:
            args.gradient_accumulation_steps = steps
    elif args.use_fsdp:
        wanted, flag = "fsdp", "--use_fsdp"
    else:
        return
    if "strategy" in given and args.strategy is not None:
        family = "deepspeed" if wanted.startswith("deepspeed") else wanted
        if not args.strategy.startswith(family):
            raise LaunchError(f"{flag} asks for strategy {wanted}, but --strategy {args.strategy}; pass one of them.")
        return  # the explicit --strategy (a variant of the same family) wins
    args.strategy = wanted


def _free_port_rendezvous(args: argparse.Namespace) -> None:
    """One machine and no port given: meet on a port the OS picks (c10d rendezvous at localhost:0).

    torch >= 2.13 does this itself; older torch would take port 29500, or fail on a port of None."""
    if args.master_port is None and args.rdzv_backend == "static" and not args.rdzv_endpoint \
            and not args.standalone and int(str(args.nnodes).split(":")[-1]) == 1:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:  # several machines: torch's usual port
        args.master_port = 29500


def _error(message: str) -> int:
    print(f"fabric-lite launch: error: {message}", file=sys.stderr)
    return 2


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str]) -> tuple:
    """(flags alone, flags over the defaults, the config's path or None, the config or None).
    Raises ConfigError for a config file that cannot be used, ValueError for a cluster engine's variables that
    cannot be right. The config is fabric_lite's (`--config-file`, else the default one), else Accelerate's
    default one (`config_file.find_config`).

    What wins, first to last: flags; the cluster's own variables (torchrun's PET_*, which a Kubeflow TrainJob sets,
    and SkyPilot's node layout: `_layout_defaults`); the config file; torchrun's defaults."""
    argv = list(argv)
    flags = parser.parse_args(argv)
    layout = _layout_defaults(detect_node_layout(env), env)
    config_path = find_config(flags.config_file, env)
    config = load_config(config_path) if config_path is not None else None
    defaults = _config_defaults(config, env) if config is not None else {}
    if "nproc_per_node" in layout:  # the node's own count, over an Accelerate config's total
        defaults.pop("num_processes", None)
    defaults.update(layout)
    if not defaults:
        return flags, flags, config_path, config
    parser.set_defaults(**defaults)
    return flags, parser.parse_args(argv), config_path, config  # again: flags on the command line win


def launch_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> int:
    """`fabric-lite launch`: config file defaults, then flags; checks; then torchrun."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from fabric_lite.launch.preemption import EXIT_PREEMPTED

    env = os.environ if env is None else env
    parser = launch_command_parser()
    try:
        _, args, config_path, config = parse_with_config(parser, argv, env)
    except ValueError as err:  # a config file (ConfigError) or a cluster engine's variables that cannot be used
        return _error(str(err))
    suffix = f" (defaults from config file {config_path})" if config_path is not None else ""
    try:
        worker_env, ignored = resolve_accelerate_flags(args, config)
        check_mixed_precision(args, config)
        xla = args.tpu or args.strategy in ("xla", "xla_spmd")  # torch_xla's launcher, with checks of its own
        if xla:
            check_xla_launch(args)
        else:
            if args.main_training_function is not None:
                raise LaunchError("--main-training-function applies to XLA launches (--tpu); torchrun's processes "
                                  "run the script as __main__.")
            check_launch(args)
            check_capacity(args.nproc_per_node, args.cpu, args.oversubscribe)
            _free_port_rendezvous(args)
        settings = settings_env(args.mixed_precision, args.gradient_accumulation_steps, args.cpu)
        settings[ENV_LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (lifeline.py)
    except ValueError as err:
        return _error(f"{err}{suffix}")
    try:
        check_script(args)
    except LaunchError as err:
        return _error(str(err))
    if args.strategy is not None:
        settings[ENV_STRATEGY] = args.strategy
    settings.update(worker_env)
    if config_path is not None:
        print(config_notice("fabric-lite launch", config_path, config), file=sys.stderr)
    if ignored:
        print(f"fabric-lite launch: ignoring Accelerate flags that have no meaning here: {', '.join(ignored)}",
              file=sys.stderr)
    if xla:
        return _launch_xla(args, settings)
    debug = args.debug
    for name in _own_attributes(args):
        delattr(args, name)
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


def _launch_xla(args: argparse.Namespace, settings: Dict[str, str]) -> int:
    from fabric_lite.launch.xla_launch import launch_xla_script

    replicas = check_xla_launch(args)
    return launch_xla_script(args.training_script, args.training_script_args, replicas, settings,
                             args.main_training_function, spmd=args.strategy == "xla_spmd")


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
    the function runs right here. Where PJRT_DEVICE is set, XLA replicas run it, started by torch_xla's
    launcher (on XLA's CPU device `num_processes` of them; on a TPU one per device).
    """
    import torch

    env = settings_env(mixed_precision, None, False)
    if read_xla_settings().names_device:  # PJRT_DEVICE is set: XLA replicas, started by torch_xla's launcher
        from fabric_lite.launch.xla_launch import launch_xla_function

        return launch_xla_function(function, args, num_processes, env, start_method=start_method)
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
