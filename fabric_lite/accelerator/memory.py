"""Out-of-memory helpers with Accelerate's names: `find_executable_batch_size`, `should_reduce_batch_size`,
`release_memory`, `clear_device_cache`.

`find_executable_batch_size` runs a function with a batch size and, when it runs out of memory, frees what it
can and runs it again with a smaller one. On several processes every attempt uses the same batch size on
every process: the processes compare notes through the process group's key-value store between attempts
(`ProcessAgreement`), never inside the function.
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import json
import time
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["find_executable_batch_size", "should_reduce_batch_size", "release_memory", "clear_device_cache",
           "ProcessAgreement", "OUT_OF_MEMORY_MESSAGES"]

#: Parts of error messages that mean "this batch does not fit" (searched in a RuntimeError's message).
OUT_OF_MEMORY_MESSAGES = (
    "out of memory.",  # the caching allocators: "CUDA out of memory. Tried to allocate ...", HIP, XPU
    "CUDA error: out of memory",  # a plain cudaMalloc outside the caching allocator (workspaces, NCCL buffers)
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN refuses inputs this large
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "PT_DEVMEM Allocation failed",  # Gaudi (HPU)
)
_OUT_OF_MEMORY_TYPES = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` means the work did not fit in memory, so a smaller batch may: torch's
    `OutOfMemoryError` (CUDA, XPU), Python's `MemoryError`, or a RuntimeError whose message says so (MPS, the
    CPU allocator, cuDNN/cuBLAS allocation failures; `OUT_OF_MEMORY_MESSAGES`). An error raised ``from`` such
    an error counts too."""
    seen = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        if isinstance(exception, _OUT_OF_MEMORY_TYPES):
            return True
        if isinstance(exception, RuntimeError) and exception.args and isinstance(exception.args[0], str):
            if any(part in exception.args[0] for part in OUT_OF_MEMORY_MESSAGES):
                return True
        exception = exception.__cause__  # type: ignore[assignment]
    return False


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Give the accelerator's cached, unused memory back (CUDA, XPU, MPS);
    with `garbage_collection`, first collect Python's garbage (slow: call it between attempts, not per step).
    A device that was never used is left alone (nothing is initialized here)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available() and xpu.is_initialized():
        xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> List[None]:
    """Drop the references given, collect garbage and empty the device cache; returns Nones to assign back:
    ``model, optimizer = release_memory(model, optimizer)``. (Other references to the objects keep them alive.)"""
    nones: List[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return nones


def find_executable_batch_size(function: Optional[Callable[..., Any]] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[], int]] = None) -> Any:
    """Run `function(batch_size, *args, **kwargs)`, retrying with a smaller batch size after each out-of-memory
    error (`should_reduce_batch_size`), until it returns; its result is returned.

    Used as a decorator, with or without arguments; the wrapped function is called *without* the batch size,
    which it must take as its first parameter (passing it is refused with a TypeError). Build everything that
    holds memory (model, optimizer, loaders) inside it, so that a failed attempt's memory can be freed:
    between attempts the error and its frames are dropped, Python's garbage is collected and the device cache
    emptied. The next size is half the last, as Accelerate's guide and examples describe (its newest releases
    take 90% instead; pass ``reduce_batch_size_fn`` for any other rule: called with no arguments, it returns
    the next size, which must be smaller). At zero, a RuntimeError says so. A later call starts from the
    last size that ran. Any other error goes on untouched.

    On several processes (a process group is up when an attempt ends), every attempt runs with the same batch
    size on every process, and they retry or return together:

    - before an attempt, each process proposes a size and all take the smallest proposed;
    - after it, each says whether it ran out of memory; if any did, all retry (each calls
      ``reduce_batch_size_fn`` once, then the smallest proposal wins), so a process that succeeded drops its
      result and runs again with the others;
    - a process that fails with another error tells the others before raising it; they raise a RuntimeError
      naming that process instead of waiting for it.

    The notes go through the process group's key-value store, not through a collective, so they can never be
    paired with a collective of the function's own. The limit: an attempt must end (return or raise) on every
    process for them to agree. A process that runs out of memory while the others wait for it inside a
    collective of the function (DDP's gradient all-reduce in `backward`, a `gather`) cannot be brought back:
    they wait in that collective until the process group's timeout, then fail, and the process that ran out of
    memory raises their error (or, if none reports, says which processes did not finish the attempt). Data-
    parallel processes with the same shapes usually run out of memory at the same operation, before any of
    them waits for another; that case recovers. The process group must stay up across attempts (do not end
    it inside the function).

    Example:
        >>> @find_executable_batch_size(starting_batch_size=128)
        ... def train(batch_size, model_name):
        ...     accelerator.free_memory()
        ...     model, loader = accelerator.prepare(build_model(model_name), make_loader(batch_size))
        ...     ...
        >>> train("small")  # doctest: +SKIP
    """
    if function is not None and not callable(function):
        raise TypeError(f"find_executable_batch_size({function!r}): the first argument is the function to wrap; "
                        f"give the batch size by name: @find_executable_batch_size(starting_batch_size="
                        f"{function!r}).")
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise ValueError(f"find_executable_batch_size(starting_batch_size={starting_batch_size!r}): pass an integer "
                         f">= 1, the batch size to try first.")
    if reduce_batch_size_fn is not None and not callable(reduce_batch_size_fn):
        raise TypeError(f"find_executable_batch_size(reduce_batch_size_fn={reduce_batch_size_fn!r}): pass a function "
                        f"that takes no arguments and returns the next, smaller batch size, or None to halve it.")
    if function is None:  # (used as @find_executable_batch_size(...): the function comes next)
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    search = _BatchSizeSearch(function, starting_batch_size, reduce_batch_size_fn)

    @functools.wraps(function)
    def run_with_batch_size(*args: Any, **kwargs: Any) -> Any:
        return search.run(args, kwargs)

    return run_with_batch_size


class _BatchSizeSearch:
    """One decorated function: its current batch size, and the retry loop."""

    def __init__(self, function: Callable[..., Any], start: int, reduce_fn: Optional[Callable[[], int]]) -> None:
        self.function, self.batch_size, self.reduce_fn = function, start, reduce_fn
        self.name = getattr(function, "__name__", repr(function))

    def run(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
        _refuse_batch_size_argument(self.function, self.name, args, kwargs)
        clear_device_cache(garbage_collection=True)
        size, last_error = self.batch_size, ""
        tried: List[int] = []
        while True:
            size = self._agree_on_size(size, tried, last_error)
            self.batch_size = size
            tried.append(size)
            out_of_memory = None
            try:
                result = self.function(size, *args, **kwargs)
            except Exception as err:
                if not should_reduce_batch_size(err):
                    _tell_the_others(err)
                    raise
                out_of_memory = _describe(err)
            # (out of the except block: the error and its frames, which hold the attempt's tensors, are gone)
            failure = self._anyone_failed(out_of_memory, size)
            if failure is None:
                return result
            result = None
            clear_device_cache(garbage_collection=True)
            last_error = failure
            try:
                size = self._next_size(size)
            except Exception as err:
                _tell_the_others(err)
                raise

    def _next_size(self, size: int) -> int:
        if self.reduce_fn is None:
            return size // 2
        new = self.reduce_fn()
        if isinstance(new, bool) or not isinstance(new, int) or new < 0:
            raise TypeError(f"find_executable_batch_size: reduce_batch_size_fn {_name(self.reduce_fn)} returned "
                            f"{new!r} after batch size {size} ran out of memory; it must return an integer >= 0.")
        return new

    def _agree_on_size(self, size: int, tried: List[int], last_error: str) -> int:
        agreement = ProcessAgreement.current()
        if agreement is not None:
            notes = agreement.exchange({"size": size})
            self._stop_if_a_peer_stopped(notes, size if not tried else tried[-1], None)
            size = min(note["size"] for note in notes)
        if tried and size >= tried[-1]:
            raise ValueError(f"find_executable_batch_size: after batch size {tried[-1]} ran out of memory, "
                             f"reduce_batch_size_fn {_name(self.reduce_fn)} gave {size}; it must return a smaller "
                             f"batch size each time it is called.")
        if size == 0:
            raise RuntimeError(f"No executable batch size found, reached zero: {self.name} ran out of memory at every "
                               f"batch size tried ({', '.join(map(str, tried))}). Last error: {last_error}")
        return size

    def _anyone_failed(self, out_of_memory: Optional[str], size: int) -> Optional[str]:
        """After an attempt: None when it ran on every process, else what ran out of memory (and where)."""
        agreement = ProcessAgreement.current()
        if agreement is None:
            return out_of_memory
        notes = agreement.exchange({"oom": out_of_memory})
        self._stop_if_a_peer_stopped(notes, size, out_of_memory)
        failed = [f"process {rank}: {note['oom']}" for rank, note in enumerate(notes) if note.get("oom")]
        return "; ".join(failed) if failed else None

    def _stop_if_a_peer_stopped(self, notes: List[Dict[str, Any]], size: int, out_of_memory: Optional[str]) -> None:
        """Raise here too when another process stopped with an error (it posted it instead of a note)."""
        for rank, note in enumerate(notes):
            if "error" in note:
                mine = "" if out_of_memory is None else (
                    f" This process had run out of memory ({out_of_memory}) while process {rank} probably waited "
                    f"for it inside a collective of {self.name}: an out-of-memory error on only some processes in "
                    f"the middle of a step cannot be recovered. Use a batch size that fits on every process.")
                raise RuntimeError(f"find_executable_batch_size: process {rank} stopped with {note['error']} while "
                                   f"running {self.name} with batch size {size}; this process stops too (see process "
                                   f"{rank}'s output for its traceback).{mine}")


def _tell_the_others(err: BaseException) -> None:
    """Post this process's error as its next note, without waiting: the others raise instead of waiting for it."""
    agreement = ProcessAgreement.current()
    if agreement is not None:
        try:
            agreement.post({"error": _describe(err)})
        except Exception:  # (the store is gone too: the error itself matters more)
            pass


class ProcessAgreement:
    """Rounds of notes between the processes of a run, through the process group's key-value store.

    Each round, every process posts a small JSON note under the round's number and waits for everyone's.
    Store operations never pair with collectives, so a round cannot be mistaken for a collective of the
    user's code. A peer that left the job is noticed while waiting; a peer that never posts (stuck
    elsewhere) is reported after the process group's timeout plus a grace period.
    """

    _rounds = itertools.count()  # (every process runs the rounds in the same order, so the numbers match)
    GRACE_S = 10.0

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, guard: Any = None) -> None:
        self.store, self.rank, self.world_size, self.timeout_s, self.guard = store, rank, world_size, timeout_s, guard
        self.round: Optional[int] = None

    @classmethod
    def current(cls) -> Optional["ProcessAgreement"]:
        """The agreement for this process's run, or None on one process (or with no process group up)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
            return None
        from fabric_lite.state import current_strategy

        strategy = current_strategy()
        guard = strategy.process_group.hang_guard if strategy is not None and strategy.process_group is not None else None
        if guard is not None and strategy.world_size == dist.get_world_size():
            return cls(guard.store, strategy.global_rank, strategy.world_size, guard.timeout_s, guard)
        try:  # a process group the script started itself: its default store
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:
            return None
        timeout = getattr(store, "timeout", None)
        return cls(store, dist.get_rank(), dist.get_world_size(),
                   timeout.total_seconds() if timeout is not None else 1800.0)

    def _key(self, rank: int) -> str:
        return f"fabric_lite/batch_size/{self.round}/{rank}"

    def post(self, note: Dict[str, Any]) -> None:
        """Post this process's note for the next round without waiting for the others'."""
        self.round = next(self._rounds)
        self.store.set(self._key(self.rank), json.dumps(note))

    def exchange(self, note: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Post this process's note for the next round; every process's note, in rank order."""
        self.post(note)
        keys = [self._key(rank) for rank in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s + self.GRACE_S
        pause, next_look = 0.002, time.monotonic() + 1.0
        while not self.store.check(keys):
            now = time.monotonic()
            if now >= next_look and self.guard is not None:
                next_look = now + 1.0
                self._refuse_left_peers(keys)
            if now >= deadline:
                late = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                raise RuntimeError(
                    f"find_executable_batch_size: process(es) {late} did not finish their attempt within the process "
                    f"group's timeout ({self.timeout_s:g} s) while this process (rank {self.rank}) waited to agree "
                    f"on the next batch size. They are probably waiting inside a collective of the function (DDP's "
                    f"gradient all-reduce, a gather) for this process, which stopped at an out-of-memory error: an "
                    f"out-of-memory error on only some processes in the middle of a step cannot be recovered. Use a "
                    f"batch size that fits on every process.")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return [json.loads(self.store.get(key)) for key in keys]

    def _refuse_left_peers(self, keys: List[str]) -> None:
        gone = self.guard.exited()
        gone = [rank for rank in gone if not self.store.check([keys[rank]])]
        if gone:
            raise RuntimeError(f"find_executable_batch_size: process(es) {gone} left the job while this process "
                               f"(rank {self.rank}) waited to agree on the next batch size.")


def _refuse_batch_size_argument(function: Callable[..., Any], name: str, args: tuple, kwargs: Dict[str, Any]) -> None:
    """TypeError when the call passes the batch size itself (the decorator passes it), as Accelerate refuses."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # (no signature to read: a builtin)
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in parameters)
    if not positional and not takes_varargs:
        raise TypeError(f"find_executable_batch_size: {name} must take the batch size as its first parameter, "
                        f"e.g. `def {name}(batch_size, ...)`.")
    if positional and positional[0].kind != positional[0].POSITIONAL_ONLY and positional[0].name in kwargs:
        raise TypeError(f"Batch size was passed into `{name}` as `{positional[0].name}=` when called. Remove it: the "
                        f"decorator passes the batch size itself.")
    if not takes_varargs and len(args) + 1 > len(positional):
        shown = ", ".join(f"{p.name}={_short(v)}" for p, v in zip(positional[1:], args[1:]))
        raise TypeError(f"Batch size was passed into `{name}` as the first argument when called. Remove it, as the "
                        f"decorator already passes it: `{name}({shown})`.")


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 and "\n" not in text else f"<{type(value).__name__}>"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
