"""An averaged copy of a module's weights (EMA, SWA or a function of your own), for loops of one's own and for the
Trainer's averaging callbacks (`weight_averaging.py`).

`WeightAverage(model, ...)` and `ExponentialMovingAverage(model, decay=...)` (also importable from
`fabric_lite.utils`): call `update()` after each `optimizer.step()`, evaluate inside `with ema.averaged():`, and give
`accelerator=` so that `save_state`/`load_state` carry the average.

The average is kept like the model: where the parameters are sharded (FSDP2's DTensors), each process averages its
own local shards (foreach ops on the shards, no gathering), holds half of the average on 2 processes and saves its
own part in its own file of the checkpoint; elsewhere the average is one copy, saved once. DeepSpeed ZeRO stage 3
(partitioned parameters) is refused.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from fabric_lite.refusals import NotSupportedError

__all__ = ["WeightAverage", "ExponentialMovingAverage", "AvgFn", "MultiAvgFn"]

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MultiAvgFn = Callable[[List[torch.Tensor], List[torch.Tensor], torch.Tensor], None]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds: a DTensor's local shard, any other tensor itself (detached)."""
    tensor = tensor.detach()
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _is_sharded(tensor: torch.Tensor) -> bool:
    return callable(getattr(tensor, "to_local", None))


def _bare_module(model: nn.Module, accelerator: Any = None) -> nn.Module:
    """The user's module under a door's wrappers (DDP, an engine, the Trainer's step runner)."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    while True:
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in (
                "DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "StepRunner", "OptimizedModule"):
            model = inner
            continue
        inner = getattr(model, "_orig_mod", None)  # torch.compile
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


class WeightAverage:
    """An averaged copy of `model`'s parameters (and buffers, with `use_buffers=True`), with torch's
    `AveragedModel` rules: the first `update()` copies the weights; later ones apply `multi_avg_fn(averages,
    currents, n_averaged)` (in place, on lists of tensors of one device and dtype), else `avg_fn(average, current,
    n_averaged)` (returns the new value), else the equal average of every update (SWA). `device`: where the average
    lives (default: beside the weights). `accelerator`: register the average for `save_state`/`load_state`.

    Where the weights are sharded (FSDP2), the average is too: each process keeps the average of its own shards.

    Examples:
        >>> ema = ExponentialMovingAverage(model, decay=0.999, accelerator=accelerator)  # doctest: +SKIP
        >>> ...; optimizer.step(); ema.update()                                           # doctest: +SKIP
        >>> with ema.averaged(): evaluate(model)                                          # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, avg_fn: Optional[AvgFn] = None, multi_avg_fn: Optional[MultiAvgFn] = None,
                 use_buffers: bool = True, device: Union[torch.device, str, int, None] = None,
                 accelerator: Any = None) -> None:
        if avg_fn is not None and not callable(avg_fn):
            raise TypeError(f"avg_fn={avg_fn!r} must be a function (averaged, current, n_averaged) -> tensor.")
        if multi_avg_fn is not None and not callable(multi_avg_fn):
            raise TypeError(f"multi_avg_fn={multi_avg_fn!r} must be a function (averaged list, current list, "
                            f"n_averaged) that updates the averages in place.")
        self.model = _bare_module(model, accelerator)
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, bool(use_buffers)
        self.device = torch.device(device) if isinstance(device, (str, int)) else device
        sources = self._sources(self.model)
        self.names = [name for name, _ in sources]
        self.sharded = any(_is_sharded(t) for _, t in sources)
        #: the averaged tensors, in `names` order: plain tensors (a sharded weight's local shard)
        self.averages: List[torch.Tensor] = [self._placed(_local(t).clone()) for _, t in sources]
        self.n_averaged = torch.tensor(0, dtype=torch.long)
        self.swapped = False
        if accelerator is not None:
            accelerator.register_for_checkpointing(self, per_process=self.sharded)

    def _sources(self, model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        found: List[Tuple[str, torch.Tensor]] = list(model.named_parameters())
        partitioned = [name for name, p in found if hasattr(p, "ds_tensor") or hasattr(p, "ds_id")]
        if partitioned:
            raise NotSupportedError(
                f"Weight averaging over DeepSpeed ZeRO stage 3 (partitioned parameters such as {partitioned[0]!r}) "
                f"is not supported: each process holds a flat partition that DeepSpeed gathers only inside its own "
                f"forward, so an average of the parameters would be an average of empty placeholders. Use ZeRO "
                f"stage 1 or 2, or strategy='fsdp' (the average is sharded like the model).")
        if self.use_buffers:
            found += list(model.named_buffers())
        return found

    def _placed(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)

    def _currents(self) -> List[torch.Tensor]:
        sources = self._sources(self.model)
        if [name for name, _ in sources] != self.names:
            raise RuntimeError(f"The averaged module's parameters changed since the average was made "
                               f"({len(self.names)} then, {len(sources)} now); build the average after the model "
                               f"is complete.")
        return [_local(t) for _, t in sources]

    @torch.no_grad()
    def update(self, model: Optional[nn.Module] = None) -> None:
        """Fold the module's current weights into the average (`model`: another module with the same names)."""
        if self.swapped:
            raise RuntimeError("update() inside averaged(): the module holds the average; leave the block first.")
        currents = self._currents() if model is None else [_local(t) for _, t in self._sources(_bare_module(model))]
        averages = self.averages
        if int(self.n_averaged) == 0:
            for avg, cur in zip(averages, currents):
                avg.copy_(cur)
        elif self.multi_avg_fn is not None or self.avg_fn is None:
            multi = self.multi_avg_fn
            if multi is None:
                from torch.optim.swa_utils import get_swa_multi_avg_fn

                multi = get_swa_multi_avg_fn()
            groups: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], List[torch.Tensor]]] = \
                defaultdict(lambda: ([], []))
            for avg, cur in zip(averages, currents):
                group = groups[(avg.device, avg.dtype)]
                group[0].append(avg)
                group[1].append(cur.to(avg.device, avg.dtype))
            for (device, _), (avgs, curs) in groups.items():
                multi(avgs, curs, self.n_averaged.to(device))
        else:
            for avg, cur in zip(averages, currents):
                avg.copy_(self.avg_fn(avg, cur.to(avg.device), self.n_averaged.to(avg.device)))
        self.n_averaged += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the module's weights and the average (twice: as before)."""
        for avg, cur in zip(self.averages, self._currents()):
            held = cur.clone()
            cur.copy_(avg)
            avg.copy_(held)
        self.swapped = not self.swapped

    @contextlib.contextmanager
    def averaged(self) -> Iterator[nn.Module]:
        """The module holds the averaged weights inside the block, its own weights again after it."""
        self.swap()
        try:
            yield self.model
        finally:
            self.swap()

    @torch.no_grad()
    def copy_to(self, model: Optional[nn.Module] = None) -> None:
        """Write the average into the module (`model`: another module with the same names)."""
        currents = self._currents() if model is None else [_local(t) for _, t in self._sources(_bare_module(model))]
        for avg, cur in zip(self.averages, currents):
            cur.copy_(avg)

    @torch.no_grad()
    def reset(self) -> None:
        """Start over: the average is the module's weights and counts no update."""
        for avg, cur in zip(self.averages, self._currents()):
            avg.copy_(cur)
        self.n_averaged.zero_()

    def local_bytes(self) -> int:
        """Bytes of average this process holds."""
        return sum(t.numel() * t.element_size() for t in self.averages)

    def state_dict(self) -> Dict[str, Any]:
        return {"n_averaged": int(self.n_averaged), "averages": dict(zip(self.names, self.averages)),
                "sharded": self.sharded}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state["averages"]
        if list(saved) != self.names:
            raise ValueError(f"The saved average holds other weights than this module ({len(saved)} tensors, "
                             f"{len(self.names)} here); it was saved from another model.")
        for name, avg in zip(self.names, self.averages):
            if tuple(saved[name].shape) != tuple(avg.shape):
                raise ValueError(
                    f"The saved average of {name!r} has shape {tuple(saved[name].shape)} and this process holds "
                    f"{tuple(avg.shape)}"
                    + (": the average is saved sharded, each process its own shard, and loads on the same number "
                       "of processes only." if self.sharded or state.get("sharded") else "."))
        for name, avg in zip(self.names, self.averages):
            avg.copy_(saved[name])
        self.n_averaged.fill_(int(state["n_averaged"]))


class ExponentialMovingAverage(WeightAverage):
    """`WeightAverage` with the exponential moving average: `average = decay * average + (1 - decay) * weights`
    (torch's `get_ema_multi_avg_fn`), the first update copying the weights."""

    def __init__(self, model: nn.Module, decay: float = 0.999, use_buffers: bool = True,
                 device: Union[torch.device, str, int, None] = None, accelerator: Any = None) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay={decay!r} must be in [0, 1] (the weight the average keeps at each update).")
        self.decay = float(decay)
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=use_buffers, device=device,
                         accelerator=accelerator)
