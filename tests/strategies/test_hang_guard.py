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
    assert acc.strategy.hang_guard is None
    assert torch.equal(acc.reduce(torch.ones(2)), torch.ones(2))
