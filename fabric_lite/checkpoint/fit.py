"""Whether saved state fits the objects it is about to be loaded into, decided before anything changes.

`load_state` reads a whole checkpoint, asks these functions what does not fit, and only loads when
nothing is reported: a checkpoint of another model width, another optimizer class or another
scheduler leaves the run as it was, with one error that lists the first mismatches. Each function
returns problems as short sentences (an empty list when the state fits).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

__all__ = ["fit_problem", "shapes_of", "dtype_problems", "optimizer_problems", "scheduler_problems", "type_name"]

#: Per-parameter optimizer state that has its parameter's shape in torch's own optimizers.
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                           "sum", "ax", "prev", "grad_avg"})


def type_name(obj: Any) -> str:
    """The class name a checkpoint records for an optimizer or scheduler (a prepared one's wrapper
    looked through: it holds the user's object as `.scheduler` or `.optimizer`)."""
    for attr in ("scheduler", "optimizer"):  # a prepared scheduler has both: its own and its optimizer
        inner = getattr(obj, attr, None)
        if inner is not None:
            return type(inner).__qualname__
    return type(obj).__qualname__


def fit_problem(current: Dict[str, Any], saved: Dict[str, Any], strict: bool) -> Optional[str]:
    """Why saved state cannot load into a model, or None. Both map names to shapes (None: not a tensor);
    shapes that differ always count, missing or unexpected names only when `strict`."""
    shapes = [f"{k}: saved {saved[k]}, model {shape}" for k, shape in current.items()
              if shape is not None and saved.get(k) is not None and tuple(saved[k]) != tuple(shape)]
    if shapes:
        return f"{len(shapes)} tensor(s) differ in shape, first: {shapes[:5]}"
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if strict and (missing or unexpected):
        def show(keys: List[str]) -> str:
            return ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "") if keys else "none"

        return f"missing keys: {show(missing)}; unexpected keys: {show(unexpected)}"
    return None


def shapes_of(state: Dict[str, Any]) -> Dict[str, Any]:
    """name -> shape of a state dict's tensors (None for other entries), for `fit_problem`."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "floating point" if t.is_floating_point() else "integer"


def dtype_problems(current: Dict[str, Any], saved: Dict[str, Any]) -> List[str]:
    """Tensors whose kind of number differs (an integer counter saved where the model has floats...).
    Floating point widths may differ: loading casts them, as `load_state_dict` always does."""
    return [f"{k}: saved {saved[k].dtype}, model {v.dtype}" for k, v in current.items()
            if isinstance(v, torch.Tensor) and isinstance(saved.get(k), torch.Tensor) and _kind(v) != _kind(saved[k])]


def _differing_settings(saved: Dict[str, Any], mine: Dict[str, Any]) -> Optional[str]:
    """Settings that only one side has, on both sides: the mark of another class (a newer or older
    torch adds or drops settings on one side only, which loading tolerates)."""
    only_saved = sorted(set(saved) - set(mine) - {"params", "param_names"})
    only_mine = sorted(set(mine) - set(saved) - {"params", "param_names"})
    if only_saved and only_mine:
        return f"the saved one has {', '.join(only_saved[:4])}; this one has {', '.join(only_mine[:4])}"
    return None


def optimizer_problems(label: str, optimizer: Any, saved: Any, saved_type: Optional[str]) -> List[str]:
    """What keeps `saved` (an optimizer state dict) from loading into `optimizer` (prepared or plain)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        return [f"{label}: the saved entry is not an optimizer state ({type(saved).__name__})"]
    if saved_type is not None and saved_type != type_name(optimizer):
        return [f"{label}: saved by {saved_type}, this run has {type_name(optimizer)}"]
    groups, saved_groups = inner.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        return [f"{label}: saved with {len(saved_groups)} parameter group(s), this one has {len(groups)}"]
    problems: List[str] = []
    params: List[torch.Tensor] = []
    saved_ids: List[Any] = []
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if not isinstance(saved_group, dict) or not isinstance(saved_group.get("params"), list):
            return [f"{label}: saved parameter group {i} is damaged"]
        if len(group["params"]) != len(saved_group["params"]):
            problems.append(f"{label}: parameter group {i} saved with {len(saved_group['params'])} parameters, "
                            f"this one has {len(group['params'])}")
        settings = _differing_settings(saved_group, group)
        if settings:
            problems.append(f"{label}: parameter group {i} holds another optimizer's settings ({settings})")
        params.extend(group["params"])
        saved_ids.extend(saved_group["params"])
    if problems:
        return problems
    by_id = dict(zip(saved_ids, params))
    for key, entry in saved["state"].items():
        param = by_id.get(key)
        if param is None:
            problems.append(f"{label}: saved state for parameter {key!r}, which no parameter group lists")
            continue
        if not isinstance(entry, dict):
            problems.append(f"{label}: saved state for parameter {key!r} is not a dict")
            continue
        mine = inner.state.get(param, {})
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            ref = mine.get(name)
            want = tuple(ref.shape) if isinstance(ref, torch.Tensor) else (
                tuple(param.shape) if name in _PARAM_SHAPED else None)
            if want is not None and tuple(value.shape) != want:
                problems.append(f"{label}: state {name!r} of parameter {key!r} saved with shape {tuple(value.shape)}, "
                                f"expected {want}")
        if len(problems) >= 5:
            break
    return problems


def scheduler_problems(label: str, scheduler: Any, saved: Any, saved_type: Optional[str]) -> List[str]:
    """What keeps `saved` (a scheduler state dict) from loading into `scheduler`."""
    if not isinstance(saved, dict):
        return [f"{label}: the saved entry is not a scheduler state ({type(saved).__name__})"]
    inner = getattr(scheduler, "scheduler", scheduler)
    if saved_type is not None:
        mine = type_name(scheduler)
        return [] if saved_type == mine else [f"{label}: saved by {saved_type}, this run has {mine}"]
    state = inner.state_dict() if hasattr(inner, "state_dict") else None
    settings = _differing_settings(saved, state) if isinstance(state, dict) else None
    return [f"{label}: holds another scheduler's settings ({settings})"] if settings else []
