"""The hang guard: a collective that one rank skips fails within the timeout and names that rank."""


import pytest
import torch

from fabric_lite.strategies.hang_guard import CollectiveError, HangGuard


def test_a_skipped_collective_fails_within_the_timeout_naming_the_missing_rank(launch):
    r0, r1 = launch("hang_guard", 2, timeout=120)
    assert r1["error"] is None
    assert r0["error"] == "CollectiveError"
    assert r0["seconds"] < 30
    message = r0["message"]
    assert "rank(s) 1 did not arrive" in message
    assert "rank 1: behind, last entered #2 barrier at hang_guard.py" in message
    assert "#3 all_gather" in message and "hang_guard.py:" in message  # where rank 0 stood, in the user's file


class DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_a_different_collective_at_the_same_position_is_named():
    store = DictStore()
    other = HangGuard(store, 1, 2, 5.0)
    other.run("broadcast(src=0)", lambda: None)
    mine = HangGuard(store, 0, 2, 5.0)

    def fails():
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    with pytest.raises(CollectiveError) as err:
        mine.run("all_reduce(sum)", fails)
    text = str(err.value)
    assert "rank(s) 1 did not arrive" in text and "entered a different collective, #1 broadcast(src=0)" in text
    assert "Timed out waiting" in text


def test_a_store_that_cannot_be_reached_still_gives_a_clear_error():
    class DeadStore:
        def set(self, key, value):
            raise RuntimeError("connection reset")

        get = check = set

    guard = HangGuard(DeadStore(), 1, 2, 5.0)
    with pytest.raises(CollectiveError, match="rank 0 has probably died"):
        guard.run("barrier", lambda: (_ for _ in ()).throw(RuntimeError("Connection closed by peer")))


def test_one_process_runs_no_guard():
    from fabric_lite import Accelerator

    acc = Accelerator()
    assert acc.strategy.process_group is None or acc.strategy.process_group.hang_guard is None
    assert torch.equal(acc.reduce(torch.ones(2)), torch.ones(2))


def _launch_leave_early(tmp_path, *args):
    import sys
    import time

    from conftest import WORKERS, free_port, run_command

    cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(WORKERS / "leave_early.py"), "--out", str(tmp_path), *map(str, args)]
    started = time.monotonic()
    done = run_command(cmd, timeout=150)
    return done, time.monotonic() - started


@pytest.mark.timeout(200)
@pytest.mark.parametrize("leaver,code", [(1, 0), (0, 3)], ids=["rank1-exit0", "rank0-exit3"])
def test_a_rank_that_exits_mid_training_makes_the_others_fail_at_once_naming_it(tmp_path, leaver, code):
    """Before: the leaving rank's exit hook waited in a barrier while the others waited for it in their
    gradient all-reduce, all of them until the process group's timeout (30 minutes), printing nothing."""
    done, seconds = _launch_leave_early(tmp_path, "--leaver", leaver, "--code", code, "--steps", 100000)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert seconds < 90, seconds  # the launch itself takes ~10 s here; the grace at exit 5 s
    assert f"fabric_lite: rank {leaver} is exiting, but rank(s) {1 - leaver} did not reach their end" in output
    if leaver == 1:  # (rank 0 hosts nothing here: the launcher's agent holds the store, so rank 1 can read it)
        assert "the gradient all-reduce in backward() failed because rank 1 left the job" in output, output[-3000:]
    else:
        assert "rank 0 left the job" in output, output[-3000:]


@pytest.mark.timeout(200)
def test_ranks_that_end_together_without_end_training_leave_cleanly(tmp_path):
    done, seconds = _launch_leave_early(tmp_path, "--leaver", -1, "--steps", 20)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "is exiting, but" not in output and output.count("finished at") == 2


@pytest.mark.timeout(200)
def test_a_rank_killed_mid_training_is_named_by_the_others(tmp_path):
    """Before: the survivor showed only gloo's "Read error ...: Connection reset by peer" from its gradient
    all-reduce; a SIGKILLed rank runs no exit hook, so it leaves no note of leaving to read."""
    done, seconds = _launch_leave_early(tmp_path, "--leaver", 1, "--sigkill", "--steps", 100000)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert seconds < 90, seconds
    assert "rank 1 killing itself at step 3" in output, output[-3000:]
    assert "CollectiveError: Rank 0: the gradient all-reduce in backward() failed because rank 1 died" in output, \
        output[-3000:]
    assert "killed by a signal" in output
