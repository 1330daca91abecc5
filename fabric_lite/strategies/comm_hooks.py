"""DDP communication hooks: how DistributedDataParallel reduces gradients (compressed to fp16 or bf16, or
approximated with PowerSGD) instead of its plain all-reduce.

`CommHook` says which hook (Accelerate's names: "no", "fp16", "bf16", "power_sgd", "batched_power_sgd"), an
optional fp16/bf16 wrapper around PowerSGD, and the PowerSGD state's options; it checks them when built and
registers torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`) on a DDP model. `DDPStrategy` holds one
and registers it on every model it wraps; `apply_comm_hook` gives a strategy the hook a kwargs handler asks for, and
refuses, naming the strategy, where no DDP wrapper would carry it (FSDP, DeepSpeed, a device runtime's own collectives).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

__all__ = ["CommHook", "apply_comm_hook", "COMM_HOOKS", "COMM_WRAPPERS", "POWER_SGD_HOOKS"]

COMM_HOOKS: Tuple[str, ...] = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
COMM_WRAPPERS: Tuple[str, ...] = ("no", "fp16", "bf16")
POWER_SGD_HOOKS: Tuple[str, ...] = ("power_sgd", "batched_power_sgd")


def _name(value: Any) -> str:
    """An enum member (its value), or a string, as the lower-case hook name."""
    return str(getattr(value, "value", value)).strip().lower()


@dataclass(frozen=True)
class CommHook:
    """One DDP communication hook, checked when built.

    ``CommHook("power_sgd", "fp16", {"matrix_approximation_rank": 2})``: PowerSGD on gradients cast to fp16, rank-2
    approximation. `wrapper` ("fp16"/"bf16") casts what a PowerSGD hook compresses; `state_option` are keywords of
    torch's `PowerSGDState` (PowerSGD hooks only).
    """

    hook: str = "no"
    wrapper: str = "no"
    state_option: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hook, wrapper = _name(self.hook), _name(self.wrapper)
        if hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.hook!r} is not valid: allowed values are "
                             f"{', '.join(map(repr, COMM_HOOKS))} (DDPCommunicationHookType's members).")
        if wrapper not in COMM_WRAPPERS:
            raise ValueError(f"comm_wrapper={self.wrapper!r} is not valid: allowed values are "
                             f"{', '.join(map(repr, COMM_WRAPPERS))}; a wrapper casts the gradients a PowerSGD hook "
                             f"compresses.")
        if self.state_option is None:
            object.__setattr__(self, "state_option", {})
        if not isinstance(self.state_option, Mapping):
            raise TypeError(f"comm_state_option={self.state_option!r}: pass a dict of PowerSGDState keywords, e.g. "
                            f"{{'matrix_approximation_rank': 2}}.")
        object.__setattr__(self, "hook", hook)
        object.__setattr__(self, "wrapper", wrapper)
        object.__setattr__(self, "state_option", dict(self.state_option))
        power = hook in POWER_SGD_HOOKS
        if wrapper != "no" and not power:
            plain = "plain fp16/bf16 compression is comm_hook=FP16 or BF16 alone" if hook == "no" else \
                f"comm_hook={hook.upper()} already compresses to {hook}"
            raise ValueError(f"comm_wrapper={wrapper.upper()} wraps a PowerSGD hook (it casts the gradients to {wrapper} "
                             f"before PowerSGD compresses them), but comm_hook={hook.upper()}: {plain}. Pass "
                             f"comm_hook=POWER_SGD with this wrapper, or drop comm_wrapper.")
        if self.state_option and not power:
            raise ValueError(f"comm_state_option={self.state_option!r} configures PowerSGD's state, but "
                             f"comm_hook={hook.upper()} has none. Pass comm_hook=POWER_SGD, or drop comm_state_option.")
        if power:
            self.power_sgd_state(None)  # the options are checked now, not at the first backward
        if hook == "batched_power_sgd":
            _refuse_broken_batched_power_sgd()

    @property
    def enabled(self) -> bool:
        """Whether a hook replaces DDP's plain all-reduce at all."""
        return self.hook != "no"

    def power_sgd_state(self, process_group: Any) -> Any:
        """A new `PowerSGDState` for `process_group` with `state_option` (None for other hooks)."""
        if self.hook not in POWER_SGD_HOOKS:
            return None
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        accepted = [n for n in inspect.signature(PowerSGDState.__init__).parameters if n not in ("self", "process_group")]
        unknown = sorted(set(self.state_option) - set(accepted))
        if unknown:
            raise ValueError(f"comm_state_option has {', '.join(map(repr, unknown))}, which torch's PowerSGDState does "
                             f"not take; its options are {', '.join(accepted)}.")
        rank = self.state_option.get("matrix_approximation_rank", 1)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"comm_state_option matrix_approximation_rank={rank!r}: pass an integer >= 1 (the rank "
                             f"of PowerSGD's low-rank approximation; 1 compresses most).")
        try:
            return PowerSGDState(process_group, **self.state_option)
        except (ValueError, TypeError) as err:
            raise ValueError(f"comm_state_option={self.state_option!r}: torch's PowerSGDState refused it: {err}") from err

    def hook_function(self, backend: Optional[str] = None) -> Callable:
        """torch's hook, wrapped as asked. On gloo a bf16 hook is handed over under a name of its own: torch refuses
        its bf16 hooks by name without CUDA and NCCL >= 2.10, a check about NCCL; gloo reduces bf16 itself."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: Dict[str, Callable] = {
            "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
            "power_sgd": powerSGD_hook.powerSGD_hook, "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
        if not self.enabled:
            raise ValueError("CommHook('no') has no hook function: DDP's own all-reduce runs.")
        function = hooks[self.hook]
        if self.wrapper != "no":
            function = wrappers[self.wrapper](function)
        if backend == "gloo" and "bf16" in (self.hook, self.wrapper):
            function = _bf16_on_gloo(function)
        return function

    def register(self, model: Any) -> Any:
        """Register the hook on a `DistributedDataParallel` model; returns its state (PowerSGD's, else None)."""
        import torch.distributed as dist

        group = model.process_group
        state = self.power_sgd_state(group) if self.hook in POWER_SGD_HOOKS else group
        model.register_comm_hook(state, self.hook_function(dist.get_backend(group)))
        return state if self.hook in POWER_SGD_HOOKS else None

    def describe(self) -> str:
        """How gradients are reduced, in words (for `explain` and messages)."""
        if not self.enabled:
            return "plain all-reduce"
        text = {"fp16": "all-reduce compressed to fp16", "bf16": "all-reduce compressed to bf16",
                "power_sgd": "PowerSGD (layer-wise low-rank)", "batched_power_sgd": "batched PowerSGD"}[self.hook]
        if self.wrapper != "no":
            text += f" on {self.wrapper} gradients"
        return text + (f", {self.state_option}" if self.state_option else "")


def _bf16_on_gloo(function: Callable) -> Callable:
    # (no annotations: torch checks a hook's `bucket` and return annotations, and under `from __future__ import
    # annotations` they would be strings)
    def bf16_hook_on_gloo(state, bucket):  # type: ignore[no-untyped-def]
        return function(state, bucket)

    return bf16_hook_on_gloo


def _refuse_broken_batched_power_sgd() -> None:
    failure = _batched_power_sgd_failure()
    if failure is not None:
        raise ValueError(
            f"comm_hook=BATCHED_POWER_SGD: torch {torch.__version__}'s batched_powerSGD_hook stops training with an "
            f"{failure} at its first compressing step (iteration start_powerSGD_iter, 1000 by default; before it, "
            f"gradients are all-reduced uncompressed): it passes one 2-D matrix to an orthogonalization that takes "
            f"batches only. Use comm_hook=POWER_SGD (PowerSGD per layer, the same comm_state_option and comm_wrapper).")


@functools.lru_cache(maxsize=None)
def _batched_power_sgd_failure() -> Optional[str]:
    """Why torch's batched PowerSGD hook cannot compress, or None. Since torch 1.12 its helper orthogonalizes
    batches of matrices only (3-D) and the batched hook hands it one 2-D matrix: an AssertionError at the first
    compressing step. Tried once per process on a 2-by-1 matrix, so a torch that fixes it is let through."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    orthogonalize = getattr(powerSGD_hook, "_orthogonalize", None)
    if orthogonalize is None:
        return None
    try:
        orthogonalize(torch.ones(2, 1))
    except (AssertionError, RuntimeError, IndexError, ValueError) as err:
        return type(err).__name__
    return None


def apply_comm_hook(strategy: Any, hook: CommHook) -> None:
    """Give `strategy` the communication hook a kwargs handler asks for.

    A strategy that wraps models in torch's DistributedDataParallel registers it on each; one that trains a lone
    process has nothing to apply it to (silently, as in Accelerate); any other reduces gradients its own way and is
    refused with the reason.
    """
    from fabric_lite.strategies.ddp import DDPStrategy
    from fabric_lite.strategies.single import SingleDeviceStrategy

    if not hook.enabled or isinstance(strategy, SingleDeviceStrategy):
        return
    # (a DDPStrategy subclass that wraps models its own way has no DDP model to hook)
    if isinstance(strategy, DDPStrategy) and type(strategy).setup_module is DDPStrategy.setup_module:
        strategy.comm_hook = hook
        return
    kind = strategy.traits.accelerate_type
    own = {"FSDP": "FSDP reduce-scatters gradients in its mixed-precision policy's reduce_dtype (reduce_dtype="
                   "torch.bfloat16 compresses them)",
           "DEEPSPEED": "DeepSpeed reduces gradients in its config's communication_data_type (\"fp16\"/\"bf16\" "
                        "compresses them)"}.get(str(kind), "it reduces gradients its own way")
    raise ValueError(
        f"DistributedDataParallelKwargs(comm_hook={hook.hook.upper()}) registers a hook on torch's "
        f"DistributedDataParallel, which strategy {type(strategy).__name__}{f' ({kind})' if kind else ''} does not use: "
        f"{own}. Drop comm_hook (DDPCommunicationHookType.NO), or train with strategy='ddp' (plain data parallel).")
