"""DeepSpeed: ZeRO stages 0-3, optimizer and parameter offload, through the real `deepspeed` engine.

The engine owns the model, the optimizer, loss scaling, gradient partitioning and clipping. This
strategy builds its config from what the front door knows (micro-batch size, accumulation,
clipping, precision), merges the user's own config over it (refusing contradictions), and drives the
engine's accumulation boundary from the door's micro-step, so both doors accumulate exactly as they
do under DDP. Checkpoints go through `strategies/deepspeed_checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
from typing import Any, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fabric_lite._tree import tree_map
from fabric_lite.strategies.base import Traits
from fabric_lite.strategies.engine_step import EngineStep
from fabric_lite.strategies.parallel import ParallelStrategy
from fabric_lite.strategies.process_group import ProcessGroup, ProcessGroupSetting

__all__ = ["DeepSpeedStrategy", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'fabric-lite[deepspeed]'  (or: pip install deepspeed)"
_STAGES = (0, 1, 2, 3)
# fabric_lite precision -> the DeepSpeed config section that enables it (None: fp32).
_DS_PRECISION = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}


def _require_deepspeed(name: str) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"strategy {name!r} needs the deepspeed package, which is not installed. Run: {INSTALL_HINT}")


def _without_auto(config: Dict[str, Any]) -> Dict[str, Any]:
    """Hugging Face style configs say "auto" where the framework should fill a value in: leave those out."""
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in config.items() if v != "auto"}


def _merged(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, Any]:
    """`theirs` over `ours`, section by section (a user's {"bf16": {"loss_scale": 0}} keeps our "enabled")."""
    out = copy.deepcopy(ours)
    for key, value in theirs.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else copy.deepcopy(value)
    return out


def _read_config(config: Union[None, dict, str, os.PathLike]) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return _without_auto(copy.deepcopy(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ValueError(f"DeepSpeed config {path!r} does not exist. Pass a dict or the path of a JSON file.")
    with open(path) as f:
        text = f.read()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}. Fix the file or pass a dict.") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"DeepSpeed config {path} holds a {type(parsed).__name__}, not a JSON object.")
    return _without_auto(parsed)


class DeepSpeedStrategy(ParallelStrategy):
    """Train with DeepSpeed's engine (data parallel, ZeRO-partitioned state).

    Examples:
        >>> DeepSpeedStrategy(stage=3, offload_optimizer=True)              # doctest: +SKIP
        >>> DeepSpeedStrategy(config="ds_config.json")                      # doctest: +SKIP

    Names: "deepspeed" (stage 2), "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
    "deepspeed_stage_3", "deepspeed_stage_3_offload". Settings given both here (or by the front door:
    batch size, accumulation, clipping, precision) and in `config` must agree.
    """

    traits = Traits(names=("deepspeed",), accelerate_type="DEEPSPEED", syncs_gradients_per_forward=True)
    process_group: ProcessGroup
    engine_step: EngineStep
    #: The process group's settings, as strategy attributes (the constructor's names).
    process_group_backend = ProcessGroupSetting("requested_backend")
    timeout = ProcessGroupSetting("timeout")
    backend = ProcessGroupSetting("backend", writable=False)

    def __init__(
        self,
        stage: Optional[int] = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: Union[None, dict, str, os.PathLike] = None,
        process_group_backend: Optional[str] = None,
        timeout: Any = None,
        **zero_kwargs: Any,
    ) -> None:
        offload = "_offload" if offload_optimizer or offload_parameters else ""
        _require_deepspeed("deepspeed" if stage is None else f"deepspeed_stage_{stage}{offload}")
        super().__init__()
        self.process_group = ProcessGroup(self, process_group_backend, timeout, lone_group=True, name="deepspeed")
        #: The engine owns the step: joint set-up, the run's hints, the accumulation boundary.
        self.engine_step = EngineStep()
        from fabric_lite.strategies.deepspeed_checkpoint import DeepSpeedCheckpointFormat

        #: Model and optimizer state are written by the engine, one file per rank (see deepspeed_checkpoint.py).
        self.checkpoint_format = DeepSpeedCheckpointFormat(self)
        user = _read_config(config)
        if stage is None:
            stage = int(user.get("zero_optimization", {}).get("stage", 2))
        elif not isinstance(stage, int) or isinstance(stage, bool) or stage not in _STAGES:
            raise ValueError(f"DeepSpeed ZeRO stage={stage!r} is not valid: allowed values are 0, 1, 2, 3.")
        if offload_parameters and stage != 3:
            raise ValueError(f"offload_parameters=True needs ZeRO stage 3 (parameters are partitioned only "
                             f"there); this strategy has stage={stage}. Use stage=3 or drop the offload.")
        if offload_optimizer and stage == 0:
            raise ValueError("offload_optimizer=True needs ZeRO stage 1, 2 or 3; stage=0 keeps the optimizer whole.")
        self.stage = stage
        # ZeRO-3 gathers parameters inside every forward: all processes must run the same number of them.
        self.traits = type(self).traits.but(forward_is_collective=stage == 3)
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self.user_config = user
        self.zero_kwargs = zero_kwargs
        self.config: Dict[str, Any] = {}
        self.engine: Any = None
        self._dtype: Optional[torch.dtype] = None

    # -- what the front door knows (engine_step.set_run_hints) --------------------------------------
    def build_config(self) -> Dict[str, Any]:
        """The engine config: this strategy's settings, then the user's config over them."""
        precision = _DS_PRECISION[self.precision.name]
        hints = self.engine_step
        zero: Dict[str, Any] = {"stage": self.stage, **self.zero_kwargs}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.root_device.type == "cuda"}
        if self.offload_parameters:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.root_device.type == "cuda"}
        ours: Dict[str, Any] = {
            "train_micro_batch_size_per_gpu": hints.micro_batch_size or 1,
            "gradient_accumulation_steps": hints.accumulation_steps,
            "zero_optimization": zero,
            # The user's torch optimizer is kept, whatever it is (DeepSpeed otherwise refuses all but a few
            # under ZeRO) and under offload (DeepSpeedCPUAdam is optional, and compiles for minutes).
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,
        }
        # DeepSpeed clips at norm 1.0 unless told otherwise; here nothing is clipped unless asked for.
        ours["gradient_clipping"] = float(hints.gradient_clip_val) if hints.gradient_clip_val is not None else 0.0
        if precision is not None:
            ours[precision] = {"enabled": True}
            if precision == "fp16":
                ours["fp16"].update(loss_scale=0, initial_scale_power=16)  # dynamic, as torch's GradScaler
        user = self.user_config
        self._check_agreement(ours, user, precision)
        config = _merged(ours, user)
        # The door decides these; the user's config may only repeat them (checked above).
        config.pop("train_batch_size", None)
        return config

    def _check_agreement(self, ours: Dict[str, Any], user: Dict[str, Any], precision: Optional[str]) -> None:
        def clash(key: str, theirs: Any, mine: Any, source: str) -> ValueError:
            return ValueError(
                f"The DeepSpeed config sets {key}={theirs!r}, but {source} gives {mine!r}. Make them agree, or "
                f"leave {key} out of the config."
            )

        hints = self.engine_step
        mb = user.get("train_micro_batch_size_per_gpu")
        if mb is not None and hints.micro_batch_size is not None and mb != hints.micro_batch_size:
            raise clash("train_micro_batch_size_per_gpu", mb, hints.micro_batch_size, "the dataloader's batch_size")
        if mb is not None:
            ours["train_micro_batch_size_per_gpu"] = mb
        gas = user.get("gradient_accumulation_steps")
        if gas is not None and gas != hints.accumulation_steps:
            raise clash("gradient_accumulation_steps", gas, hints.accumulation_steps, "the front door's accumulation")
        total = user.get("train_batch_size")
        expected = ours["train_micro_batch_size_per_gpu"] * hints.accumulation_steps * self.world_size
        if total is not None and total != expected:
            raise clash("train_batch_size", total, expected,
                        f"micro-batch {ours['train_micro_batch_size_per_gpu']} x accumulation "
                        f"{hints.accumulation_steps} x {self.world_size} process(es)")
        clip = user.get("gradient_clipping")
        if clip is not None and hints.gradient_clip_val is not None and float(clip) != float(hints.gradient_clip_val):
            raise clash("gradient_clipping", clip, hints.gradient_clip_val, "gradient_clip_val")
        for key in ("fp16", "bf16"):
            section = user.get(key)
            if isinstance(section, dict) and "enabled" in section and bool(section["enabled"]) != (precision == key):
                raise clash(f"{key}.enabled", bool(section["enabled"]), self.precision.name, "precision")
        stage = user.get("zero_optimization", {}).get("stage")
        if stage is not None and stage != self.stage:
            raise clash("zero_optimization.stage", stage, self.stage, "the strategy")

    def _check_device_support(self) -> None:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        device = self.root_device.type
        if acc.device_name() != device:
            raise RuntimeError(
                f"DeepSpeed chose its {acc.device_name()!r} backend in this process (on its first use, or from "
                f"DS_ACCELERATOR), but this strategy trains on {device!r}. Set DS_ACCELERATOR={device} before "
                f"deepspeed is first imported, or train with accelerator={acc.device_name()!r}."
            )
        precision = _DS_PRECISION[self.precision.name]
        offload = " with offload" if (self.offload_optimizer or self.offload_parameters) else ""
        if precision == "fp16" and not acc.is_fp16_supported():
            raise ValueError(
                f"precision={self.precision.name!r}{offload}: DeepSpeed's {device} backend cannot train in "
                f"fp16. Use precision='bf16-mixed' or '32-true' here."
            )
        if precision == "bf16" and not acc.is_bf16_supported():
            raise ValueError(
                f"precision={self.precision.name!r}{offload}: DeepSpeed's {device} backend has no bf16 "
                f"here. Use precision='16-mixed' or '32-true'."
            )

    # -- set-up -------------------------------------------------------------------------------------
    def adapt_precision(self, precision: Any) -> Any:
        # The engine scales fp16 losses itself: torch's GradScaler must neither unscale its optimizer nor
        # show up as `accelerator.scaler`.
        precision.scaler = None
        return precision

    def setup_environment(self) -> None:
        p = self.process
        # DeepSpeed reads its place from the environment (and looks for MPI when it finds nothing).
        for key, value in (("RANK", p.global_rank), ("LOCAL_RANK", p.local_rank), ("WORLD_SIZE", p.world_size),
                           ("LOCAL_WORLD_SIZE", p.local_world_size), ("MASTER_ADDR", p.master_addr)):
            os.environ.setdefault(key, str(value))
        if self.root_device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.process_group.start()
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        if ds_logger.level < logging.WARNING:  # its INFO lines on every rank drown the user's output
            ds_logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False, dist_init_required=False,
                                   timeout=self.timeout)

    def setup(self, modules: Sequence[nn.Module], optimizers: Sequence[Any]) -> Tuple[List[nn.Module], List[Any]]:
        import deepspeed

        if len(modules) != 1:
            raise ValueError(
                f"DeepSpeedStrategy wraps one model together with its optimizer; prepare() got {len(modules)} "
                f"models. Pass exactly one model (and its optimizer) in one prepare() call."
            )
        module = modules[0]
        if len(optimizers) > 1:
            raise ValueError(f"DeepSpeed drives one optimizer per model; got {len(optimizers)}. Put the parameter "
                             f"groups into one optimizer.")
        if self.engine is not None:
            raise RuntimeError(
                "This DeepSpeed strategy already drives a model: its backward and step act on that engine. "
                "Prepare one model (with its optimizer) per Accelerator or Trainer; for a second model, or a "
                "second fit(), create a new one."
            )
        self._check_device_support()
        self.config = self.build_config()
        self._dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(_DS_PRECISION[self.precision.name] or "")
        if self._dtype is not None:
            _CastingHooks.install(module, self._dtype)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizers[0] if optimizers else None, config=self.config,
            dist_init_required=False,
        )
        # Checkpoints are published by checkpoint_io and consolidated by `fabric-lite consolidate`; the
        # engine's copy of its recovery scripts into the (staging) directory is not wanted.
        # (a private member of DeepSpeed's engine: it has no public switch for this copy)
        engine._copy_recovery_script = lambda *_: None
        self.engine = engine
        return [engine], ([optimizer] if optimizers else [])

    def setup_module(self, module: nn.Module) -> nn.Module:
        raise RuntimeError("DeepSpeed wraps the model together with its optimizer: prepare them in one call, "
                           "accelerator.prepare(model, optimizer, dataloader).")

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        return getattr(module, "module", module) if module is self.engine else module

    # -- the step -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: Optional[nn.Module] = None, **kwargs: Any) -> None:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(self.engine_step.boundary)
        # The doors scale the loss by the accumulation window themselves (its real length at an epoch's end).
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise ValueError("DeepSpeed's engine steps without a closure; call optimizer.step() with no arguments.")
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        return self.engine.was_step_applied()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip the gradient reduction: for the engine, backward passes inside do not close the accumulation
        window (where it reduces)."""
        return self.engine_step.micro_step() if enabled else contextlib.nullcontext()

    def force_backward_sync(self, module: nn.Module) -> ContextManager:
        return self.engine_step.closing_step()

    def clip_gradients(self, parameters: Iterable[torch.Tensor], optimizer: Any, *, max_norm: Optional[float] = None,
                       norm_type: float = 2.0, clip_value: Optional[float] = None) -> Optional[torch.Tensor]:
        """The engine clips by norm inside its step; this sets its limit. The norm is not known yet: returns None."""
        if clip_value is not None:
            raise ValueError("DeepSpeed clips gradients by norm only. Use gradient_clip_algorithm='norm' "
                             "(Trainer) or accelerator.clip_grad_norm_.")
        if max_norm is None:
            raise TypeError("clip_gradients() needs max_norm or clip_value.")
        if norm_type != 2.0:
            raise ValueError(f"DeepSpeed clips the 2-norm only; norm_type={norm_type} is not available.")
        engine, max_norm = self.engine, float(max_norm)
        # Also the optimizer's own copy: ZeRO and the 16-bit optimizers take it back from a checkpoint.
        # (the engine's config object is private in DeepSpeed, and it has no public setter for the limit)
        if float(engine._config.gradient_clipping) != max_norm:
            engine._config.gradient_clipping = max_norm
        if getattr(engine.optimizer, "clip_grad", max_norm) != max_norm:
            engine.optimizer.clip_grad = max_norm
        return None


    def teardown(self) -> None:
        self.engine = None
        self.process_group.destroy()

    def __repr__(self) -> str:
        return (f"DeepSpeedStrategy(stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
                f"offload_parameters={self.offload_parameters}, precision={self.precision.name!r}, "
                f"rank={self.global_rank}/{self.world_size})")


class _CastingHooks:
    """A 16-bit engine runs on 16-bit inputs: floating inputs are cast on the way in, outputs back to fp32.

    Hooks sit on the user's module (not the engine), so evaluation through the unwrapped module casts too.
    """

    @staticmethod
    def install(module: nn.Module, dtype: torch.dtype) -> None:
        # (a marker this class sets on the user's module, below)
        if getattr(module, "_fabric_lite_casts", None) == dtype:
            return

        def to_engine(_module: nn.Module, args: Any, kwargs: Any) -> Any:
            cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
            return tree_map(cast, args), tree_map(cast, kwargs)

        def to_fp32(_module: nn.Module, _args: Any, output: Any) -> Any:
            return tree_map(lambda t: t.float() if t.is_floating_point() else t, output)

        module.register_forward_pre_hook(to_engine, with_kwargs=True)
        module.register_forward_hook(to_fp32)
        setattr(module, "_fabric_lite_casts", dtype)  # (nn.Module's typed __setattr__ takes tensors and modules)
