"""How FSDP cuts a model into groups, and brings a model built on the meta device to life.

The blocks named by a wrap policy each get their own `fully_shard` (strategies/fsdp.py does the
sharding); a block sharing a weight with a module outside it stays in its parent's group, so ties
survive. A model built on the meta device is materialized shard by shard, with the values it would
have had if built whole.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, TypeGuard, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["WrapPolicy", "is_dtensor", "local_bytes", "CheckpointedForward", "block_classes", "resolve_wrap_policy",
           "parameter_owners", "shares_outside", "materialize"]

#: Block choice: class objects or class names, a callable `module -> bool`, or None (the root alone, or a
#: Hugging Face model's `_no_split_modules`).
WrapPolicy = Union[None, Iterable[Union[type, str]], Callable[[nn.Module], bool]]


def is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
    """Whether `tensor` is a sharded (distributed) tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_bytes(tensor: Any) -> int:
    """Bytes this process holds for `tensor`: its local shard when it is a DTensor."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    return local.numel() * local.element_size()


class CheckpointedForward:
    """A block's forward run under activation checkpointing (recomputed in backward). Installed on the
    instance, so parameter names do not change (no `_checkpoint_wrapped_module.` prefix)."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def block_classes(module: nn.Module) -> List[str]:
    """Names of the classes of `module`'s non-leaf submodules that hold parameters (wrap candidates)."""
    seen: Dict[str, None] = {}
    for _, sub in module.named_modules():
        if sub is not module and any(True for _ in sub.children()) and any(True for _ in sub.parameters()):
            seen.setdefault(type(sub).__name__)
    return list(seen)


def resolve_wrap_policy(policy: WrapPolicy, module: nn.Module) -> Callable[[nn.Module], bool]:
    """The wrap policy as a predicate; class names that match nothing in `module` are an error."""
    if policy is None:
        # a Hugging Face model's blocks (its list may name classes of other variants: only those present count)
        present = {type(sub).__name__ for sub in module.modules()}
        policy = [name for name in getattr(module, "_no_split_modules", None) or [] if name in present]
        if not policy:
            return lambda sub: False
    if callable(policy) and not isinstance(policy, type):
        return policy
    wanted = [policy] if isinstance(policy, (str, type)) else list(policy)
    names = {w for w in wanted if isinstance(w, str)}
    classes = tuple(w for w in wanted if isinstance(w, type))
    bad = [w for w in wanted if not isinstance(w, (str, type))]
    if bad:
        raise ValueError(f"auto_wrap_policy entries must be module classes or class names; got {bad!r}.")
    present = {type(sub).__name__ for sub in module.modules()}
    missing = sorted(names - present) + [c.__name__ for c in classes if not any(isinstance(s, c) for s in module.modules())]
    if missing:
        raise ValueError(
            f"auto_wrap_policy names {missing}, which this model ({type(module).__name__}) does not contain. Its "
            f"block classes are: {block_classes(module) or 'none (it has no nested blocks)'}. Name one of those, or "
            f"leave auto_wrap_policy=None to shard the model as one group."
        )
    return lambda sub: type(sub).__name__ in names or isinstance(sub, classes)


def parameter_owners(module: nn.Module) -> Dict[int, List[str]]:
    """For each parameter (by id), the paths of the modules that hold it directly (several when tied)."""
    owners: Dict[int, List[str]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), []).append(path)
    return owners


def shares_outside(path: str, sub: nn.Module, owners: Dict[int, List[str]]) -> bool:
    """Whether a parameter of the block at `path` is also held by a module outside it (a tied weight)."""
    return any(not (o == path or o.startswith(path + ".")) for p in sub.parameters() for o in owners[id(p)])


def _meta_tensors(sub: nn.Module) -> List[torch.Tensor]:
    own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
    return [t for t in own if (t.to_local() if is_dtensor(t) else t).is_meta]


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give the parts of a model built on the meta device real storage (each process its shards only) and
    initial values; tensors that are already real are left as they are.

    Each such module's `reset_parameters` runs on whole-size stand-ins of its own parameters, with the same
    random stream on every process, and each process keeps its slices: the values are those the model
    would have had if built whole (random ops on sharded tensors would draw the same numbers for every
    shard on CPU). A weight shared by several modules is initialized by the first of them. Memory: one
    module's own parameters at a time, whole."""
    from torch.distributed.tensor import distribute_tensor

    uninitialized = [f"{path or '<root>'} ({type(sub).__name__})" for path, sub in module.named_modules()
                     if _meta_tensors(sub) and not hasattr(sub, "reset_parameters")]
    if uninitialized:  # (refused before anything is allocated)
        raise ValueError(
            f"The model was built on the meta device, but these modules hold parameters or buffers and have no "
            f"reset_parameters() to give them values: {uninitialized[:8]}. Add reset_parameters() to them, or build "
            f"the model normally (empty_init=False), or load full weights after prepare (load_model_weights)."
        )
    mixed = [type(sub).__name__ for _, sub in module.named_modules()
             if 0 < len(_meta_tensors(sub)) < len([*sub.parameters(recurse=False), *sub.buffers(recurse=False)])]
    if mixed:
        raise ValueError(f"{mixed[:8]} hold tensors both on the meta device and real ones; build each module wholly "
                         f"on one or the other.")
    with torch.no_grad():
        for _, sub in module.named_modules():
            if not _meta_tensors(sub):  # real from the start, or a tied weight its first owner initialized
                continue
            sub.to_empty(device=device, recurse=False)
            sharded = {n: p for n, p in sub.named_parameters(recurse=False) if is_dtensor(p)}
            stand_ins = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                         requires_grad=p.requires_grad) for n, p in sharded.items()}
            for name, whole in stand_ins.items():
                setattr(sub, name, whole)
            try:
                sub.reset_parameters()
            finally:
                for name, p in sharded.items():
                    setattr(sub, name, p)
            for name, p in sharded.items():
                piece = distribute_tensor(stand_ins[name].detach(), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(piece.to_local())
