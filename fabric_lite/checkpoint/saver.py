"""Writing, agreeing on and publishing one checkpoint, on the training thread or on a background one.

A save is a `SaveJob`: the files to write (state already collected), the manifest's meta, and what
to do once it is published. `run_job` writes this process's files under the staging name, has every
process report its checksums (or its error), and lets the main process publish: manifest last, the
directory moved into place, ``latest`` updated, old checkpoints pruned. Any failure anywhere aborts
the whole save and raises the same `CheckpointError` on every process; the previous checkpoint stays.

`CheckpointSaver` runs jobs. A blocking save runs on the training thread and agrees over the
training process group. A background save (`save_state(..., blocking=False)`) costs the training
thread only a snapshot: tensors copied into host buffers that are reused from save to save (pinned
memory for CUDA tensors, copied asynchronously on the current stream; the writer waits for the copy).
A sharded checkpoint's snapshot keeps each shard's placement (a DTensor over a host copy of its local part),
and DCP writes it from the background thread; an engine that writes its own files (DeepSpeed) hands them over
on the training thread and they are snapshot the same way. The job then runs on a thread of its own, and
agrees (DCP's planning included) over a gloo process group of its own: the training group is never used
from two threads. One save is in flight at a time: the next one waits for it, or is skipped where every
process agrees it is still running (``if_busy="skip"``).
A background failure is kept and raised on the training thread by `wait`, by the next save, and by
`raise_failure` where the doors' per-step agreement reports it (every process at the same step).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lite.checkpoint import files as checkpoint_io
from fabric_lite.checkpoint.files import CheckpointError, CheckpointWriter

__all__ = ["SaveJob", "run_job", "CheckpointSaver", "IF_BUSY", "SaveRecord", "Snapshot", "snapshot"]

#: What a save does while another is in flight: wait for it, or be skipped.
IF_BUSY = ("wait", "skip")


@dataclass
class SaveJob:
    """One checkpoint to write and publish (see the module docstring)."""

    url: str
    token: str
    files: Dict[str, Any] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    update_latest: bool = False
    durable: bool = False
    #: Writes files of an engine that serializes its own state (DCP shards, DeepSpeed); called with the writer
    #: and the process group to agree over (None: the training group, on the training thread). A collective.
    write_more: Optional[Callable[[CheckpointWriter, Any], None]] = None
    #: Run by the main process once the checkpoint is published (pruning older ones).
    after_commit: List[Callable[[], None]] = field(default_factory=list)
    #: Waits until the snapshot's device-to-host copies are done (None: nothing to wait for).
    ready: Optional[Callable[[], None]] = None
    #: An error met while collecting the state: reported like a failed write, so no process waits for this one.
    error: Optional[BaseException] = None


class _Agreement:
    """How the processes of one save compare notes: over the strategy's collectives (training thread)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.is_main = strategy.is_global_zero
        #: The process group an engine's collective write uses (None: the training group).
        self.group: Any = None

    def gather(self, obj: Any) -> List[Any]:
        return self.strategy.collectives.all_gather_object(obj)

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.collectives.broadcast_object(obj)


class _SideAgreement(_Agreement):
    """Over a process group of its own (a background thread must not use the training group)."""

    def __init__(self, strategy: Any, group: Any) -> None:
        super().__init__(strategy)
        self.group = group

    def gather(self, obj: Any) -> List[Any]:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def run_job(job: SaveJob, agreement: Any) -> None:
    """Write this process's files, agree, publish (main process); every process raises the same error on failure."""
    writer: Optional[CheckpointWriter] = None
    error = job.error
    try:
        writer = CheckpointWriter(job.url, staging_token=job.token, durable=job.durable)
        if agreement.is_main:
            try:
                writer.clean_up_interrupted()
            except Exception as err:  # reported below; the engine's collective write must still take place
                error = error or err
        if job.write_more is not None:  # collective: every process takes part, whatever else failed here
            if job.ready is not None:  # (what it writes may be a snapshot still being copied)
                job.ready()
            job.write_more(writer, agreement.group)
        if error is None:
            if job.ready is not None:
                job.ready()
            for name, obj in job.files.items():
                writer.write(name, obj)
    except Exception as err:  # every process must reach the gather below, or the others wait for ever
        error = error or err
    reports = agreement.gather((_describe(error) if error else None, writer.checksums if writer else {}))
    failed = {rank: msg for rank, (msg, _) in enumerate(reports) if msg is not None}
    if failed:
        if writer is not None:
            if agreement.is_main:
                writer.abort()  # the previous checkpoint at `url`, if any, is untouched
            writer.release()
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed.items())
        raise CheckpointError(f"save_state({job.url}) failed and wrote nothing ({detail}). The previous checkpoint "
                              f"there, if any, is intact.") from error
    outcome: Optional[str] = None
    if agreement.is_main:
        try:
            checksums: Dict[str, str] = {}
            for _, part in reports:
                checksums.update(part)
            assert writer is not None
            writer.commit(checksums, job.meta)
        except Exception as err:
            error, outcome = err, (f"could not publish the checkpoint and wrote nothing ({_describe(err)}). The "
                                   f"previous checkpoint there, if any, is intact.")
            _abort_quietly(writer)
        if outcome is None:
            step = _LATEST_STEP
            try:
                if job.update_latest:
                    checkpoint_io.update_latest(job.url, durable=job.durable)
                for action in job.after_commit:
                    label: str = getattr(action, "__name__", "a follow-up")
                    step = (action.__doc__ or label).strip().rstrip(".")
                    action()
            except Exception as err:
                error, outcome = err, (f"published the checkpoint, which is whole, but then {step} failed: "
                                       f"{_describe(err)}.")
                if step == _LATEST_STEP:
                    outcome += (" `latest` still names the checkpoint before it; resuming from the newest "
                                "(load_state() without a directory, fit(ckpt_path='last')) finds this one by its time.")
    if writer is not None:
        writer.release()  # (the main process's commit or abort already did)
    outcome = agreement.broadcast(outcome)
    if outcome is not None:
        raise CheckpointError(f"save_state({job.url}) {outcome}") from error


_LATEST_STEP = "updating `latest`"


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _abort_quietly(writer: Optional[CheckpointWriter]) -> None:
    try:
        if writer is not None:
            writer.abort()
    except Exception:  # the staging directory is cleaned up by the next save of this name
        pass


# -- snapshots ------------------------------------------------------------------------------------------

class _HostBuffers:
    """Host copies of a state's tensors, kept from one save to the next (one snapshot's worth at most)."""

    def __init__(self) -> None:
        self.buffers: List[torch.Tensor] = []
        self.position = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def take(self, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        i = self.position
        self.position += 1
        if i < len(self.buffers):
            buffer = self.buffers[i]
            if buffer.shape == like.shape and buffer.dtype == like.dtype and buffer.is_pinned() == pinned:
                return buffer
        buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        if i < len(self.buffers):
            self.buffers[i] = buffer
        else:
            self.buffers.append(buffer)
        return buffer


def _identity(tensor: torch.Tensor) -> Tuple[Any, ...]:
    """What makes two tensors the same view of the same memory (tied weights appear under two names)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        return (id(tensor),)
    return (tensor.device, tensor.dtype, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tensor.stride())


class Snapshot:
    """Copies of states that training can no longer change, taken one after the other into the same host buffers
    (`copy`, as often as needed: an engine hands over its files one at a time), then `finish`."""

    def __init__(self, buffers: _HostBuffers) -> None:
        self.buffers = buffers
        buffers.position = 0
        self.devices: set = set()
        self.seen: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(tensor, dtensor):
            # a shard of a sharded tensor: its local part copied, wrapped again with the same placement, so that
            # DCP plans and writes it as it would the original (planning reads the layout, not the device)
            return dtensor(self.copy_tensor(tensor.to_local()), tensor._spec, requires_grad=False)
        if tensor.layout != torch.strided or tensor.is_quantized or type(tensor) is not torch.Tensor:
            return tensor.to("cpu", copy=True)  # (sparse, quantized, subclasses: the plain way, no reuse)
        if tensor.device.type == "cuda":
            self.devices.add(tensor.device)
            buffer = self.buffers.take(tensor, pinned=True)
            buffer.copy_(tensor, non_blocking=True)  # after every kernel queued so far on this stream
            return buffer
        if tensor.device.type != "cpu":
            return tensor.to("cpu")
        buffer = self.buffers.take(tensor, pinned=False)
        buffer.copy_(tensor)
        return buffer

    def copy(self, obj: Any) -> Any:
        """A copy of `obj`: tensors in host buffers (a tensor that appears twice, as tied weights do, copied once),
        containers rebuilt (their type and a state dict's ``_metadata`` kept), other values deep-copied."""
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach()
            dtensor = _dtensor_type()
            key = (("shard",) + _identity(tensor.to_local()) if dtensor is not None and isinstance(tensor, dtensor)
                   else _identity(tensor))
            if key not in self.seen:
                self.seen[key] = self.copy_tensor(tensor)
            return self.seen[key]
        if isinstance(obj, dict):
            try:
                out: Any = copy.copy(obj)  # the same type (OrderedDict, defaultdict and its factory, ...)
                out.clear()
            except Exception:
                out = {}
            for k, v in obj.items():
                out[k] = self.copy(v)
            metadata = getattr(obj, "_metadata", None)  # a state dict's module versions
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self.copy(v) for v in obj)
        return copy.deepcopy(obj)

    def finish(self) -> Optional[Callable[[], None]]:
        """Give back the buffers no longer needed; return what waits for the device copies (None when none)."""
        del self.buffers.buffers[self.buffers.position:]  # the state shrank: give back what it no longer needs
        if not self.devices:
            return None
        events = []
        for device in self.devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)

        def copies_done() -> None:
            for event in events:
                event.synchronize()

        return copies_done


def _dtensor_type() -> Any:
    """torch's DTensor class (None where torch.distributed is not built)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return DTensor


def snapshot(state: Any, buffers: _HostBuffers) -> Tuple[Any, Optional[Callable[[], None]]]:
    """A copy of `state` that training can no longer change (see `Snapshot.copy`), and what waits for the
    device copies (None when none)."""
    taken = Snapshot(buffers)
    copied = taken.copy(state)
    return copied, taken.finish()


# -- the saver ------------------------------------------------------------------------------------------

@dataclass
class SaveRecord:
    """When one save ran: `blocked` is the time the training thread spent on it (seconds)."""

    url: str
    background: bool
    started: float
    blocked: float
    finished: Optional[float] = None
    error: Optional[str] = None


class CheckpointSaver:
    """Runs the saves of one Accelerator: blocking ones in place, background ones one at a time on a thread."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.buffers = _HostBuffers()
        #: One record per save, oldest first (for benchmarks and tests; never pruned by itself: tiny).
        self.history: List[SaveRecord] = []
        self._group: Any = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._deferred: Optional[CheckpointError] = None
        self._warned: set = set()

    # -- state ----------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """A background save finished with an error that has not been raised yet (this process)."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held for background snapshots (one checkpoint's tensors at most)."""
        return self.buffers.nbytes

    def why_blocking(self) -> Optional[str]:
        """Why a save cannot run in the background with this strategy (None: it can)."""
        strategy = self.strategy
        fmt = strategy.checkpoint_format
        if fmt.engine_owned and not fmt.stages_engine_files:
            return (f"{type(strategy).__name__} writes its checkpoints through its own engine ({fmt.engine}) on the "
                    f"training thread")
        if not fmt.background:
            return f"{type(strategy).__name__} cannot copy its state to the host without a step of its runtime"
        if strategy.world_size > 1 and strategy.process_group is None:
            return f"{type(strategy).__name__} has no process group to agree over off the training thread"
        return None

    def busy_anywhere(self) -> bool:
        """Whether a background save is still running on some process (every process, together: a collective
        where there are several)."""
        busy = self.in_flight
        if self.strategy.world_size > 1:  # every process must make the same choice, whatever it waited for
            flag = torch.tensor([1.0 if busy else 0.0], device=self.strategy.root_device)
            busy = bool(self.strategy.collectives.all_reduce(flag, "max").item())
        return busy

    def warn_once(self, reason: str) -> None:
        import warnings

        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"save_state(blocking=False): {reason}, so this save blocks until it is written.",
                          stacklevel=4)

    # -- the training thread ----------------------------------------------------------------------------
    def make_room(self, if_busy: str) -> bool:
        """Before a save (every process, together): False if it is to be skipped because the one in flight
        is still running on some process; otherwise wait for that one. Its failure is kept for
        `raise_deferred`, after this save: one failed save does not stop the next from being written."""
        if if_busy not in IF_BUSY:
            raise ValueError(f"if_busy={if_busy!r}: allowed values are {', '.join(map(repr, IF_BUSY))}.")
        if if_busy == "skip" and self.busy_anywhere():
            return False
        try:
            self.wait()
        except CheckpointError as err:
            self._deferred = err
        return True

    def raise_deferred(self, url: str) -> None:
        """Raise the failure of the save before, which `make_room` kept while this one (`url`) went ahead."""
        error, self._deferred = self._deferred, None
        if error is not None:
            raise CheckpointError(f"{error} (Raised now, after save_state({url}) went ahead.)") from error

    def wait(self) -> None:
        """Wait for the save in flight on this process; raise its failure (once)."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def raise_failure(self) -> None:
        """Some process reported a failed background save: raise it here too (after this process's ends)."""
        self.wait()
        raise CheckpointError("A background checkpoint save failed on another process (its error is raised "
                              "there); the previous checkpoint is intact.")

    def run(self, job: SaveJob, background: bool, blocked_since: float) -> None:
        """Run `job` now (blocking) or start it on the background thread (after `make_room`)."""
        record = SaveRecord(job.url, background, started=blocked_since, blocked=0.0)
        self.history.append(record)
        if not background:
            try:
                run_job(job, _Agreement(self.strategy))
            except BaseException as err:
                record.error = _describe(err)
                raise
            finally:
                record.finished = time.perf_counter()
                record.blocked = record.finished - blocked_since
            return
        if self.strategy.world_size > 1 and self._group is None:
            self._group = self.strategy.process_group.new_side_group()  # collective: every process is in this save
        agreement = _SideAgreement(self.strategy, self._group)

        def work() -> None:
            try:
                run_job(job, agreement)
            except BaseException as err:  # kept for the training thread
                self._error = err
                record.error = _describe(err)
                if not threading.main_thread().is_alive():  # the script has ended: nobody will raise it
                    print(f"fabric_lite: a background checkpoint save failed as the process exited: {err}",
                          file=sys.stderr, flush=True)
            finally:
                if job.ready is not None:  # no copy into these buffers may outlive the job
                    job.ready()
                job.files.clear()
                record.finished = time.perf_counter()

        # not a daemon: the interpreter waits for a save in flight before it exits
        self._thread = threading.Thread(target=work, name="fabric_lite_checkpoint_save", daemon=False)
        record.blocked = time.perf_counter() - blocked_since
        self._thread.start()

    def release_group(self) -> None:
        """Forget the side process group (the process group is being shut down)."""
        self._group = None

    def close(self, quiet: bool = False) -> None:
        """Wait for the save in flight (raising its failure unless `quiet`: another error is on its way), then
        free the snapshot buffers."""
        try:
            self.wait()
        except BaseException:
            if not quiet:
                raise
        finally:
            self.buffers = _HostBuffers()
