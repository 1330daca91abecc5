"""How a strategy's checkpoints hold model and optimizer state: one collaborator, `strategy.checkpoint_format`.

`kind` is one three-way choice, recorded in each checkpoint's manifest as its "engine":

- ``"state_dict"``: whole state dicts, gathered to rank 0 (`model_{i}.pt`, the optimizers in the training state);
- ``"dcp"``: shard by shard through torch.distributed.checkpoint, written by every process and reloadable on
  any number of processes (`checkpoint/sharded.py`);
- an engine's name (``"deepspeed"``): the engine writes its own per-rank files (`save_engine_state`), reads
  them back (`read_engine_state`) and merges them into one state dict without a process group (`consolidate`).

The other fields say what the doors may do around a save: keep partial gradients, save in the background, read
big weights on rank 0 only. An engine's format saves in the background where it can hand over its files on the
training thread without writing them (`stage_engine_state`, `stages_engine_files=True`): the files are then
copied to host memory there and written by the background thread like any other.

It also holds the full state dicts that checkpoints and `save_model` read and write: `module_state_dict`,
`load_module_state_dict`, `optimizer_state_dict`, `load_optimizer_state_dict`, and `to_host` (what
`Accelerator.save` writes). The defaults here read the user's module (`strategy.unwrap_module`) and the optimizer
as they are; a strategy that shards or moves its state (FSDP, DeepSpeed, a device runtime) holds a subclass of its own.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

__all__ = ["CheckpointFormat", "STATE_DICT", "DCP"]

STATE_DICT = "state_dict"
DCP = "dcp"


class CheckpointFormat:
    """State dicts or DCP shards; an engine's format subclasses it and implements the three engine methods.

    `partial_gradients`: inside an accumulation window the partial gradients are in `param.grad`, where a
    checkpoint can save them (an engine or a sharding that keeps them in its own buffers cannot resume mid-window
    exactly). `background`: the state copies to host memory without a step of the runtime, so a background thread
    can write it (`save_state(blocking=False)`). `weights_on_rank_zero`: `load_module_state_dict` needs the full
    weights on global rank 0 only (the others pass {}): big weights are read by one process and scattered.
    `strategy`: the strategy that holds this format (held weakly), whose module unwrapping and collectives the
    state dict reads and writes use. `stages_engine_files` (an engine's format): `stage_engine_state` hands over
    the engine's files as objects, so its saves can be written in the background.
    """

    #: An engine's format whose `stage_engine_state` hands over its files without writing them.
    stages_engine_files = False

    def __init__(self, strategy: Any, kind: str = STATE_DICT, partial_gradients: bool = True, background: bool = True,
                 weights_on_rank_zero: bool = False) -> None:
        # Held weakly: the strategy holds its format, and a cycle would keep a finished run's strategy (and the
        # parameters it recorded) alive until the garbage collector runs (as its runtime does, runtime.py).
        self._strategy = weakref.ref(strategy)
        self.kind = kind
        self.partial_gradients = partial_gradients
        self.background = background
        self.weights_on_rank_zero = weights_on_rank_zero

    @property
    def strategy(self) -> Any:
        """The strategy holding this format."""
        strategy = self._strategy()
        if strategy is None:
            raise RuntimeError(f"The strategy that held this {type(self).__name__} is gone; use the checkpoint_format "
                               f"of the strategy that trains the model.")
        return strategy

    @property
    def engine(self) -> Optional[str]:
        """What a checkpoint's manifest records: None (state dicts), "dcp", or the engine's name."""
        return None if self.kind == STATE_DICT else self.kind

    @property
    def engine_owned(self) -> bool:
        """The engine writes and reads model and optimizer state itself (neither state dicts nor DCP)."""
        return self.kind not in (STATE_DICT, DCP)

    # -- full state dicts ----------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """A full (unsharded) state dict of the user's module, valid on global rank 0."""
        return self.strategy.unwrap_module(module).state_dict()

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, Any], strict: bool = True) -> None:
        self.strategy.unwrap_module(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's full state; `module` is the prepared model it trains (None when unknown)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: Optional[nn.Module], optimizer: torch.optim.Optimizer,
                                  state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def to_host(self, obj: Any) -> Any:
        """`obj` as `Accelerator.save` writes it: tensors that only this strategy's device can read back (a device
        runtime's) copied to the host; others as they are (a CUDA tensor saves as one, as with torch.save)."""
        return obj

    # -- an engine's own files ---------------------------------------------------------------------
    def save_engine_state(self, writer: Any) -> None:
        """Every rank: write the engine's files through `writer`."""
        raise NotImplementedError(f"The {self.kind!r} checkpoint format has no engine files.")

    def stage_engine_state(self, keep: Callable[[Any], Any]) -> Dict[str, Any]:
        """Every rank, on the training thread: the engine's files as they would be written (name -> object), each
        passed through `keep` (which copies it to host memory) as the engine hands it over; a collective."""
        raise NotImplementedError(f"The {self.kind!r} checkpoint format cannot hand over its engine files.")

    def read_engine_state(self, url: str, manifest: Dict[str, Any], strict: bool) -> Callable[[], None]:
        """Read and verify the engine's files; return what applies them (after every other check passed)."""
        raise NotImplementedError(f"The {self.kind!r} checkpoint format has no engine files.")

    @classmethod
    def consolidate(cls, url: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
        """The full weights of a checkpoint in this engine's files, in one state dict, without a process group
        (`fabric-lite consolidate`)."""
        raise NotImplementedError(f"{cls.__name__} has no engine files to consolidate.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r})"
