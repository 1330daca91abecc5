"""The plan: its sections, the parts both doors share, and the Accelerator's plan (Trainer: trainer_plan.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from fabric_lite.accelerator.accelerator import Accelerator
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

from fabric_lite.explain.request import mark_explained, planned_request, rehearsal_world, requested
from fabric_lite.explain.shares import Share, loader_share

SECTIONS = ("Hardware and processes", "Precision", "Data", "Optimization", "Checkpoints and logs",
            "Set twice or ignored")
_HW, _PREC, DATA_SECTION, OPT_SECTION, CKPT_SECTION, CONFLICTS_SECTION = SECTIONS


class Plan:
    """The plan: a header, then (label, value) lines grouped in `SECTIONS`."""

    def __init__(self, header: Sequence[str] = ()) -> None:
        self.header: List[str] = list(header)
        self.sections: Dict[str, List[Tuple[str, str]]] = {name: [] for name in SECTIONS}

    def add(self, section: str, label: str, value: Any) -> None:
        self.sections[section].append((label, str(value)))

    def lines(self) -> List[Tuple[str, str]]:
        """Every (label, value) line, in order."""
        return [line for name in SECTIONS for line in self.sections[name]]

    def value(self, label: str) -> Optional[str]:
        """The value of the first line with this label (None if there is none)."""
        return next((v for k, v in self.lines() if k == label), None)

    def format(self) -> str:
        width = max([len(k) for k, _ in self.lines()] + [10]) + 2
        out = list(self.header)
        for name in SECTIONS:
            out += ["", name]
            lines = self.sections[name] or [("(none found)" if name == CONFLICTS_SECTION else "(nothing)", "")]
            out += [f"  {label:<{width}}{value}".rstrip() for label, value in lines]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()


# -- switched on by the environment ---------------------------------------------------------------

def explain_accelerator(accelerator: "Accelerator") -> None:
    """The hook in `Accelerator.prepare`: under `fabric-lite explain`, print the plan and exit 0; under
    `fabric-lite explain --rehearse`, print it and go on to the first optimizer step (explain/rehearsal.py)."""
    if not requested():
        return
    world = rehearsal_world()
    if world is not None:
        from fabric_lite.explain.rehearsal import active, rehearse

        if active() is None:
            mark_explained()
            print(plan_for_accelerator(accelerator).format(), flush=True)
            rehearse(accelerator, world)
        return
    mark_explained()
    if accelerator.is_main_process:
        print(plan_for_accelerator(accelerator).format(), flush=True)
    raise SystemExit(0)


def explain_trainer(trainer: "Trainer", module: "TrainModule", ckpt_path: Optional[str] = None) -> bool:
    """The hook in `Trainer.fit`: print the plan on rank 0; under `fabric-lite explain` exit 0 (`--rehearse`: go on
    to the first optimizer step). Returns whether fit() goes on to train (only when rehearsing)."""
    exit_after = requested()
    mark_explained()
    if trainer.is_global_zero:
        from fabric_lite.explain.trainer_plan import plan_for_trainer

        print(plan_for_trainer(trainer, module, ckpt_path).format(), flush=True)
    world = rehearsal_world() if exit_after else None
    if world is not None:  # `--rehearse`: fit goes on to its first optimizer step
        from fabric_lite.explain.rehearsal import rehearse

        rehearse(trainer, world)
        return True
    if exit_after:
        raise SystemExit(0)
    return False


# -- the planned world ------------------------------------------------------------------------------

@dataclass
class _Layout:
    world: int
    per_node: int
    nodes: int
    source: str
    dry_run: bool
    problems: List[Tuple[str, str]] = field(default_factory=list)


def given_arguments(obj: Any) -> Optional[Dict[str, Any]]:
    """The constructor arguments recorded for `obj` under `fabric-lite explain` (None otherwise)."""
    return getattr(obj, "explain_arguments", None)


def planned_layout(accelerator: "Accelerator", trainer: Optional["Trainer"] = None) -> _Layout:
    from fabric_lite.strategies.connector import check_devices
    from fabric_lite.strategies.environments import ProcessInfo

    process = accelerator.strategy.process
    request = planned_request()
    if "nproc_per_node" not in request:
        return _Layout(process.world_size, process.local_world_size, process.num_nodes, process.source, False)
    per_node, nodes = int(request["nproc_per_node"]), int(request["nnodes"])
    source = str(request.get("source", "fabric-lite launch (torchrun)"))
    layout = _Layout(per_node * nodes, per_node, nodes, source, True)
    acc_given = given_arguments(accelerator) or {}
    devices = acc_given.get("devices")
    if trainer is not None:
        t_given = given_arguments(trainer) or {}
        t_devices, num_nodes = t_given.get("devices", "auto"), t_given.get("num_nodes", 1)
        if isinstance(t_devices, int) and not isinstance(t_devices, bool) and t_devices > 1 and layout.world == 1:
            # trainer.relaunch.relaunch_if_needed: the script starts itself again under torch.distributed.run
            return _Layout(t_devices * num_nodes, t_devices, num_nodes,
                           f"torch.distributed.run, started by Trainer(devices={t_devices}) itself "
                           f"(the launcher started one process)", True)
        if num_nodes != nodes:
            layout.problems.append((
                "num_nodes",
                f"Trainer(num_nodes={num_nodes}) disagrees with the launch ({nodes} node(s), "
                f"{request.get('nnodes_origin', 'nnodes')}): "
                f"the real run stops in Trainer(). Make them match."))
    if devices is not None and devices != "auto":
        planned = ProcessInfo(world_size=layout.world, local_world_size=per_node, source="fabric-lite launch")
        try:
            check_devices(devices, accelerator.device.type, planned)
        except ValueError as err:
            layout.problems.append(("devices", f"devices={devices!r} vs {per_node} process(es) per node "
                                               f"({request.get('nproc_origin', 'nproc_per_node')}): the real "
                                               f"run stops with: {err}"))
    return layout


def _strategy_line(accelerator: "Accelerator", layout: _Layout) -> Tuple[str, Optional[Tuple[str, str]]]:
    """The strategy the real run uses, and a problem line if it would refuse to start."""
    from fabric_lite.strategies import Strategy, create_strategy
    from fabric_lite.strategies.registry import runs_one_process

    strategy = accelerator.strategy
    planned_strategy: Strategy = strategy  # the one the real run builds
    problem = None
    if layout.dry_run and layout.world != strategy.world_size:
        requested_strategy = (given_arguments(accelerator) or {}).get("strategy", "auto")
        launch_strategy = accelerator.run_config.launch.strategy
        if requested_strategy == "auto" and launch_strategy:
            requested_strategy = launch_strategy
        if isinstance(requested_strategy, Strategy):
            planned_strategy = requested_strategy
        else:
            try:
                planned_strategy = create_strategy(str(requested_strategy), layout.world)
            except ValueError:
                pass
        names = planned_strategy.traits.names
        if names and runs_one_process(names[0]) and layout.world > 1:
            problem = ("strategy (argument)",
                       f"{type(planned_strategy).__name__} with {layout.world} processes: the real run refuses it "
                       f"(independent copies would not exchange gradients). Use 'ddp' or 'auto'.")
    name = type(planned_strategy).__name__
    group = planned_strategy.process_group
    if group is not None:  # a strategy with a torch.distributed process group of its own (DDP, FSDP, DeepSpeed)
        planned = "nccl" if accelerator.device.type == "cuda" else "gloo"
        backend = group.backend if planned_strategy is strategy else planned
        name += f" (process group backend {backend})"
    return name, problem


# -- building the plan -----------------------------------------------------------------------------

_PRECISION_WORDS = {
    "32-true": "full fp32",
    "16-mixed": "float16 autocast, fp32 weights, loss scaled by a GradScaler",
    "bf16-mixed": "bfloat16 autocast, fp32 weights",
    "bf16-true": "weights and inputs in bfloat16",
    "fp8": "float8 matrix products in the eligible nn.Linear layers (torchao, or TransformerEngine by its recipe), "
           "bfloat16 autocast elsewhere, fp32 weights",
}


def header_lines(layout: _Layout, door: str) -> List[str]:
    if layout.dry_run:
        return [f"fabric-lite explain: the plan of this run. This is a dry run in one process: the script ran up to "
                f"its first {door}, nothing was trained or written. The real launch would start {layout.world} "
                f"process(es); the data lines are rank 0's share."]
    return [f"fabric-lite explain: the plan of this run ({door}); set up as for training, nothing was trained "
            f"or written."]


def hardware_lines(plan: Plan, accelerator: "Accelerator", layout: _Layout) -> None:
    device = accelerator.device
    strategy_name, problem = _strategy_line(accelerator, layout)
    plan.add(_HW, "accelerator", device.type)
    where = f"{device} (rank 0)"
    if device.type == "cuda":
        where += "; each process uses cuda:<its local rank>"
    plan.add(_HW, "device", where)
    plan.add(_HW, "strategy", strategy_name)
    plan.add(_HW, "world size", layout.world)
    plan.add(_HW, "processes per node", layout.per_node)
    plan.add(_HW, "nodes", layout.nodes)
    plan.add(_HW, "ranks from", layout.source)
    request = planned_request()
    if layout.dry_run and request.get("master"):
        plan.add(_HW, "rendezvous", request["master"])
    if layout.dry_run and request.get("config"):
        plan.add(_HW, "config file", request["config"])
    if problem:
        layout.problems.append(problem)
    for label, text in layout.problems:
        plan.add(CONFLICTS_SECTION, label, text)
    layout.problems.clear()


def precision_lines(plan: Plan, accelerator: "Accelerator", trainer: Optional["Trainer"]) -> None:
    from fabric_lite.strategies.precision import resolve_precision

    precision = accelerator.strategy.precision
    plan.add(_PREC, "precision", f"{precision.name} ({_PRECISION_WORDS.get(precision.name, precision.name)})")
    launch = accelerator.run_config.launch
    origin = setting_origin("mixed_precision", launch.mixed_precision)
    given = (given_arguments(accelerator) or {}).get("mixed_precision")
    if trainer is not None:
        argument = f"Trainer(precision={str((given_arguments(trainer) or {}).get('precision', precision.name))!r})"
    else:
        argument = f"Accelerator(mixed_precision={given!r})"
    if launch.mixed_precision is None:
        if trainer is not None or given is not None:
            decided = argument
        elif given_arguments(accelerator) is not None or precision.name == "32-true":
            decided = "the default (no launcher setting, no argument)"
        else:
            decided = "the Accelerator argument"
        plan.add(_PREC, "decided by", decided)
        return
    launched = resolve_precision(launch.mixed_precision)
    if launched != precision.name:
        plan.add(_PREC, "decided by", f"{argument}, over {origin}")
        if trainer is not None:
            plan.add(CONFLICTS_SECTION, "mixed_precision",
                     f"{origin} is ignored: the Trainer always passes its own precision ({argument}); "
                     f"set Trainer(precision={launched!r}) instead.")
        else:
            plan.add(CONFLICTS_SECTION, "mixed_precision",
                     f"set twice: {argument} wins over {origin}; the run uses {precision.name}.")
    elif trainer is not None or given is not None:
        plan.add(_PREC, "decided by", f"{argument} and {origin} (they agree)")
        plan.add(CONFLICTS_SECTION, "mixed_precision", f"set twice, same value: {argument} and {origin}.")
    else:
        plan.add(_PREC, "decided by", origin)


def setting_origin(key: str, value: Any) -> str:
    """Where a launcher setting came from, in words."""
    origins = planned_request().get("origins", {})
    if key in origins:
        return str(origins[key])
    from fabric_lite.strategies.environments import ENV_GRAD_ACCUM, ENV_MIXED_PRECISION, ENV_STRATEGY, ENV_USE_CPU

    name = {"mixed_precision": ENV_MIXED_PRECISION, "gradient_accumulation_steps": ENV_GRAD_ACCUM,
            "cpu": ENV_USE_CPU, "strategy": ENV_STRATEGY}[key]
    return f"the launcher ({name}={value})"


def data_lines(plan: Plan, name: str, loader: Any, world: int, limit: Any = None,
                evaluation: bool = False) -> Share:
    from fabric_lite.trainer import loops

    share = loader_share(loader, world)
    inner = getattr(getattr(loader, "_batch_sampler", None), "batch_sampler", None)
    sampler = getattr(inner, "sampler", inner)
    dataset = getattr(loader, "dataset", None)
    dataset = getattr(dataset, "dataset", dataset) if share.iterable else dataset
    order = {"RandomSampler": "shuffled (RandomSampler, reseeded every epoch, same order on every rank)",
             "SequentialSampler": "in order (SequentialSampler)"}.get(type(sampler).__name__, type(sampler).__name__)
    if share.iterable:
        order = "an IterableDataset, read in chunks of world x batch"
    size = f"{share.dataset_len} samples" if share.dataset_len is not None else "length unknown"
    plan.add(DATA_SECTION, name if name.startswith("loader") else f"{name} loader",
             f"{type(dataset).__name__}, {size}, {order}")
    if share.error:
        plan.add(DATA_SECTION, f"{name}: sharding", f"fails with {world} processes: {share.error}")
        plan.add(CONFLICTS_SECTION, f"sharding ({name})", f"the real run stops in prepare(): {share.error}")
        return share
    if share.unbatched:
        plan.add(DATA_SECTION, f"{name}: per-process batch", "none (batch_size=None: one sample at a time)")
    else:
        per = "set by the loader's batch_sampler" if share.batch is None else share.batch
        if share.split and share.batch is not None:
            per = f"{per} (split_batches=True: each loader batch of {share.batch * world} is cut in {world})"
        plan.add(DATA_SECTION, f"{name}: per-process batch", per)
    if share.batches is not None:
        text = f"{share.batches} per epoch"
        if world > 1:
            text += f" (rank 0 of {world})"
        run = loops.batch_limit(limit, share.batches) if limit is not None else None
        if run is not None and run != share.batches:
            text += f"; {'limit_val_batches' if evaluation else 'limit_train_batches'}={limit!r} runs {run}"
        plan.add(DATA_SECTION, f"{name}: batches per process", text)
    if share.samples is not None:
        plan.add(DATA_SECTION, f"{name}: samples per process", f"{share.samples} per epoch")
    plan.add(DATA_SECTION, f"{name}: end of epoch", _tail_words(share, evaluation))
    workers = getattr(loader, "num_workers", 0)
    if workers:
        plan.add(DATA_SECTION, f"{name}: workers", f"{workers} loader worker process(es) per rank")
    return share


def _tail_words(share: Share, evaluation: bool) -> str:
    if share.dataset_len is None or share.batch is None and not share.unbatched:
        if share.drop_last:
            return "drop_last=True: an incomplete last batch is dropped"
        return "unknown (no dataset length)" if share.dataset_len is None else "set by the loader's batch_sampler"
    if share.dropped:
        return f"drop_last=True: {share.dropped} sample(s) are left out every epoch"
    if share.padded:
        return (f"{share.padded} sample(s) repeated so every rank gets whole batches in the last step "
                f"(even_batches=True)")
    if share.uneven:
        note = " (evaluation: every sample exactly once)" if evaluation else ""
        return f"no padding (even_batches=False): ranks get unequal shares of the last step{note}"
    if share.world == 1 and share.dataset_len and share.batch and share.dataset_len % share.batch:
        return f"the last batch holds {share.dataset_len % share.batch} sample(s) (one process: no padding)"
    return "no padding: every batch is whole"


def optimizer_lines(plan: Plan, optimizers: Sequence[Any], schedulers: Sequence[Tuple[Any, str]]) -> None:
    names = []
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        lrs = sorted({g.get("lr") for g in inner.param_groups if "lr" in g}, key=str)
        names.append(f"{type(inner).__name__}(lr={', '.join(map(str, lrs))})" if lrs else type(inner).__name__)
    plan.add(OPT_SECTION, "optimizers", ", ".join(names) if names else "none prepared yet")
    if schedulers:
        plan.add(OPT_SECTION, "schedulers", ", ".join(f"{type(s).__name__} {when}" for s, when in schedulers))


def model_line(plan: Plan, models: Sequence[Any], accelerator: "Accelerator") -> None:
    if not models:
        return
    words = []
    for model in models:
        inner = accelerator.unwrap_model(model)
        # the Trainer's step runner (FSDP renames the class it shards: FSDPStepRunner)
        inner = getattr(inner, "module", inner) if type(inner).__name__.endswith("StepRunner") else inner
        # ZeRO-3 leaves each parameter empty between uses; its full size is kept in `ds_numel`
        count = sum(getattr(p, "ds_numel", p.numel()) for p in inner.parameters())
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in inner.parameters() if p.requires_grad)
        words.append(f"{type(inner).__name__} ({count:,} parameters, {trainable:,} trainable)")
    plan.add(_HW, "model", "; ".join(words))


def strategy_lines(plan: Plan, accelerator: "Accelerator", models: Sequence[Any], optimizers: Sequence[Any],
                   layout: _Layout) -> None:
    """What the strategy says about itself (FSDP: the sharded blocks, dtypes, bytes per process)."""
    sections = {"hardware": _HW, "precision": _PREC}
    for section, label, text in accelerator.strategy.explain_lines(models, optimizers, layout.world):
        plan.add(sections.get(section, _HW), label, text)


def effective_value(plan: Plan, share: Optional[Share], world: int, accumulation: int, what: str,
                    mesh_shape: Any = None, strategy: Any = None) -> None:
    """The samples per optimizer step; with an N-D layout (`RunConfig.mesh_shape`, or a strategy running in the
    planned world with fewer data-parallel processes than processes), only the data-parallel processes read
    different samples (a tensor-parallel group reads one batch)."""
    if share is None or share.batch is None:
        plan.add(OPT_SECTION, "effective global batch", "unknown (no per-process batch size)")
        return
    replicas, who = world, "process(es)"
    if mesh_shape is not None and mesh_shape.total > 1:
        replicas, who = mesh_shape.dp, f"data-parallel process(es) (of {world}; tp={mesh_shape.tp})"
    elif strategy is not None and strategy.world_size == world and strategy.dp_size < world:
        replicas, who = strategy.dp_size, f"data-parallel process(es) (of {world})"
    total = share.batch * replicas * accumulation
    plan.add(OPT_SECTION, "effective global batch",
             f"{total} = {share.batch} per process x {replicas} {who} x {accumulation} accumulation "
             f"(samples per optimizer step{what})")


def plan_for_accelerator(accelerator: "Accelerator") -> Plan:
    """The plan of a raw-loop run, from an Accelerator that has prepared its objects."""
    layout = planned_layout(accelerator)
    plan = Plan(header_lines(layout, "Accelerator.prepare(...) with a dataloader"))
    launch = accelerator.run_config.launch
    given = given_arguments(accelerator)
    hardware_lines(plan, accelerator, layout)
    model_line(plan, accelerator.models, accelerator)
    precision_lines(plan, accelerator, None)
    strategy_lines(plan, accelerator, accelerator.models, accelerator.optimizers, layout)

    shares = [data_lines(plan, f"loader {i + 1}", loader, layout.world)
              for i, loader in enumerate(accelerator.dataloaders)]

    steps = accelerator.gradient_accumulation_steps
    plugin = accelerator.gradient_accumulation_plugin
    if launch.gradient_accumulation_steps is not None and launch.gradient_accumulation_steps != steps:
        source = "the Accelerator argument, over " + setting_origin("gradient_accumulation_steps",
                                                             launch.gradient_accumulation_steps)
        plan.add(CONFLICTS_SECTION, "gradient_accumulation_steps",
                 f"set twice: gradient_accumulation_steps={steps} (Accelerator argument or plugin) wins over "
                 f"{setting_origin('gradient_accumulation_steps', launch.gradient_accumulation_steps)}.")
    elif launch.gradient_accumulation_steps is not None:
        source = setting_origin("gradient_accumulation_steps", launch.gradient_accumulation_steps)
        if given is not None and given.get("gradient_accumulation_steps") is not None:
            plan.add(CONFLICTS_SECTION, "gradient_accumulation_steps",
                     f"set twice, same value: Accelerator(gradient_accumulation_steps={steps}) and {source}.")
    elif steps != 1:
        source = "the Accelerator argument"
    else:
        source = "the default"
    optimizer_lines(plan, accelerator.optimizers,
                [(s.scheduler, "(steps with the optimizer)" if accelerator.step_scheduler_with_optimizer else "")
                 for s in accelerator.schedulers])
    plan.add(OPT_SECTION, "gradient accumulation",
             f"{steps} batch(es) per optimizer step (from {source}); it applies inside "
             f"`with accelerator.accumulate(model):`" + (", and gradients also sync at each loader's last batch"
                                                          if plugin.sync_with_dataloader and steps > 1 else ""))
    first = shares[0] if shares else None
    effective_value(plan, first, layout.world, steps, ", loader 1" if len(shares) > 1 else "",
                    accelerator.run_config.mesh_shape, accelerator.strategy)
    if first is not None and first.batches is not None:
        per_epoch = math.ceil(first.batches / steps) if plugin.sync_with_dataloader else first.batches // steps
        plan.add(OPT_SECTION, "optimizer steps per epoch", f"{per_epoch} (if every batch of loader 1 is one micro-step)")
    plan.add(OPT_SECTION, "gradient clipping", "whatever the script calls (accelerator.clip_grad_norm_ / clip_grad_value_); "
                                        "the Accelerator sets none")

    project = accelerator.project_configuration
    plan.add(CKPT_SECTION, "project_dir", project.project_dir or "not set")
    if project.automatic_checkpoint_naming and project.project_dir:
        root = f"{os.fspath(project.project_dir).rstrip('/')}/checkpoints"
        keep = f", keeping the newest {project.total_limit}" if project.total_limit is not None else ""
        plan.add(CKPT_SECTION, "checkpoints", f"save_state() writes {root}/checkpoint_{project.iteration}, then _"
                                       f"{project.iteration + 1}, ... (automatic naming{keep})")
    elif project.automatic_checkpoint_naming:
        plan.add(CKPT_SECTION, "checkpoints", "automatic_checkpoint_naming=True but no project_dir: save_state() without a "
                                       "path fails")
        plan.add(CONFLICTS_SECTION, "automatic_checkpoint_naming", "has no effect without a project_dir")
    else:
        plan.add(CKPT_SECTION, "checkpoints", "wherever the script passes save_state(output_dir) (automatic naming is off)")
    log_with = accelerator.log_with
    if log_with is None:
        plan.add(CKPT_SECTION, "trackers", "none (log_with not set)")
    else:
        where = f"under {accelerator.logging_dir}/<project name>" if accelerator.logging_dir else \
            "no logging_dir: init_trackers() fails for file-based trackers"
        plan.add(CKPT_SECTION, "trackers", f"{log_with!r}, started by init_trackers(), {where}")

    accelerator_conflicts(plan, accelerator, layout, launch)
    return plan


def accelerator_conflicts(plan: Plan, accelerator: "Accelerator", layout: _Layout, launch: Any) -> None:
    """Settings given twice (launcher vs argument) or accepted and ignored, common to both doors."""
    given = given_arguments(accelerator) or {}
    if given.get("rng_types") is not None:
        plan.add(CONFLICTS_SECTION, "rng_types", f"rng_types={given['rng_types']!r} is accepted for compatibility and "
                                          f"ignored: dataloader order is always seeded and the same on every rank.")
    if launch.use_cpu and str(given.get("accelerator", "auto")) not in ("auto", "cpu"):
        plan.add(CONFLICTS_SECTION, "cpu", f"{setting_origin('cpu', '1')} wins over accelerator={given['accelerator']!r}: "
                                    f"the run uses the CPU.")
    requested_strategy = given.get("strategy", "auto")
    if launch.strategy and isinstance(requested_strategy, str) and requested_strategy != "auto" \
            and requested_strategy != launch.strategy:
        plan.add(CONFLICTS_SECTION, "strategy (argument)", f"set twice: strategy={requested_strategy!r} (argument) wins over "
                                         f"{setting_origin('strategy', launch.strategy)}.")
    if given.get("dynamo_backend") not in (None, "no", "NO"):
        plan.add(_PREC, "torch.compile", f"backend {given['dynamo_backend']!r}")
    if accelerator.split_batches and layout.world == 1:
        plan.add(CONFLICTS_SECTION, "split_batches", "split_batches=True has no effect with one process.")
