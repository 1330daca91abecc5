"""Hang guard: when a collective fails or times out, say which process did not come, and where each was.

Before each collective a process writes "my n-th collective is <name>, called from <file:line>" into
the process group's key-value store (one key per rank, overwritten). When the collective fails
(torch.distributed raises after the group's timeout, or when a peer's connection drops), the
error is rebuilt from every rank's last entry: the ranks that are behind, or that entered a
different collective, are named with where their code stood.

A rank that leaves (its script ends, sys.exit) notes it in the store first. A rank killed outright (SIGKILL,
the out-of-memory killer) or crashed in native code leaves no note: each rank records its host and process id
at the start, and a survivor on the same machine looks whether that process still runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Callable, Dict, List, Optional, TypeVar

__all__ = ["HangGuard", "CollectiveError"]

T = TypeVar("T")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CollectiveError(RuntimeError):
    """A collective that did not complete, with what every process was doing."""


def _caller() -> str:
    """file:line of the first frame outside fabric_lite and torch (the user's call site)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_PACKAGE_DIR) and f"{os.sep}torch{os.sep}" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class HangGuard:
    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.count = 0
        self.last: Optional[dict] = None
        try:  # where this rank runs, so that the others can tell when it died without a note (`died`)
            store.set(self._process_key(rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        except Exception:  # diagnosis only
            pass

    def _key(self, rank: int) -> str:
        return f"fabric_lite/hang_guard/{rank}"

    def _exit_key(self, rank: int) -> str:
        return f"fabric_lite/exited/{rank}"

    def _process_key(self, rank: int) -> str:
        return f"fabric_lite/process/{rank}"

    # -- leaving: a rank whose interpreter exits while the job still runs (sys.exit, the end of its script
    # without end_training()) notes it, so that the others' errors name it
    def note_exit(self) -> None:
        entry = {"after": self.count, **({"op": self.last["op"], "at": self.last["at"]} if self.last else {})}
        try:
            self.store.set(self._exit_key(self.rank), json.dumps(entry))
        except Exception:  # diagnosis only
            pass

    def wait_for_exits(self, seconds: float) -> List[int]:
        """Wait up to `seconds` for every rank to note its exit; the ranks that did not."""
        import time

        keys = [self._exit_key(rank) for rank in range(self.world_size)]
        deadline = time.monotonic() + seconds
        while True:  # polled: the store's own wait logs a warning when it times out
            try:
                if self.store.check(keys):
                    return []
            except Exception:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        late = []
        for rank, key in enumerate(keys):
            try:
                if not self.store.check([key]):
                    late.append(rank)
            except Exception:
                late.append(rank)
        return late

    def exited(self) -> Dict[int, dict]:
        """The other ranks that have left the job, with their notes (empty when the store cannot tell)."""
        out: Dict[int, dict] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                key = self._exit_key(rank)
                if self.store.check([key]):
                    out[rank] = json.loads(self.store.get(key))
            except Exception:
                return out
        return out

    def died(self, left: Dict[int, dict], wait_s: float = 0.5) -> List[int]:
        """The other ranks on this machine, not among those that `left` with a note, whose process is gone
        (killed or crashed). Ranks on other machines cannot be looked at from here and are not listed.

        A killed process closes its connections before the kernel marks it dead: for up to `wait_s` it is
        looked at again while none is found."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            out = self._dead_now(left)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.02)

    def _dead_now(self, left: Dict[int, dict]) -> List[int]:
        host = socket.gethostname()
        out: List[int] = []
        for rank in range(self.world_size):
            if rank == self.rank or rank in left:
                continue
            try:
                key = self._process_key(rank)
                if not self.store.check([key]):
                    continue
                where = json.loads(self.store.get(key))
            except Exception:
                return out
            if where.get("host") == host and not _running(int(where["pid"])):
                out.append(rank)
        return out

    def explain_lost_peer(self, what: str, err: BaseException) -> Optional[str]:
        """Why `what` (a collective outside `run`, like DDP's gradient all-reduce) failed, if a rank left or died."""
        gone = self.exited()
        dead = self.died(gone, wait_s=0.0 if gone else 0.5)  # (quick: the launcher soon stops the survivors)
        if not gone and not dead:
            return None
        why = "; ".join(part for part in (_left(gone) if gone else "", _died(dead)) if part)
        advice = ("Every rank must run to the end together; call accelerator.end_training() (or let fit() return) "
                  "on every rank before a script ends." if gone else
                  "Its own output, the launcher's summary and the system log (the out-of-memory killer) say why it "
                  "ended; resume from the last checkpoint.")
        return f"Rank {self.rank}: {what} failed because {why}.\nCause: {_first_line(err)}\n{advice}"

    def run(self, name: str, fn: Callable[[], T]) -> T:
        self.count += 1
        entry = {"n": self.count, "op": name, "at": _caller()}
        self.last = entry
        try:
            self.store.set(self._key(self.rank), json.dumps(entry))
        except Exception:  # the store is only for diagnosis: never fail a collective because of it
            pass
        try:
            return fn()
        except RuntimeError as err:
            raise CollectiveError(self.explain(entry, err)) from err

    def _entries(self) -> List[Optional[dict]]:
        out: List[Optional[dict]] = []
        for rank in range(self.world_size):
            try:
                key = self._key(rank)
                out.append(json.loads(self.store.get(key)) if self.store.check([key]) else None)
            except Exception:
                out.append({"unreachable": True})
        return out

    def explain(self, mine: dict, err: BaseException) -> str:
        entries = self._entries()
        if all(e is not None and e.get("unreachable") for e in entries):
            peers = "the key-value store (hosted by rank 0) is unreachable: rank 0 has probably died"
            return (f"Rank {self.rank}: collective #{mine['n']} {mine['op']} (at {mine['at']}) failed: "
                    f"{_first_line(err)}. Could not read the other ranks' progress: {peers}.")
        missing, lines = [], []
        gone = self.exited()
        dead = self.died(gone, wait_s=0.0 if gone else 0.5)  # (quick: the launcher soon stops the survivors)
        for rank, entry in enumerate(entries):
            if rank in gone:
                missing.append(rank)
                lines.append(f"  rank {rank}: {_left({rank: gone[rank]})}")
                continue
            if rank in dead:
                missing.append(rank)
                lines.append(f"  rank {rank}: {_died([rank])}")
                continue
            if entry is None:
                lines.append(f"  rank {rank}: no collective yet")
                missing.append(rank)
                continue
            state = f"#{entry['n']} {entry['op']} at {entry['at']}"
            if entry["n"] < mine["n"]:
                missing.append(rank)
                lines.append(f"  rank {rank}: behind, last entered {state}")
            elif entry["n"] == mine["n"] and entry["op"] != mine["op"]:
                missing.append(rank)
                lines.append(f"  rank {rank}: entered a different collective, {state}")
            else:
                lines.append(f"  rank {rank}: {state}")
        who = (f"rank(s) {', '.join(map(str, missing))} did not arrive" if missing
               else "every rank entered it (a peer may have died or lost its connection)")
        return (f"Collective #{mine['n']} {mine['op']} on rank {self.rank} (called at {mine['at']}) did not complete "
                f"within the process group's timeout ({self.timeout_s:g} s) or lost a peer: {who}.\n"
                + "\n".join(lines)
                + f"\nCause: {_first_line(err)}\nEvery rank must make the same collective calls in the same order; "
                  f"look for a collective inside a rank-dependent branch (e.g. `if accelerator.is_main_process:`).")


def _left(gone: Dict[int, dict]) -> str:
    parts = []
    for rank, note in sorted(gone.items()):
        where = f", after collective #{note['after']} {note['op']} at {note['at']}" if note.get("op") else ""
        parts.append(f"rank {rank} left the job (its script ended or called sys.exit() before the others{where})")
    return "; ".join(parts)


def _died(ranks: List[int]) -> str:
    if not ranks:
        return ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (f"{who} died ({'its process is' if len(ranks) == 1 else 'their processes are'} gone with no note of "
            f"leaving: killed by a signal such as SIGKILL, e.g. by the out-of-memory killer, or crashed)")


def _running(pid: int) -> bool:
    """Whether process `pid` on this machine still runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
