"""Configuration objects with Hugging Face Accelerate's names, so existing scripts keep working: the kwargs
handlers (`KwargsHandler` and its subclasses), the plugins and configurations, and `strategy_from_handlers`.

The enums these take (`DistributedType`, `LoggerType`, ...) live in `fabric_lite.accelerator.enums`; they are
importable from here too, as Accelerate's scripts and older code import them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional, Sequence, Union

from fabric_lite.accelerator.enums import (  # (all but the hook type: re-exported, for the path scripts import)
    DDPCommunicationHookType, DistributedType, DynamoBackend, LoggerType, PrecisionType,
)

__all__ = [
    "KwargsHandler", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
    "DataLoaderConfiguration", "ProjectConfiguration", "GradientAccumulationPlugin", "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin", "TorchDynamoPlugin",
    "strategy_from_handlers",
    "DDPCommunicationHookType", "DistributedType", "LoggerType", "PrecisionType", "DynamoBackend",
]


class KwargsHandler:
    """Base of the `kwargs_handlers` dataclasses: `to_kwargs()` returns only the fields changed from default."""

    #: The Accelerator attribute a handler of this kind is kept under (`ddp_handler`, ...); None: none.
    accelerator_attribute: ClassVar[Optional[str]] = None
    if TYPE_CHECKING:  # (every handler is a dataclass: `fields(self)` reads its fields)
        __dataclass_fields__: ClassVar[Dict[str, Any]]

    def to_kwargs(self) -> Dict[str, Any]:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keywords passed to `torch.nn.parallel.DistributedDataParallel`, and the communication hook it reduces
    gradients with (Accelerate's fields)::

        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
                                      comm_wrapper=DDPCommunicationHookType.FP16,
                                      comm_state_option={"matrix_approximation_rank": 2})

    `comm_hook`: FP16/BF16 compress the all-reduced gradients, POWER_SGD approximates them (torch's hooks).
    `comm_wrapper` (FP16/BF16): casts the gradients a PowerSGD hook compresses. `comm_state_option`: keywords of
    torch's `PowerSGDState` (PowerSGD only). On one process nothing is all-reduced and the hook goes unused;
    strategies that reduce gradients their own way (FSDP, DeepSpeed, device runtimes) refuse a hook. Checked when built.
    """

    accelerator_attribute: ClassVar[str] = "ddp_handler"  # (Accelerator.ddp_handler)

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    #: The fields that choose the communication hook (registered after wrapping; not DDP constructor keywords).
    COMM_FIELDS: ClassVar[tuple] = ("comm_hook", "comm_wrapper", "comm_state_option")

    def __post_init__(self) -> None:
        self.comm_hook_spec()

    def to_kwargs(self) -> Dict[str, Any]:
        """The DistributedDataParallel keywords changed from their defaults (the hook's fields are not ones)."""
        return {k: v for k, v in super().to_kwargs().items() if k not in self.COMM_FIELDS}

    def comm_hook_spec(self) -> Any:
        """The hook these fields ask for, checked (a `fabric_lite.strategies.comm_hooks.CommHook`); the fields
        become `DDPCommunicationHookType` members. Raises, naming the field, for a bad value or combination."""
        from fabric_lite.strategies.comm_hooks import CommHook

        spec = CommHook(self.comm_hook, self.comm_wrapper, self.comm_state_option)
        self.comm_hook = DDPCommunicationHookType(spec.hook)
        self.comm_wrapper = DDPCommunicationHookType(spec.wrapper)
        return spec

    def register_comm_hook(self, model: Any) -> Any:
        """Register the hook on a `DistributedDataParallel` model (`prepare` does it); a model that is not one
        (one process) is left alone. Returns the hook's state (a PowerSGDState, else None)."""
        spec = self.comm_hook_spec()
        if not spec.enabled or not hasattr(model, "register_comm_hook"):
            return None
        return spec.register(model)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Keywords passed to `torch.amp.GradScaler` under fp16 mixed precision."""

    accelerator_attribute: ClassVar[str] = "scaler_handler"  # (Accelerator.scaler_handler)

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Process-group settings: backend (None picks gloo/nccl) and the collective timeout."""

    accelerator_attribute: ClassVar[str] = "init_handler"  # (Accelerator.init_handler)

    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[datetime.timedelta] = None


@dataclass
class DataLoaderConfiguration:
    """How `prepare` builds dataloaders (Accelerate's fields, defaults and meanings).

    - `split_batches`: each process gets a slice of every batch (the batch size must divide by the number of
      processes) instead of a whole batch of its own.
    - `dispatch_batches`: the main process alone reads the data and hands every process its part of each global
      batch (None: True for an IterableDataset, False otherwise). The parts are the ones the processes would read
      themselves, so the samples of each step do not depend on it.
    - `even_batches`: pad the last global step with samples from the epoch's start so that every process gets a
      batch of the same size (`gather_for_metrics` drops the padding); False gives each sample to one process.
    - `use_seedable_sampler`: a shuffling `RandomSampler` is replaced by one whose order in epoch e depends only on
      its seed and e (`data_seed`, or rank 0's `torch.initial_seed()` when None), not on how much the global RNG
      was used before.
    - `non_blocking`: copy batches to the device asynchronously (use with `pin_memory=True`). On a GPU batches
      of tensors go through a side stream anyway (data/transfer.py); this matters for other devices.
    - `use_stateful_dataloader`: the prepared loaders answer torchdata's `StatefulDataLoader` protocol:
      `state_dict()` mid-epoch, and `load_state_dict()` (or `load_state`) makes the next iteration go on with the
      remaining batches, without `skip_first_batches`. A prepared loader here keeps its position whether or not
      this is set (in global samples, with its generators' and workers' random states), so torchdata is not
      needed; a `StatefulDataLoader` given to `prepare` works too.
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (also done by `prepare`, after fields were changed); raises naming the bad one."""
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                     "use_stateful_dataloader", "dispatch_batches"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name == "dispatch_batches"):
                allowed = "True, False or None (None: True for an IterableDataset)" if name == "dispatch_batches" \
                    else "True or False"
                raise TypeError(f"DataLoaderConfiguration({name}={value!r}): pass {allowed}.")
        seed = self.data_seed
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or hasattr(seed, "dtype"):
                if hasattr(seed, "__index__") and not isinstance(seed, bool):
                    seed = self.data_seed = int(seed)  # a NumPy or torch integer
                else:
                    raise TypeError(f"DataLoaderConfiguration(data_seed={seed!r}): pass an integer seed "
                                    f"(or None: rank 0's torch.initial_seed()).")
            if not -(1 << 63) <= seed < (1 << 64):
                raise ValueError(f"DataLoaderConfiguration(data_seed={seed}): a torch generator takes seeds in "
                                 f"[-2**63, 2**64); pass a smaller integer.")


@dataclass
class ProjectConfiguration:
    """Where a run writes: logs, and checkpoints with automatic naming and a limit on how many are kept."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Accumulation settings: `num_steps` micro-batches per optimizer step; sync at the dataloader's end."""

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DeepSpeedPlugin:
    """Accelerate's way to ask for DeepSpeed: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))`.

    `hf_ds_config` is a DeepSpeed config (dict or JSON path); settings given here and there must agree.
    """

    hf_ds_config: Union[None, dict, str] = None
    gradient_accumulation_steps: Optional[int] = None
    gradient_clipping: Optional[float] = None
    zero_stage: Optional[int] = None
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    zero3_init_flag: bool = False  # accepted for compatibility: models are partitioned when prepared
    zero3_save_16bit_model: bool = False  # accepted: save_model() always gathers the whole model

    def to_strategy(self) -> Any:
        from fabric_lite.strategies.deepspeed import DeepSpeedStrategy

        for name in ("offload_optimizer_device", "offload_param_device"):
            if getattr(self, name) not in ("none", "cpu"):
                raise ValueError(f"DeepSpeedPlugin({name}={getattr(self, name)!r}): 'none' and 'cpu' are available.")
        strategy = DeepSpeedStrategy(stage=self.zero_stage, config=self.hf_ds_config,
                                     offload_optimizer=self.offload_optimizer_device == "cpu",
                                     offload_parameters=self.offload_param_device == "cpu")
        strategy.engine_step.gradient_clip_val = self.gradient_clipping
        return strategy


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's way to ask for FSDP: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]))``.

    Fields with Accelerate's names and meanings; FSDP2 (`fully_shard`) is what runs. `mixed_precision_policy`
    may be a `torch.distributed.fsdp.MixedPrecisionPolicy`, a dict of its fields, or a dtype name ("bf16").
    """

    fsdp_version: int = 2
    auto_wrap_policy: Any = None  # "transformer_based_wrap" | "size_based_wrap" | "no_wrap" | a callable
    transformer_cls_names_to_wrap: Optional[Sequence[str]] = None
    min_num_params: Optional[int] = None
    reshard_after_forward: Union[bool, str] = True  # also FSDP1's "FULL_SHARD" / "SHARD_GRAD_OP"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"
    mixed_precision_policy: Any = None
    cpu_ram_efficient_loading: bool = False  # accepted: meta-device models are materialized shard by shard
    sync_module_states: bool = True  # accepted: every process starts from the same weights (seeded, or loaded)
    use_orig_params: bool = True  # accepted: FSDP2 always keeps the original parameters' names

    def to_strategy(self) -> Any:
        from fabric_lite.strategies.fsdp import FSDPStrategy

        if self.fsdp_version != 2:
            raise ValueError(f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): fabric_lite runs "
                             f"FSDP2 (torch's fully_shard) only. Pass fsdp_version=2; the common fields mean the same.")
        reshard = self.reshard_after_forward
        if isinstance(reshard, str):
            table = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False}
            if reshard.upper() not in table:
                raise ValueError(f"reshard_after_forward={reshard!r}: pass True/False (or {sorted(table)}).")
            reshard = table[reshard.upper()]
        return FSDPStrategy(auto_wrap_policy=self._wrap_policy(), reshard_after_forward=bool(reshard),
                            cpu_offload=self.cpu_offload, activation_checkpointing=self.activation_checkpointing,
                            state_dict_type=self.state_dict_type, mixed_precision_policy=self._mp_policy())

    def _wrap_policy(self) -> Any:
        policy = self.auto_wrap_policy
        if callable(policy) or policy is None and self.transformer_cls_names_to_wrap is None:
            return policy
        name = str(policy or "transformer_based_wrap").lower()
        if name == "transformer_based_wrap":
            return list(self.transformer_cls_names_to_wrap or []) or None
        if name == "size_based_wrap":
            if not self.min_num_params:
                raise ValueError("auto_wrap_policy='size_based_wrap' needs min_num_params (e.g. 1e8).")
            limit = int(self.min_num_params)
            return lambda module: sum(p.numel() for p in module.parameters()) >= limit
        if name == "no_wrap":
            return lambda module: False
        raise ValueError(f"auto_wrap_policy={policy!r}: allowed values are 'transformer_based_wrap', "
                         f"'size_based_wrap', 'no_wrap' or a callable module -> bool.")

    def _mp_policy(self) -> Any:
        policy = self.mixed_precision_policy
        if policy is None or not isinstance(policy, (str, dict)):
            return policy
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                  "fp32": torch.float32, "float32": torch.float32, "no": torch.float32}
        if isinstance(policy, str):
            if policy.lower() not in dtypes:
                raise ValueError(f"mixed_precision_policy={policy!r}: pass one of {sorted(dtypes)}, a dict or a "
                                 f"MixedPrecisionPolicy.")
            dtype = dtypes[policy.lower()]
            return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        fields_: Dict[str, Any] = {k: dtypes.get(str(v).lower(), v) if isinstance(v, str) else v
                                   for k, v in policy.items()}
        return MixedPrecisionPolicy(**fields_)


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How `prepare` compiles models with `torch.compile`: ``Accelerator(dynamo_plugin=TorchDynamoPlugin(
    backend="inductor", mode="max-autotune"))``. `backend` None or "no" compiles nothing (as
    ``Accelerator(dynamo_backend=...)`` unset). `use_regional_compilation` compiles each block of the model's
    repeated layers (every `nn.ModuleList` of same-class blocks) in place instead of the whole model: the
    compile is shorter, and the blocks share one compiled code."""

    backend: Optional[str] = None
    mode: Optional[str] = None  # "default", "reduce-overhead", "max-autotune", ...
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Optional[Dict[str, Any]] = None
    disable: bool = False
    use_regional_compilation: bool = False

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"TorchDynamoPlugin(backend={self.backend!r}): pass a torch.compile backend name "
                            f"('inductor', 'eager', ...) or 'no'.")
        backend = "no" if self.backend is None else str(self.backend).strip().lower()
        if not backend:
            raise ValueError("TorchDynamoPlugin(backend=''): pass a torch.compile backend name or 'no'.")
        self.backend = backend

    @property
    def enabled(self) -> bool:
        """Whether `prepare` compiles at all."""
        return self.backend != "no" and not self.disable

    def compile_kwargs(self) -> Dict[str, Any]:
        """The keywords for `torch.compile` (only those set)."""
        kwargs: Dict[str, Any] = {"backend": self.backend}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.fullgraph:
            kwargs["fullgraph"] = True
        if self.dynamic is not None:
            kwargs["dynamic"] = self.dynamic
        if self.options is not None:
            kwargs["options"] = self.options
        return kwargs

    def compile(self, model: Any) -> Any:
        """`model` compiled as configured (the model itself when compilation is off)."""
        if not self.enabled:
            return model
        import torch

        kwargs = self.compile_kwargs()
        if self.use_regional_compilation and _compile_regions(model, kwargs):
            return model
        return torch.compile(model, **kwargs)


def _compile_regions(module: Any, kwargs: Dict[str, Any]) -> int:
    """Compile, in place, each block of every `nn.ModuleList` of two or more blocks of one class (not looking
    inside those blocks); returns how many were compiled (0: the model has no such repeated blocks)."""
    from torch import nn

    count = 0
    for child in module.children():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(block) for block in child}) == 1:
            for block in child:
                block.compile(**kwargs)
            count += len(child)
        else:
            count += _compile_regions(child, kwargs)
    return count


def strategy_from_handlers(name: Any, handlers: Dict[type, Any], world_size: int) -> Any:
    """The strategy a name means, with the DDP and process-group kwargs handlers applied (or the name).

    A Strategy instance (the user's, or a DeepSpeed/FSDP plugin's) keeps its own settings; only the DDP
    communication hook applies to it, and is refused where the strategy does not wrap models in DDP.
    """
    from fabric_lite.strategies import create_strategy
    from fabric_lite.strategies.comm_hooks import apply_comm_hook

    ddp, pg = handlers.get(DistributedDataParallelKwargs), handlers.get(InitProcessGroupKwargs)
    hook = ddp.comm_hook_spec() if ddp is not None else None
    if not isinstance(name, str):
        if hook is not None:
            apply_comm_hook(name, hook)
        return name
    if ddp is None and pg is None:
        return name
    instance = create_strategy(name, world_size)
    if hook is not None:
        apply_comm_hook(instance, hook)
    if ddp is not None and hasattr(instance, "ddp_kwargs"):
        instance.ddp_kwargs.update(ddp.to_kwargs())
    group = instance.process_group if pg is not None else None
    if pg is not None and group is not None:
        if pg.timeout is not None:
            group.timeout = pg.timeout
        if pg.backend is not None:
            group.requested_backend = pg.backend
    return instance
