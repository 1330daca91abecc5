"""Iterable datasets with a state of their own (state_dict/load_state_dict) resume from that state, per process
and per loader worker, instead of re-reading what the epoch already saw; a `ShardedStream` deals what is left
over another number of processes or workers; what cannot go on is refused with the reason.

The first part builds the prepared loaders of several processes in one process (`shard_dataloader` with its
rank) and moves states between them as a checkpoint does; the second kills real runs (tests/workers/
stateful_sources.py: the raw door and the Trainer, a ShardedStream, a torchdata StatefulDataLoader and an HF
`datasets` streaming dataset, 2 loader workers each) and resumes them on 2 and on 1 process. Every read is
counted (a file each reading process or worker appends to).
"""

from __future__ import annotations

import gc
import importlib.util
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fabric_lite.data import ShardedStream, shard_dataloader

N = 48


class _Unobserved:
    def enter(self, loader):
        pass

    def leave(self, loader):
        pass

    def mark_last(self):
        pass


def prepare(loader, world=1, rank=0):
    return shard_dataloader(loader, num_replicas=world, rank=rank, device=None, gradient_state=_Unobserved())


class Reads:
    """Items read, by any process (a file each reader appends to)."""

    def __init__(self, path):
        self.path = Path(path)

    def __call__(self, item):
        with open(self.path, "a") as f:
            f.write(f"{item}\n")

    def take(self):
        """The items read since the last call."""
        text = self.path.read_text() if self.path.exists() else ""
        self.path.unlink(missing_ok=True)
        return [int(v) for v in text.split()]


class Counting(IterableDataset):
    """Items 0..n-1; worker w of W reads w, w + W, ...; its state: how many of those it has read."""

    def __init__(self, log, n=N):
        self.log, self.n, self.read, self.start = log, n, 0, 0

    def __iter__(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(w, self.n, nw))
        start, self.start = self.start, 0
        for k in range(start, len(mine)):
            self.log(mine[k])
            self.read = k + 1
            yield mine[k]

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.start = state["read"]


def flat(batches):
    return [i for b in batches for i in b]


def take(loader, count):
    """The first `count` batches of the loader's epoch (the iteration left there, as a killed run leaves it)."""
    it = iter(loader)
    got = [next(it).tolist() for _ in range(count)]
    del it
    return got


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_iterable_with_state_resumes_exactly_and_reads_nothing_again(tmp_path, workers, persistent):
    reads = Reads(tmp_path / "reads")

    def loader():
        return prepare(DataLoader(Counting(reads), batch_size=3, num_workers=workers,
                                  persistent_workers=persistent))

    straight = [b.tolist() for b in loader()]
    reads.take()
    for stop in (1, 3, 4):  # (with 2 workers: the next batch is worker 1's, then worker 0's)
        first = loader()
        before = take(first, stop)
        state = first.state_dict()
        assert state["source"]["kind"] == "state" and state["batches_seen"] == stop
        del first  # (its persistent workers stop reading ahead)
        gc.collect()
        reads.take()
        second = loader()
        second.load_state_dict(state)
        rest = [b.tolist() for b in second]
        assert before + rest == straight, stop
        again = reads.take()
        assert not set(again) & set(flat(before)), "an item seen before the checkpoint was read again"
        assert sorted(again) == sorted(set(range(N)) - set(flat(before)))
        assert [b.tolist() for b in second] == straight  # the next epoch starts afresh
        reads.take()


def _stream(reads, sizes=True):
    def read_shard(shard, start):
        for i in range(shard * 6 + start, shard * 6 + 6):
            reads(i)
            yield i
    return ShardedStream(list(range(8)), read_shard, shard_sizes=[6] * 8 if sizes else None)


def _run_ranks(reads, world, workers, stop, saved=None):
    """`world` processes' loaders over one ShardedStream: (the batches each yields in `stop` global steps, or to the
    end; their states). `saved`: every saved process's state, loaded as `load_state` hands it over."""
    loaders = [prepare(DataLoader(_stream(reads), batch_size=3, num_workers=workers), world, r) for r in range(world)]
    if saved is not None:
        same = len(saved) == world
        for r, loader in enumerate(loaders):
            state = dict(saved[r if same else 0])
            if not same:
                state["source_ranks"] = [s["source"] for s in saved]
            else:
                state["source"] = saved[r]["source"]
            loader.load_state_dict(state)
    iters = [iter(loader) for loader in loaders]
    got = [[] for _ in range(world)]
    step = 0
    while stop is None or step < stop:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            break
        for r, b in enumerate(batches):
            if b is not None:
                got[r].append(b.tolist())
        step += 1
    states = [loader.state_dict() for loader in loaders]
    del iters
    return got, states


@pytest.mark.parametrize("before,after", [((2, 2), (2, 2)), ((2, 0), (2, 0)), ((2, 2), (1, 2)), ((1, 2), (2, 2)),
                                          ((2, 2), (1, 0)), ((1, 0), (2, 2)), ((2, 2), (2, 1))])
def test_sharded_stream_deals_what_is_left_over_other_processes_and_workers(tmp_path, before, after):
    reads = Reads(tmp_path / "reads")
    (world, workers), (world2, workers2) = before, after
    full, _ = _run_ranks(reads, world, workers, None)
    assert sorted(flat(flat(full))) == list(range(N))
    reads.take()
    stop = 3 if world == 2 else 4
    seen, states = _run_ranks(reads, world, workers, stop)
    reads.take()
    rest, _ = _run_ranks(reads, world2, workers2, None, saved=states)
    again = reads.take()
    assert sorted(flat(flat(seen)) + flat(flat(rest))) == list(range(N)), "every item once in the epoch"
    assert not set(again) & set(flat(flat(seen))), "an item seen before the checkpoint was read again"
    if before == after:  # the same readers: each process goes on exactly as the uninterrupted run
        assert [s + r for s, r in zip(seen, rest)] == full
    else:  # balanced between the processes (shard_sizes known)
        counts = {len(flat(r)) for r in rest}
        assert len(counts) == 1, [len(flat(r)) for r in rest]


def test_a_source_that_cannot_say_what_is_left_is_refused(tmp_path):
    reads = Reads(tmp_path / "reads")
    first = prepare(DataLoader(Counting(reads), batch_size=3, num_workers=2))
    take(first, 2)
    state = first.state_dict()
    other = prepare(DataLoader(Counting(reads), batch_size=3))
    with pytest.raises(ValueError, match=r"Counting.*saved with 2 worker\(s\); this run has 1"):
        other.load_state_dict(state)
    # saved by 2 processes whose dataset states differ (each read a part of its own), resumed on 1
    mine = prepare(DataLoader(Counting(reads), batch_size=3))
    take(mine, 2)
    a = mine.state_dict()
    b = {**a, "source": {**a["source"], "states": [{"read": 99}]}}
    one = prepare(DataLoader(Counting(reads), batch_size=3))
    with pytest.raises(ValueError, match=r"Counting.*differs between the 2 processes.*ShardedStream"):
        one.load_state_dict({**a, "total_batch_size": 6, "source_ranks": [a["source"], b["source"]]})
    # a ShardedStream state of one process, loaded by hand on another number of processes
    seen, states = _run_ranks(reads, 2, 0, 2)
    lone = prepare(DataLoader(_stream(reads), batch_size=3))
    with pytest.raises(ValueError, match="needs every saved process's state"):
        lone.load_state_dict(states[0])
    with pytest.raises(ValueError, match="shard_sizes"):
        ShardedStream([1, 2], lambda s, i: [], shard_sizes=[1])


def test_statefuldataloader_with_two_workers_is_prepared_and_resumes_exactly(tmp_path):
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    reads = Reads(tmp_path / "reads")
    straight = [b.tolist() for b in prepare(StatefulDataLoader(Counting(reads), batch_size=3, num_workers=2))]
    first = prepare(StatefulDataLoader(Counting(reads), batch_size=3, num_workers=2))
    before = take(first, 5)
    state = first.state_dict()
    reads.take()
    second = prepare(StatefulDataLoader(Counting(reads), batch_size=3, num_workers=2))
    second.load_state_dict(state)
    rest = [b.tolist() for b in second]
    assert before + rest == straight
    assert not set(reads.take()) & set(flat(before))


def _hf_stream(folder, log):
    datasets = pytest.importorskip("datasets")
    folder.mkdir(exist_ok=True)
    for f in range(4):
        (folder / f"part{f}.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(f * 12, f * 12 + 12)))
    files = sorted(str(p) for p in folder.glob("part*.jsonl"))
    data = datasets.load_dataset("json", data_files=files, split="train", streaming=True)

    def logged(row):
        log(row["id"])
        return row

    return data.map(logged)


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_streaming_dataset_resumes_exactly_and_on_other_processes(tmp_path, workers):
    reads = Reads(tmp_path / "reads")

    def loader(world=1, rank=0):
        return prepare(DataLoader(_hf_stream(tmp_path / "data", reads), batch_size=3, num_workers=workers),
                       world, rank)

    straight = [b["id"].tolist() for b in loader()]
    assert sorted(flat(straight)) == list(range(N))
    reads.take()
    first = loader()
    it = iter(first)
    before = [next(it)["id"].tolist() for _ in range(5)]
    state = first.state_dict()
    del it
    reads.take()
    second = loader()
    second.load_state_dict(state)
    rest = [b["id"].tolist() for b in second]
    assert before + rest == straight
    assert not set(reads.take()) & set(flat(before)), "an item seen before the checkpoint was read again"
    # 1 -> 2 processes (each reads the stream and takes its slice of every 6 items): every item left once
    # (saved after 4 batches: what is left fills whole steps of 2 x 3)
    first = loader()
    it = iter(first)
    before = [next(it)["id"].tolist() for _ in range(4)]
    state = first.state_dict()
    del it
    reads.take()
    rest = []
    for rank in range(2):
        part = loader(2, rank)
        part.load_state_dict({**state, "source_ranks": [state["source"]]})
        rest += [b["id"].tolist() for b in part]
    assert sorted(flat(before) + flat(rest)) == list(range(N))


# -- killed runs ---------------------------------------------------------------------------------------------

HAVE_HF = importlib.util.find_spec("datasets") is not None
HAVE_TORCHDATA = importlib.util.find_spec("torchdata") is not None
CASES = ",".join(["stream"] + (["state"] if HAVE_TORCHDATA else []) + (["hf"] if HAVE_HF else []) + ["trainer"])


def _launch(out, root, phase, nproc):
    from test_resume import Run

    return Run("stateful_sources.py", out, "--phase", phase, "--root", root, "--cases", CASES, nproc=nproc,
               launcher="torchrun" if nproc > 1 else None, timeout=240)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Runs on 2 and on 1 process, each killed mid-epoch after a checkpoint: {world: (root, each rank's result)}."""
    from test_resume import killed_by

    base = tmp_path_factory.mktemp("stateful_sources")
    done = {}
    for world in (2, 1):
        run = _launch(base / f"crash{world}-out", base / f"crash{world}", "crash", world)
        code, output, results = run.wait()
        assert "kills itself" in output and not killed_by(code, 0) and all(r is not None for r in results), \
            (code, output[-6000:])
        done[world] = (base / f"crash{world}", results)
    return done


def _resume(tmp_path, crashed, saved_by, world):
    root, saved = crashed[saved_by]
    copy = tmp_path / "root"
    shutil.copytree(root, copy)  # (a resumed Trainer goes on saving checkpoints where it resumed from)
    results = _launch(tmp_path / "out", copy, "resume", world).ok()
    return copy, saved, results


def _reads(root, case):
    return Counter(int(v) for p in Path(root, case).glob("reads-resume-*.txt") for v in p.read_text().split())


@pytest.mark.slow
def test_killed_runs_resume_bit_exact_on_the_same_processes(tmp_path, crashed):
    root, saved, results = _resume(tmp_path, crashed, 2, 2)
    for case in CASES.split(","):
        for rank in range(2):
            full, before, after = saved[rank][case]["full"], saved[rank][case]["saved"], results[rank][case]
            assert len(before) == 3 and len(full["steps"]) == 16, (case, rank)  # 8 steps an epoch, saved after 3
            assert before + after["steps"] == full["steps"], (case, rank)
            assert after["weights"] == full["weights"], (case, rank)
        before = [i for r in range(2) for i in flat(saved[r][case]["saved"])]
        reads = _reads(root, case)
        # the resumed epoch reads only what was not seen; the next epoch reads everything once
        assert reads == Counter({i: 1 if i in before else 2 for i in range(N)}), case


@pytest.mark.slow
@pytest.mark.parametrize("saved_by,world", [(2, 1), (1, 2)])
def test_killed_runs_resume_on_another_number_of_processes_with_every_item_once(tmp_path, crashed, saved_by, world):
    root, saved, results = _resume(tmp_path, crashed, saved_by, world)
    for case in CASES.split(","):
        before = [i for r in range(saved_by) for i in flat(saved[r][case]["saved"])]
        after = [i for r in range(world) for i in flat(results[r][case]["steps"])]
        assert len(before) == (18 if saved_by == 2 else 12), case
        assert Counter(before + after) == Counter({i: 2 for i in range(N)}), case  # two epochs, each item once
        reads = _reads(root, case)
        assert reads == Counter({i: 1 if i in before else 2 for i in range(N)}), case
