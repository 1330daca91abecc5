"""The names a checkpoint stores: the user's module names, whatever wraps the module.

`torch.compile` puts a module under ``_orig_mod``, DDP under ``module``, and wrappers such as
activation checkpointing or FSDP1 under ``_checkpoint_wrapped_module`` / ``_fsdp_wrapped_module``;
each changes the keys of ``state_dict()``. Checkpoints hold the keys without those segments
(`canonical_state`), and loading maps them back onto whatever names the loading module has
(`for_module`), so a checkpoint saved with or without `torch.compile` loads either way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Mapping

__all__ = ["canonical", "canonical_state", "for_module"]

#: Attribute names under which wrappers keep the module they wrap (never the user's own names).
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    """``"_orig_mod.net._checkpoint_wrapped_module.0.weight"`` -> ``"net.0.weight"``."""
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def canonical_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` with canonical keys (the same values); a state dict's ``_metadata`` (each submodule's version,
    which its `_load_from_state_dict` reads) is renamed alike."""
    out: Dict[str, Any] = OrderedDict((canonical(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        # a wrapper's own entry and its inner module's both become the same prefix: the inner one (later) wins
        out._metadata = OrderedDict((canonical(k), v) for k, v in metadata.items())  # type: ignore[attr-defined]
    return out


def for_module(saved: Dict[str, Any], current: Mapping[str, Any]) -> Dict[str, Any]:
    """`saved` (any naming: canonical, compiled, or a DDP module's ``module.`` keys) renamed to the keys of
    `current`, the loading module's own state dict (``_metadata`` too). Keys that match nothing stay as they
    are, so that a strict load reports them."""
    by_canonical = {canonical(k): k for k in current}
    renamed = {canonical(k): v for k, v in saved.items()}
    metadata = getattr(saved, "_metadata", None)
    prefixes = {canonical(k): v for k, v in metadata.items()} if metadata is not None else None
    if renamed and not set(renamed) & set(by_canonical) and all(k.startswith("module.") for k in renamed):
        renamed = {k[len("module."):]: v for k, v in renamed.items()}  # saved from a DDP wrapper's state_dict()
        if prefixes is not None:
            prefixes = {("" if k == "module" else k[len("module."):] if k.startswith("module.") else k): v
                        for k, v in prefixes.items()}
    out: Dict[str, Any] = OrderedDict((by_canonical.get(k, k), v) for k, v in renamed.items())
    if prefixes is not None:
        own = getattr(current, "_metadata", None) or {}
        by_canonical_prefix = {canonical(k): k for k in own}
        out._metadata = OrderedDict((by_canonical_prefix.get(k, k), v)  # type: ignore[attr-defined]
                                    for k, v in prefixes.items())
    return out
