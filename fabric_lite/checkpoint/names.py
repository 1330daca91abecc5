"""The names a checkpoint stores: the user's module names, whatever wraps the module.

`torch.compile` puts a module under ``_orig_mod``, DDP under ``module``, and wrappers such as
activation checkpointing or FSDP1 under ``_checkpoint_wrapped_module`` / ``_fsdp_wrapped_module``;
each changes the keys of ``state_dict()``. Checkpoints hold the keys without those segments
(`canonical_state`), and loading maps them back onto whatever names the loading module has
(`for_module`), so a checkpoint saved with or without `torch.compile` loads either way.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

__all__ = ["canonical", "canonical_state", "for_module"]

#: Attribute names under which wrappers keep the module they wrap (never the user's own names).
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    """``"_orig_mod.net._checkpoint_wrapped_module.0.weight"`` -> ``"net.0.weight"``."""
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def canonical_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` with canonical keys (the same values)."""
    return {canonical(k): v for k, v in state.items()}


def for_module(saved: Dict[str, Any], module_names: Iterable[str]) -> Dict[str, Any]:
    """`saved` (any naming: canonical, compiled, or a DDP module's ``module.`` keys) renamed to the keys a module
    has. Keys that match nothing stay as they are, so that a strict load reports them."""
    module_names = list(module_names)
    by_canonical = {canonical(k): k for k in module_names}
    renamed = {canonical(k): v for k, v in saved.items()}
    if renamed and not set(renamed) & set(by_canonical) and all(k.startswith("module.") for k in renamed):
        renamed = {k[len("module."):]: v for k, v in renamed.items()}  # saved from a DDP wrapper's state_dict()
    return {by_canonical.get(k, k): v for k, v in renamed.items()}
