"""The flags of `fabric-lite launch` (torchrun's, fabric_lite's settings, and `accelerate launch`'s, TPU ones
included: the one file that holds Accelerate's launch flag names) and their resolution into torchrun's settings
and the workers' environment (`resolve_accelerate_flags`)."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from fabric_lite.cli.parsing import CliParser
from fabric_lite.launch.config_file import (
    STRATEGIES, ConfigError, LaunchConfigFile, deepspeed_strategy, read_deepspeed_json,
)
from fabric_lite.launch.launch_checks import LaunchError
from fabric_lite.strategies.environments import ENV_USE_PARALLELISM, PARALLELISM_PREFIX, torchrun_master_port

__all__ = ["IGNORED_ACCELERATE_FLAGS", "launch_command_parser", "resolve_accelerate_flags", "replica_runtime",
           "refuse_replica_flags"]

# Accelerate's `accelerate launch` flags that set nothing here: accepted (a command line written for
# Accelerate runs unchanged) and named in one line per run. (flag, takes a value)
_PARALLEL_DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp")
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
    acc.add_argument("--use-parallelism-config", "--use_parallelism_config", action="store_true", default=False,
                     help="N-D parallelism: Accelerator() in each worker builds ParallelismConfig(dp_replicate_size, "
                          "dp_shard_size, tp_size) from the sizes below (1 where not given).")
    for dimension in _PARALLEL_DIMENSIONS:
        acc.add_argument(f"--parallelism-config-{dimension.replace('_', '-')}-size",
                         f"--parallelism_config_{dimension}_size", type=int, default=None, metavar="N",
                         help="Implies --use_parallelism_config." if dimension == "dp_replicate" else argparse.SUPPRESS)
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
    replicas = parser.add_argument_group("XLA / TPU (torch_xla's launcher instead of torchrun)")
    replicas.add_argument("--tpu", action="store_true", default=False,
                     help="Start XLA replicas with torch_xla's launcher (implied by --strategy xla / xla_spmd). "
                          "With PJRT_DEVICE=CPU, --nproc-per-node (or --num-processes) sets how many.")
    replicas.add_argument("--main-training-function", "--main_training_function", default=None, metavar="NAME",
                     help="Call this function of the script in each replica instead of running it as __main__.")
    return parser



def replica_runtime(args: argparse.Namespace) -> Optional[ModuleType]:
    """The launch module of the device runtime that starts its own replicas, where the flags ask for it (its
    `asked_for(args)`: --tpu, or one of its strategies; the registry's `register_runtime` names the module); None
    for a launch over torchrun."""
    from fabric_lite.strategies.registry import runtime_launcher, runtimes

    for entry in runtimes():
        module = runtime_launcher(entry.name)
        if module.asked_for(args):
            return module
    return None


def refuse_replica_flags(args: argparse.Namespace) -> None:
    """Refuse, for a launch over torchrun, the flags that only a replica launch (--tpu) reads."""
    if args.main_training_function is not None:
        raise LaunchError("--main-training-function applies to XLA launches (--tpu); torchrun's processes "
                          "run the script as __main__.")

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
    num_processes / nnodes, for torchrun launches; for a runtime's replica launch (--tpu) it stays the replica count.
    A flag on the command line wins over the config file (--nproc-per-node over a config's num_processes)."""
    given: frozenset = getattr(args, "command_line", frozenset())
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
    if replica_runtime(args) is None:
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
    env.update(_parallelism_env(args))
    return env, ignored


def _parallelism_env(args: argparse.Namespace) -> Dict[str, str]:
    """--use_parallelism_config and its sizes -> Accelerate's variables, which Accelerator() reads in each worker;
    sizes that cannot lay out the processes are refused here, before any starts."""
    sizes = {d: getattr(args, f"parallelism_config_{d}_size", None) for d in _PARALLEL_DIMENSIONS}
    if not getattr(args, "use_parallelism_config", False) and all(v is None for v in sizes.values()):
        return {}
    for dimension, value in sizes.items():
        if value is not None and value < 1:
            raise LaunchError(f"--parallelism_config_{dimension}_size={value} must be a whole number >= 1.")
    resolved = {d: v or 1 for d, v in sizes.items()}
    if resolved["cp"] > 1:
        raise LaunchError(f"--parallelism_config_cp_size={resolved['cp']}: context parallelism is not supported by "
                          f"fabric_lite; leave it at 1.")
    from fabric_lite.strategies.mesh_shape import MeshShape

    try:  # (a layout the workers would refuse: said once, here)
        MeshShape(dp_replicate=resolved["dp_replicate"], dp_shard=resolved["dp_shard"], tp=resolved["tp"])
    except ValueError as err:
        raise LaunchError(f"--parallelism_config_*_size: {err}") from err
    total = resolved["dp_replicate"] * resolved["dp_shard"] * resolved["tp"]
    if total == 1:  # nothing to lay out: every process a data-parallel replica, as Accelerate does then
        return {}
    per_node, ends = str(args.nproc_per_node).strip(), {part.strip() for part in str(args.nnodes).split(":")}
    nodes = ends.pop() if len(ends) == 1 else ""  # (an elastic range MIN:MAX leaves the count open)
    if per_node.isdigit() and nodes.isdigit() and int(per_node) * int(nodes) != total:
        raise LaunchError(
            f"The parallelism sizes multiply to {total} processes (dp_replicate {resolved['dp_replicate']} x dp_shard "
            f"{resolved['dp_shard']} x tp {resolved['tp']}), but this launch starts {int(per_node) * int(nodes)} "
            f"({per_node} per machine on {nodes}); make them agree.")
    env = {ENV_USE_PARALLELISM: "true"}
    env.update({f"{PARALLELISM_PREFIX}{d.upper()}_SIZE": str(v) for d, v in resolved.items()})
    return env


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

