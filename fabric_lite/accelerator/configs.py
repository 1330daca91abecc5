"""Configuration objects with Hugging Face Accelerate's names, so existing scripts keep working."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Union

__all__ = [
    "KwargsHandler", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
    "DataLoaderConfiguration", "ProjectConfiguration", "GradientAccumulationPlugin", "DeepSpeedPlugin",
    "strategy_from_handlers",
    "DistributedType",
]


class KwargsHandler:
    """Base of the `kwargs_handlers` dataclasses: `to_kwargs()` returns only the fields changed from default."""

    def to_kwargs(self) -> Dict[str, Any]:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keywords passed to `torch.nn.parallel.DistributedDataParallel`."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Keywords passed to `torch.amp.GradScaler` under fp16 mixed precision."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Process-group settings: backend (None picks gloo/nccl) and the collective timeout."""

    backend: Optional[str] = None
    init_method: Optional[str] = None
    timeout: Optional[datetime.timedelta] = None


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard: split each batch or hand out whole ones; pad the last step or not."""

    split_batches: bool = False
    even_batches: bool = True
    # On a GPU batches of tensors are copied asynchronously on a side stream anyway (transfer.py, CudaFeed);
    # this flag (Accelerate's) matters for other devices and for batches moved the plain way.
    non_blocking: bool = False
    use_seedable_sampler: bool = True  # accepted for compatibility: sampling is always seeded here


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
        strategy.gradient_clip_val = self.gradient_clipping
        return strategy


class DistributedType:
    """Accelerate's names for the kind of run, as plain strings (compare with ==)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    XLA = "XLA"


def strategy_from_handlers(name: str, handlers: Dict[type, Any], world_size: int) -> Any:
    """The strategy a name means, with the DDP and process-group kwargs handlers applied (or the name)."""
    from fabric_lite.strategies import create_strategy

    ddp, pg = handlers.get(DistributedDataParallelKwargs), handlers.get(InitProcessGroupKwargs)
    if ddp is None and pg is None:
        return name
    instance = create_strategy(name, world_size)
    if ddp is not None and hasattr(instance, "ddp_kwargs"):
        instance.ddp_kwargs.update(ddp.to_kwargs())
    if pg is not None:
        if pg.timeout is not None and hasattr(instance, "timeout"):
            instance.timeout = pg.timeout
        if pg.backend is not None and hasattr(instance, "process_group_backend"):
            instance.process_group_backend = pg.backend
    return instance
