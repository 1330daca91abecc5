"""Drive `fabric-lite config` through a pseudo-terminal, as a person at a keyboard would.

argv[1] is a JSON list of [expected_text, answer] steps: wait until expected_text has appeared in
the terminal output since the previous answer, then type answer and Enter (answer null: Ctrl-D).
argv[2:] are extra arguments for `fabric-lite config`. Prints one JSON line: the transcript, the
command's exit code, and the step it was waiting at when it timed out (or null).
"""

import json
import os
import pty
import select
import sys
import time

STEP_TIMEOUT = 30.0

steps = json.loads(sys.argv[1])
pid, fd = pty.fork()
if pid == 0:  # the child: its stdin/stdout/stderr are the terminal
    os.execv(sys.executable, [sys.executable, "-m", "fabric_lite.cli", "config", *sys.argv[2:]])

transcript = b""
stuck = None


def read_some(deadline):
    global transcript
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return False
    try:
        chunk = os.read(fd, 4096)
    except OSError:  # EIO: the child closed the terminal
        chunk = b""
    if not chunk:
        raise EOFError
    transcript += chunk
    return True


try:
    seen_until = 0
    for index, (expected, answer) in enumerate(steps):
        deadline = time.monotonic() + STEP_TIMEOUT
        while expected.encode() not in transcript[seen_until:]:
            if not read_some(deadline):
                stuck = index
                raise TimeoutError
        seen_until = transcript.index(expected.encode(), seen_until) + len(expected)
        time.sleep(0.05)  # let input() start reading
        os.write(fd, b"\x04" if answer is None else answer.encode() + b"\n")
    deadline = time.monotonic() + STEP_TIMEOUT
    while read_some(deadline):
        pass
except (EOFError, TimeoutError):
    pass
done, status = os.waitpid(pid, os.WNOHANG)
if not done:
    if stuck is None:
        time.sleep(1.0)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:  # still waiting for an answer nobody will type
        stuck = len(steps) if stuck is None else stuck
        os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
print(json.dumps({"transcript": transcript.decode(errors="replace").replace("\r\n", "\n"),
                  "returncode": os.waitstatus_to_exitcode(status), "stuck_at": stuck}))
