"""Locks for two runs that save into one directory at once (local disks).

Publishing (the moves of a commit, recovery, cleanup of what interrupted saves left, `latest`, pruning)
holds an exclusive lock on the directory the checkpoints are published in; each writer holds a shared
lock on its staging directory for as long as it writes, so that another run's cleanup leaves a staging
directory alone while its writer lives (a crashed writer's lock goes with its process). flock() locks
are advisory, per open file, and released by the kernel when the process dies. Other stores (object
stores) have no locks: there, give each run its own directory.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Dict, Iterator, Optional

from fabric_lite.checkpoint import checksums as digests

__all__ = ["publishing", "lock", "unlock", "is_stale"]

class _Held:
    def __init__(self) -> None:
        self.guard = threading.RLock()  # the threads of this process, one at a time (re-entrant)
        self.depth = 0
        self.fd: Optional[int] = None


_HELD: Dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()
#: Every lock descriptor open in this process. A flock belongs to the open file, which a forked child
#: (a DataLoader worker) shares: the child closes its copies at once, or a lock taken by a background
#: save would be held for as long as the worker lives, and the next publish would wait for ever.
_LOCK_FDS: set = set()


#: Held while a lock descriptor is opened or closed, and by fork (below): a child never copies a descriptor
#: that is not yet, or no longer, in _LOCK_FDS.
_FD_GUARD = threading.Lock()


def _forget_locks_in_child() -> None:
    global _HELD, _HELD_GUARD, _FD_GUARD
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _HELD, _HELD_GUARD = {}, threading.Lock()  # (another thread may have held one at the fork)
    _FD_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _FD_GUARD.acquire(), after_in_parent=lambda: _FD_GUARD.release(),
                        after_in_child=_forget_locks_in_child)


def _open_lock_fd(path: str) -> int:
    with _FD_GUARD:
        fd = os.open(path, os.O_RDONLY)
        _LOCK_FDS.add(fd)
    return fd


def unlock(fd: Optional[int]) -> None:
    if fd is not None:
        with _FD_GUARD:
            _LOCK_FDS.discard(fd)
            os.close(fd)


def lock(path: str, flags: int) -> Optional[int]:
    """An open descriptor of directory `path` holding flock `flags`; None where locks are not supported.
    Raises BlockingIOError when `flags` has LOCK_NB and another holds a conflicting lock.

    The descriptor is registered before it is locked, so a fork while this thread waits for the lock (or
    has just got it) leaves the child closing its copy (`_forget_locks_in_child`)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        return None
    try:
        fd = _open_lock_fd(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        unlock(fd)
        raise
    except OSError:  # a file system without flock (some network mounts): go on unlocked, as before
        unlock(fd)
        return None
    return fd


@contextlib.contextmanager
def publishing(fs: Any, directory: str) -> Iterator[None]:
    """Hold the lock under which checkpoints are published into `directory` (re-entrant; local disks)."""
    if not digests.is_local(fs):
        yield
        return
    path = os.path.realpath(fs._strip_protocol(directory))
    with _HELD_GUARD:
        held = _HELD.setdefault(path, _Held())
    with held.guard:
        if held.depth == 0:
            import fcntl

            held.fd = lock(path, fcntl.LOCK_EX)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0:
                unlock(held.fd)
                held.fd = None


def is_stale(fs: Any, path: str) -> bool:
    """Whether the staging directory `path` has no live writer (its shared lock is gone)."""
    if not digests.is_local(fs):
        return True
    import fcntl

    try:
        fd = lock(fs._strip_protocol(path), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    unlock(fd)
    return True
