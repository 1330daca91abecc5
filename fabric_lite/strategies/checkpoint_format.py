"""How a strategy's checkpoints hold model and optimizer state: one collaborator, `strategy.checkpoint_format`.

`kind` is one three-way choice, recorded in each checkpoint's manifest as its "engine":

- ``"state_dict"``: whole state dicts, gathered to rank 0 (`model_{i}.pt`, the optimizers in the training state);
- ``"dcp"``: shard by shard through torch.distributed.checkpoint, written by every process and reloadable on
  any number of processes (`checkpoint/sharded.py`);
- an engine's name (``"deepspeed"``): the engine writes its own per-rank files (`save_engine_state`), reads
  them back (`read_engine_state`) and merges them into one state dict without a process group (`consolidate`).

The other fields say what the doors may do around a save: keep partial gradients, save in the background, read
big weights on rank 0 only.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

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
    """

    def __init__(self, kind: str = STATE_DICT, partial_gradients: bool = True, background: bool = True,
                 weights_on_rank_zero: bool = False) -> None:
        self.kind = kind
        self.partial_gradients = partial_gradients
        self.background = background
        self.weights_on_rank_zero = weights_on_rank_zero

    @property
    def engine(self) -> Optional[str]:
        """What a checkpoint's manifest records: None (state dicts), "dcp", or the engine's name."""
        return None if self.kind == STATE_DICT else self.kind

    @property
    def engine_owned(self) -> bool:
        """The engine writes and reads model and optimizer state itself (neither state dicts nor DCP)."""
        return self.kind not in (STATE_DICT, DCP)

    def save_engine_state(self, writer: Any) -> None:
        """Every rank: write the engine's files through `writer`."""
        raise NotImplementedError(f"The {self.kind!r} checkpoint format has no engine files.")

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
