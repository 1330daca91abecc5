"""The model summary printed when `fit` starts: the module's layers, their parameter counts, and the totals.

    | Name | Type       | Params | Mode
  -------------------------------------
  0 | net  | Sequential | 2,826  | train
  -------------------------------------
  2,826     Trainable params
  0         Non-trainable params
  2,826     Total params
  0.011     Total estimated model params size (MB)

The Trainer adds a `ModelSummary()` (depth 1: the module's direct children) unless it is given
`enable_model_summary=False` or a ModelSummary of its own; `summarize(module, max_depth)` builds the same table
outside a Trainer.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from torch import nn

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["ModelSummary", "Summary", "summarize"]


def _full_numel(param: nn.Parameter) -> int:
    """Elements of a parameter: the whole tensor's, also where it is sharded (a DTensor under FSDP reports its
    global shape; a ZeRO-3 partition keeps its full size in `ds_numel`); 0 while it is still uninitialized (lazy)."""
    if isinstance(param, nn.parameter.UninitializedParameter):
        return 0
    full = getattr(param, "ds_numel", None)
    return int(full) if full is not None else param.numel()


def _distinct_parameters(module: nn.Module) -> Dict[int, nn.Parameter]:
    """The module's parameters, each once (a parameter shared between layers counts once)."""
    return {id(p): p for p in module.parameters()}


class Summary:
    """A module's layers down to `max_depth` (-1: every layer, 0: none) and its parameter totals.

    `rows`: (name, type, parameters, mode) per layer; `total_parameters`, `trainable_parameters`,
    `non_trainable_parameters`; `model_size`: megabytes the parameters take, from their dtypes."""

    def __init__(self, module: nn.Module, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(f"max_depth={max_depth!r} must be an integer >= -1 (-1: every layer, 0: no layers).")
        self.max_depth = max_depth
        self.rows: List[Tuple[str, str, int, str]] = []
        if max_depth != 0:
            for name, layer in module.named_modules():
                if name and (max_depth == -1 or name.count(".") < max_depth):
                    count = sum(map(_full_numel, _distinct_parameters(layer).values()))
                    self.rows.append((name, type(layer).__name__, count, "train" if layer.training else "eval"))
        params = list(_distinct_parameters(module).values())
        self.total_parameters = sum(map(_full_numel, params))
        self.trainable_parameters = sum(_full_numel(p) for p in params if p.requires_grad)
        self.non_trainable_parameters = self.total_parameters - self.trainable_parameters
        self.model_size = sum(_full_numel(p) * p.element_size() for p in params) / 1e6
        modes = [m.training for m in module.modules()]
        self.train_modules, self.eval_modules = sum(modes), len(modes) - sum(modes)
        self.uninitialized = any(isinstance(p, nn.parameter.UninitializedParameter) for p in params)

    def __str__(self) -> str:
        lines: List[str] = []
        if self.rows:
            header = ("", "Name", "Type", "Params", "Mode")
            cells = [(str(i), name, kind, f"{count:,}", mode) for i, (name, kind, count, mode) in enumerate(self.rows)]
            widths = [max(len(header[c]), *(len(row[c]) for row in cells)) for c in range(len(header))]

            def line(row: Tuple[str, ...]) -> str:
                return " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

            table = [line(header), *map(line, cells)]
            rule = "-" * max(map(len, table))
            lines += [table[0], rule, *table[1:], rule]
        column = max(10, len(f"{self.total_parameters:,}") + 2)
        lines += [f"{self.trainable_parameters:<{column},}Trainable params",
                  f"{self.non_trainable_parameters:<{column},}Non-trainable params",
                  f"{self.total_parameters:<{column},}Total params",
                  f"{self.model_size:<{column}.3f}Total estimated model params size (MB)",
                  f"{self.train_modules:<{column}}Modules in train mode",
                  f"{self.eval_modules:<{column}}Modules in eval mode"]
        if self.uninitialized:
            lines.append("(lazy layers not yet initialized count 0 parameters)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


def summarize(module: nn.Module, max_depth: int = 1) -> Summary:
    """The summary table of `module` (print it, or read its totals)."""
    return Summary(module, max_depth)


class ModelSummary(Callback):
    """Prints the module's summary (`summarize`) when `fit` starts, on the main process only, to stderr.

    `max_depth`: how deep the layer rows go (1: the module's direct children; -1: every layer); 0 prints nothing,
    as in Lightning.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(f"ModelSummary(max_depth={max_depth!r}): must be an integer >= -1 (-1: every layer, "
                             f"0: no summary).")
        self.max_depth = max_depth
        #: The summary printed by the latest fit (on the main process), or None.
        self.summary: Any = None

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if not self.max_depth or not trainer.is_global_zero:
            return
        self.summary = summarize(module, self.max_depth)
        print(self.summary, file=sys.stderr, flush=True)
