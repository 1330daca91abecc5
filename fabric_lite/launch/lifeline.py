"""Workers that die with their launcher.

torch's elastic agent starts each worker in a session of its own, so when `fabric-lite launch` is killed
outright (SIGKILL: the out-of-memory killer, a scheduler's hard stop) nothing reaches its workers: they
would go on, orphaned, holding memory and waiting in collectives for peers that are gone. The launcher
puts its process id in the workers' environment; a worker whose parent it is asks the kernel (Linux) to
kill it when that parent dies. `import fabric_lite` does this, before anything else can hang.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV_LAUNCHER_PID", "follow_launcher"]

ENV_LAUNCHER_PID = "FABRIC_LITE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def follow_launcher() -> bool:
    """In a worker started by `fabric-lite launch`: die with it. Returns whether that was arranged.

    The variable is taken out of the environment, so this process's own children (DataLoader workers,
    another launch) are not mistaken for the launcher's."""
    launcher = os.environ.pop(ENV_LAUNCHER_PID, None)
    if launcher is None or not launcher.isdigit() or os.getppid() != int(launcher):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != int(launcher):  # the launcher died before the request was in place
        os._exit(128 + int(signal.SIGKILL))
    return True
