"""Strategy conformance: one suite, run for every strategy in STRATEGIES, through both front doors.

What every strategy must do, each asserted numerically against an independent reference:

1. parity: W processes with batch b end with the weights of a plain torch loop (no fabric_lite) with
   batch W*b over the same sample order;
2. accumulation: 2 micro-batches of b/2 equal one batch of b (Accelerator.accumulate and the Trainer's
   accumulate_grad_batches), and both equal the plain loop;
3. clipping: clip_grad_norm_ / gradient_clip_val equal torch.nn.utils.clip_grad_norm_ in the plain loop;
4. collectives: gather, reduce, pad_across_processes, broadcast, gather_object, gather_for_metrics;
5. checkpoints: save_state -> load_state into fresh objects restores weights and optimizer state
   exactly; Trainer.save_checkpoint -> fit(ckpt_path=...) ends where an uninterrupted fit ends;
6. killed and resumed: bit for bit equal to never having stopped (load_state / fit(ckpt_path="last"));
7. bad input: clear ValueErrors.

Cost: two launches per strategy (tests/workers/conformance.py): the first runs cases 1-5 and 7 and ends
killed (case 6's crash); the second resumes. A module-scoped fixture starts them once per strategy, on
first use, and every test reads the cached results. Each launch has a timeout (the launcher's whole
process group is killed when it runs out), so a hang fails instead of blocking. The plain-torch
references are computed here, in the pytest process. The whole file: about 2 minutes on 2 CPU cores with
DeepSpeed's ops already built (16 launches, 8 strategies), plus about 1.5 minutes for the three N-D layouts
(6 launches of 4 processes).

N-D layouts (HSDP, FSDP x TP, ModelParallelStrategy) run the same cases. Where tensor parallelism takes part,
only `Case.dp` of the processes read their own samples: the global batch is dp x b, the sample order is sharded
over the data-parallel ranks (the ranks of one tensor-parallel group read the same batches, which is asserted),
and gather_for_metrics returns each sample once. The worker applies tensor parallelism to every model on the
mesh's tensor-parallel dimension; the plain-torch references are the same whole models.

"""

from __future__ import annotations

import importlib.util
import json
import signal
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from conftest import WORKERS
from test_resume import Run, assert_bit_equal, killed_by, latest_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # each launch carries its own, shorter timeout


@dataclass(frozen=True)
class Case:
    name: str                   # the registry name, as `strategy=` takes it
    nproc: int                  # processes to launch (1: a plain `python worker.py`, else torchrun)
    needs: Optional[str] = None  # an optional package it needs: the cases skip without it
    timeout: int = 180          # seconds for one launch, hang included
    env: Tuple[Tuple[str, str], ...] = ()  # environment variables the launch needs (XLA's device, N-D sizes)
    label: Optional[str] = None  # the test id, where one name runs in several layouts (default: the name)
    dp: Optional[int] = None    # data-parallel processes, each reading its own samples (default: every process);
    #                             the others are tensor-parallel neighbours: ranks dp_rank * tp + (0 .. tp-1)
    kwargs: Tuple[Tuple[str, Any], ...] = ()  # the strategy's arguments: the worker builds its class with them
    strategy_class: Optional[str] = None  # the class the launch runs, where the name alone does not say it

    @property
    def id(self) -> str:
        return self.label or self.name

    @property
    def data_parallel(self) -> int:
        return self.dp or self.nproc

    @property
    def tp(self) -> int:
        return self.nproc // self.data_parallel


def launched_layout(replicate: int = 1, shard: int = 1, tp: int = 1, **case: Any) -> Dict[str, Any]:
    """Case fields for an N-D layout from the launch's environment (`fabric-lite launch --use_parallelism_config`,
    Accelerate's variables): `Accelerator()` and `Trainer()` ("auto") both resolve it to FSDP2 on that mesh."""
    env = (("ACCELERATE_USE_PARALLELISM_CONFIG", "true"), ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", str(replicate)),
           ("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(shard)), ("PARALLELISM_CONFIG_TP_SIZE", str(tp)))
    return dict(nproc=replicate * shard * tp, dp=replicate * shard, env=env, strategy_class="FSDPStrategy", **case)


# A new strategy (FSDP2, XLA, ...) joins the whole suite by adding a line here.
STRATEGIES = [
    Case("single", nproc=1),
    Case("ddp", nproc=2),
    Case("fsdp", nproc=2),
    # the first DeepSpeed launch on a fresh machine JIT-compiles a C++ op (30 s or more, then cached);
    # the offload variants run ZeRO's CPU-offload code paths (on a CPU machine, the same numbers expected)
    Case("deepspeed_stage_1", nproc=2, needs="deepspeed", timeout=420),
    Case("deepspeed_stage_2", nproc=2, needs="deepspeed", timeout=420),
    Case("deepspeed_stage_3", nproc=2, needs="deepspeed", timeout=420),
    Case("deepspeed_stage_2_offload", nproc=2, needs="deepspeed", timeout=420),
    Case("deepspeed_stage_3_offload", nproc=2, needs="deepspeed", timeout=420),
    # torch_xla needs its own torch: these run in the XLA environment (`make test-xla`), on XLA's CPU device;
    # xla_spmd splits each batch over 2 XLA CPU devices from one process. (Two replicas: tests/xla.)
    Case("xla", nproc=1, needs="torch_xla", timeout=300, env=(("PJRT_DEVICE", "CPU"),)),
    Case("xla_spmd", nproc=1, needs="torch_xla", timeout=300, env=(("PJRT_DEVICE", "CPU"), ("CPU_NUM_DEVICES", "2"))),
    # N-D layouts on 4 processes. HSDP: 2 replicas x 2 shards, all 4 ranks data parallel.
    Case("auto", label="hsdp", **launched_layout(replicate=2, shard=2, timeout=300)),
    # FSDP x TP: 2 data-parallel ranks x 2 tensor-parallel ranks, the model tensor parallel on the mesh's "tp";
    # each step's global batch is 2 x b, and the 2 ranks of a tensor-parallel group read the same b samples
    Case("auto", label="fsdp_tp", **launched_layout(shard=2, tp=2, timeout=300)),
    # Lightning's ModelParallelStrategy, data_parallel 2 x tensor_parallel 2, through both doors
    Case("model_parallel", nproc=4, dp=2, kwargs=(("data_parallel_size", 2), ("tensor_parallel_size", 2)),
         timeout=300),
]

# Registered names that are not launched here, and why (test_every_registered_strategy_is_covered_or_excused).
NOT_LAUNCHED = {
    "single_device": "an alias of single",
    "deepspeed": "an alias of deepspeed_stage_2",
    "ddp_find_unused_parameters_true": "ddp with find_unused_parameters=True (Lightning's name); it trains on 2 "
                                       "processes in tests/trainer/test_lightning_examples.py (fine_tuning)",
    "ddp_find_unused_parameters_false": "ddp with find_unused_parameters=False, ddp's own default (Lightning's name)",
}

# fp32 everywhere. A process group averages W per-rank means where the plain loop takes one mean over W*b
# samples, accumulation sums two half-batch means, and ZeRO reduces in buckets: the sums round in another
# order, and 16 steps of SGD with momentum carry that along. Measured on 2 CPU cores: at most 9e-8 from the
# plain loop, for every strategy here (ZeRO's clipped runs 3e-8 to 6e-8).
ATOL = 1e-5

# -- launching ---------------------------------------------------------------------------------------------

def unavailable(case: Case) -> Optional[str]:
    """Why this strategy cannot run here (its package is missing, with the install hint), or None."""
    if case.needs == "torch_xla":  # installed is not enough: it must match torch's version
        from fabric_lite.strategies.xla import torch_xla_problem

        return torch_xla_problem()
    if case.needs is None or importlib.util.find_spec(case.needs) is not None:
        return None
    from fabric_lite.strategies import create_strategy

    try:
        create_strategy(case.name)
    except ImportError as err:  # the strategy's own message: what to pip install
        return str(err)
    return f"strategy {case.name!r} needs the {case.needs} package: pip install {case.needs}"


class Launches:
    """The two launches of one strategy, each started on first use and cached."""

    def __init__(self, case: Case, root) -> None:
        self.case, self.root = case, root
        self._first: Optional[tuple] = None
        self._resume: Optional[tuple] = None
        self.latest_after_crash: Optional[str] = None  # what `latest` named once the killed Trainer run was gone

    def _run(self, phase: str) -> tuple:
        c = self.case
        return Run("conformance.py", self.root / f"out_{phase}", "--strategy", c.name, "--phase", phase,
                   "--root", self.root / "work", "--dp", c.data_parallel, "--strategy-kwargs", json.dumps(dict(c.kwargs)),
                   nproc=c.nproc, launcher="torchrun" if c.nproc > 1 else None, timeout=c.timeout,
                   env=dict(c.env)).wait()

    @property
    def first(self) -> tuple:
        if self._first is None:
            self._first = self._run("first")
            checkpoints = self.root / "work" / "trainer_run" / "checkpoints"
            if (checkpoints / "latest").exists():
                self.latest_after_crash = latest_name(checkpoints)
        return self._first

    @property
    def resume(self) -> tuple:
        if self._resume is None:
            self.first  # the checkpoints it resumes from
            self._resume = self._run("resume")
        return self._resume

    def results(self, phase: str = "first") -> List[Dict[str, Any]]:
        code, output, results = self.first if phase == "first" else self.resume
        missing = [r for r, res in enumerate(results) if res is None]
        if missing:
            pytest.fail(f"{self.case.id}: ranks {missing} wrote no results (exit {code}):\n{output[-8000:]}")
        return results

    def case_result(self, name: str, phase: str = "first") -> List[Any]:
        """The result of one case on every rank; fails the test with the worker's traceback if it broke."""
        code, output, _ = self.first if phase == "first" else self.resume
        values = []
        for rank, res in enumerate(self.results(phase)):
            if name not in res["cases"]:
                pytest.fail(f"{self.case.id}: the {phase} launch ended (exit {code}) before case {name!r} on "
                            f"rank {rank}:\n{output[-8000:]}")
            value = res["cases"][name]
            if isinstance(value, dict) and "error" in value:
                pytest.fail(f"{self.case.id}: case {name!r} raised on rank {rank}:\n{value['error']}")
            values.append(value)
        return values

    @property
    def settings(self) -> Dict[str, Any]:
        return self.results()[0]["settings"]

    def data_parallel_ranks(self, per_rank: List[Any]) -> List[Any]:
        """One value per data-parallel rank, from a value per process: the ranks of one tensor-parallel group must
        hold the same (they read the same batches), and count once."""
        tp = self.case.tp
        for rank, value in enumerate(per_rank):
            assert value == per_rank[rank - rank % tp], f"rank {rank} differs from its tensor-parallel group's first"
        return per_rank[::tp]

    def raw_seen(self, name: str) -> List[List[int]]:
        """The samples of each micro-step of a raw-door case, over the data-parallel ranks (rank 0's gather of the
        indices every process read, each tensor-parallel group counted once)."""
        w = self.case.nproc
        steps = []
        for step in self.case_result(name)[0]["seen"]:
            b = len(step) // w
            steps.append([i for part in self.data_parallel_ranks([step[r * b:(r + 1) * b] for r in range(w)])
                          for i in part])
        return steps


@pytest.fixture(scope="module", params=STRATEGIES, ids=lambda c: c.id)
def launched(request, tmp_path_factory) -> Launches:
    reason = unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return Launches(request.param, tmp_path_factory.mktemp(request.param.id))


# -- independent references: plain torch, no fabric_lite --------------------------------------------------

def _load_common():
    spec = importlib.util.spec_from_file_location("conformance_common", WORKERS / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_common()


def flat(weights: Dict[str, List[float]]) -> torch.Tensor:
    return torch.tensor([v for k in sorted(weights) for v in weights[k]], dtype=torch.float64)


def named(model: torch.nn.Module) -> Dict[str, List[float]]:
    return {k: v.detach().reshape(-1).tolist() for k, v in model.named_parameters()}


def max_diff(got: Dict[str, List[float]], expected: Dict[str, List[float]]) -> float:
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    return (flat(got) - flat(expected)).abs().max().item()


def assert_close(got: Dict[str, List[float]], expected: Dict[str, List[float]], what: str, atol: float = ATOL):
    diff = max_diff(got, expected)
    assert diff <= atol, f"{what}: max |diff| = {diff:.3g} > {atol}"


def model_from(weights: Dict[str, List[float]]) -> torch.nn.Module:
    """make_model() holding the reported weights."""
    model = common.make_model(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.tensor(weights[name]).reshape(p.shape))
    return model


@lru_cache(maxsize=None)
def plain_loop(orders: tuple, batch: int, clip: Optional[float], n: int, lr: float, momentum: float):
    """The one-process torch loop: batches of `batch` consecutive samples of each epoch's order.

    Returns (model, the total gradient norm before clipping at every step)."""
    data = common.IndexDataset(n)
    model = common.make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    norms = []
    for order in orders:
        for start in range(0, len(order), batch):
            idx = torch.tensor(order[start:start + batch])
            loss = F.cross_entropy(model(data.x[idx]), idx % 3)
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
    return model, norms


def epoch_orders(launched: Launches) -> tuple:
    """The sample order of each epoch, as the parity run's processes gathered it, step by step.

    The reference replays this order rather than drawing its own: how later epochs are reshuffled is the
    data layer's choice (tests/data). What the strategies must keep is checked on the order itself in
    test_sample_order_is_the_user_loaders_order_sharded_by_global_step: the first epoch is the user's
    loader's, every epoch holds each sample once, and every process saw the same."""
    s = launched.settings
    flat_order = [i for step in launched.raw_seen("parity") for i in step]
    n = s["n_samples"]
    return tuple(tuple(flat_order[e * n:(e + 1) * n]) for e in range(s["epochs"]))


def reference(launched: Launches, clip: Optional[float] = None, batch: Optional[int] = None):
    s = launched.settings
    return plain_loop(epoch_orders(launched), batch or s["global_batch"], clip, s["n_samples"], s["lr"], s["momentum"])


def interleave(per_rank_seen: List[List[List[int]]]) -> List[int]:
    """Micro-step i of every rank, rank after rank: the global sample order the processes saw together."""
    return [i for step in zip(*per_rank_seen) for batch in step for i in batch]


# -- guards on the list itself ----------------------------------------------------------------------------

def test_every_case_has_its_own_test_id():
    ids = [case.id for case in STRATEGIES]
    assert len(ids) == len(set(ids)), ids


def test_every_registered_strategy_is_covered_or_excused():
    """A strategy registered without being added to STRATEGIES (or to NOT_LAUNCHED, with a reason) fails here."""
    from fabric_lite.strategies import available_strategies

    registered, launched, excused = set(available_strategies()), {c.name for c in STRATEGIES}, set(NOT_LAUNCHED)
    assert not launched & excused
    assert registered == launched | excused, (
        f"registered but neither launched nor excused: {sorted(registered - launched - excused)}; "
        f"listed but not registered: {sorted((launched | excused) - registered)}")


def test_an_unknown_strategy_name_is_a_value_error_listing_the_allowed_names():
    from fabric_lite import Accelerator, Trainer

    for make in (lambda: Accelerator(strategy="no_such_strategy"), lambda: Trainer(strategy="no_such_strategy")):
        with pytest.raises(ValueError, match="no_such_strategy") as info:
            make()
        for case in STRATEGIES:
            assert repr(case.name) in str(info.value), (case.name, str(info.value))


# -- the launch ran what it says --------------------------------------------------------------------------

def test_the_launch_runs_the_strategy_on_every_process(launched):
    from fabric_lite.strategies import create_strategy

    results = launched.results()
    case = launched.case
    expected = case.strategy_class or type(create_strategy(case.name)).__name__
    for rank, r in enumerate(results):
        got = (r["world"], r["dp"], r["strategy_class"])
        assert got == (case.nproc, case.data_parallel, expected), (rank, got)
        assert r["settings"] == results[0]["settings"]


# -- 1. parity with one device on the same global batch --------------------------------------------------

def test_sample_order_is_the_user_loaders_order_sharded_by_global_step(launched):
    s = launched.settings
    orders = epoch_orders(launched)
    n = s["n_samples"]
    # the first epoch is exactly what the user's loader (with the global batch) yields in a plain loop
    loader = DataLoader(common.IndexDataset(n), batch_size=s["global_batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(s["loader_seed"]))
    assert list(orders[0]) == [int(i) for _, idx in loader for i in idx]
    for order in orders:
        assert sorted(order) == list(range(n))   # every sample once per epoch, no padding (n divides evenly)
    assert orders[1] != orders[0]                # reshuffled
    # every process gathered the same order
    assert all(r["seen"] == launched.case_result("parity")[0]["seen"] for r in launched.case_result("parity"))


def assert_like_the_plain_loop(launched: Launches, runs: Dict[str, Dict[str, List[float]]]) -> None:
    """Each unclipped run ends where the plain loop with the global batch ends (DeepSpeed too: its engine
    would clip at norm 1.0 by default, which the strategy turns off unless clipping is asked for)."""
    model, _ = reference(launched)
    diffs = {what: max_diff(weights, named(model)) for what, weights in runs.items()}
    off = {what: d for what, d in diffs.items() if d > ATOL}
    assert not off, f"max |diff| from the plain loop: {diffs} (tolerance {ATOL})"
    # the comparison can fail: a loop with per-process batches (no gradient averaging) ends far away
    small, _ = reference(launched, batch=launched.settings["global_batch"] // 2)
    assert (flat(named(small)) - flat(named(model))).abs().max() > 100 * ATOL


def test_w_processes_with_batch_b_equal_one_device_with_batch_w_times_b(launched):
    parity, accum = launched.case_result("parity"), launched.case_result("accumulation")
    # every process computes the same function, the one of the weights it reports: bit for bit
    probes = [torch.tensor(r["probe"]) for r in parity]
    for rank, p in enumerate(probes):
        assert torch.equal(p, probes[0]), f"rank {rank} computes other outputs than rank 0"
    with torch.no_grad():
        expected = model_from(parity[0]["weights"])(torch.tensor(parity[0]["probe_input"]))
    assert torch.allclose(probes[0], expected, atol=1e-6, rtol=0)
    assert_like_the_plain_loop(launched, {"batch b": parity[0]["weights"], "2 x b/2 accumulated": accum[0]["weights"]})


def test_trainer_parity_with_one_device(launched):
    single, accum = launched.case_result("trainer_parity"), launched.case_result("trainer_accumulation")
    assert interleave(launched.data_parallel_ranks([r["seen"] for r in single])) == [i for epoch in epoch_orders(launched) for i in epoch]
    s = launched.settings
    assert single[0]["global_step"] == s["epochs"] * s["n_samples"] // s["global_batch"]
    assert_like_the_plain_loop(launched, {"batch b": single[0]["weights"],
                                          "accumulate_grad_batches=2 x b/2": accum[0]["weights"]})


# -- 2. accumulation equals a bigger batch (and, above, both equal the plain loop) -------------------------

def test_accelerator_accumulation_of_two_equals_the_double_batch(launched):
    accum = launched.case_result("accumulation")
    parity = launched.case_result("parity")
    assert len(accum[0]["seen"]) == 2 * len(parity[0]["seen"])  # micro-batches of b/2 ...
    assert [i for s in launched.raw_seen("accumulation") for i in s] == \
        [i for s in launched.raw_seen("parity") for i in s]  # ... same order
    assert_close(accum[0]["weights"], parity[0]["weights"], "accumulate 2 x b/2 vs batch b")


def test_trainer_accumulate_grad_batches_two_equals_the_double_batch(launched):
    accum = launched.case_result("trainer_accumulation")
    single = launched.case_result("trainer_parity")
    assert len(accum[0]["seen"]) == 2 * len(single[0]["seen"])
    assert interleave(launched.data_parallel_ranks([r["seen"] for r in accum])) == \
        interleave(launched.data_parallel_ranks([r["seen"] for r in single]))
    assert accum[0]["global_step"] == single[0]["global_step"]
    assert_close(accum[0]["weights"], single[0]["weights"], "accumulate_grad_batches=2 x b/2 vs batch b")


# -- 3. clipping -------------------------------------------------------------------------------------------

def _clipping_reference(launched):
    clip = launched.settings["clip"]
    clipped, norms = reference(launched, clip=clip)
    unclipped, _ = reference(launched)
    # the comparison can fail: clipping acted, and changed where training ends
    assert sum(n > clip for n in norms) >= len(norms) // 2, norms
    assert (flat(named(clipped)) - flat(named(unclipped))).abs().max() > 100 * ATOL
    return clipped


def test_accelerator_clip_grad_norm_equals_torch_clipping(launched):
    # DeepSpeed clips inside its step and returns None from clip_grad_norm_: weights are compared, not norms
    (r0, *_) = launched.case_result("clipping")
    assert_close(r0["weights"], named(_clipping_reference(launched)), "clip_grad_norm_ vs torch's, plain loop")


def test_trainer_gradient_clip_val_equals_torch_clipping(launched):
    (r0, *_) = launched.case_result("trainer_clipping")
    assert_close(r0["weights"], named(_clipping_reference(launched)), "gradient_clip_val vs torch's, plain loop")


# -- 4. collectives ----------------------------------------------------------------------------------------

def test_collectives(launched):
    ranks = launched.case_result("collectives")
    w = launched.case.nproc
    assert [r["rank"] for r in ranks] == list(range(w)) and {r["world"] for r in ranks} == {w}
    for r in ranks:
        rank = r["rank"]
        assert r["gather"] == [[float(q)] * 2 for q in range(w) for _ in range(q + 1)]
        assert r["gather_scalar"] == list(range(w))
        assert r["gather_nested"] == {"a": list(range(w)), "b": [10 * q for q in range(w)]}
        assert r["gather_object"] == [f"rank{q}" for q in range(w)]
        assert r["reduce_sum"] == [w * (w + 1) / 2]
        assert r["reduce_mean"] == [(w + 1) / 2]
        assert r["pad"] == [[1.0] * 3] * (rank + 1) + [[-1.0] * 3] * (w - rank - 1)
        assert r["pad_first"] == [[0.0] * (w - rank - 1) + [1.0] * (rank + 1)] * 2
        assert r["broadcast"] == [float(w - 1), 5.0]


def test_gather_for_metrics_drops_the_even_batch_padding(launched):
    for r in launched.case_result("collectives"):
        # 13 samples, batches of 2, in order: global step k is batches kW..kW+W-1, padding only at the end
        assert r["for_metrics"] == list(range(13))
        assert r["for_metrics_objects"] == [f"s{i}" for i in range(13)]
    # the trained model of the parity run over those 13 samples: the outputs its reported weights give
    with torch.no_grad():
        expected = model_from(launched.case_result("parity")[0]["weights"])(common.IndexDataset(13).x).double()
    for r in launched.case_result("evaluation"):
        assert r["indices"] == list(range(13))
        got = torch.tensor(r["outputs"], dtype=torch.float64)
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6, rtol=0)


# -- 5. checkpoints ----------------------------------------------------------------------------------------

def test_save_state_then_load_state_restores_weights_and_optimizer_state(launched):
    ranks = launched.case_result("roundtrip")
    r0 = ranks[0]
    assert_bit_equal(flat(r0["after"]["weights"]).tolist(), flat(r0["before"]["weights"]).tolist(), "weights")
    for rank, r in enumerate(ranks):
        before, after = r["before"]["optimizer"], r["after"]["optimizer"]
        assert before["state"] and all(before["state"]), f"rank {rank}: no momentum buffers to compare"
        assert len(after["state"]) == len(before["state"]), rank
        for i, (got, expected) in enumerate(zip(after["state"], before["state"])):
            assert got.keys() == expected.keys(), (rank, i)
            for name, values in expected.items():
                assert_bit_equal(got[name], values, f"rank {rank}, optimizer state {i}/{name}")
        assert after["groups"] == before["groups"], rank   # lr among them: the fresh optimizer had another
    # the same next step from both: nothing the step reads was left behind
    assert_bit_equal(flat(r0["continued_loaded"]).tolist(), flat(r0["continued"]).tolist(), "one step after loading")
    assert not torch.equal(flat(r0["continued"]), flat(r0["before"]["weights"]))


def test_trainer_save_checkpoint_then_fit_ckpt_path_ends_as_an_uninterrupted_fit(launched):
    (resumed, *_) = launched.case_result("trainer_resume")
    (straight, *_) = launched.case_result("trainer_parity")
    s = launched.settings
    steps_per_epoch = s["n_samples"] // s["global_batch"]
    assert resumed["start"] == [steps_per_epoch, 1]
    assert resumed["global_step"] == straight["global_step"] == s["epochs"] * steps_per_epoch
    assert_bit_equal(flat(resumed["weights"]).tolist(), flat(straight["weights"]).tolist(), "resumed vs straight")


# -- 6. killed, then resumed: bit for bit ------------------------------------------------------------------

def _assert_killed(launched):
    code, output, _ = launched.first
    if launched.case.nproc == 1:
        assert killed_by(code, signal.SIGKILL), (code, output[-4000:])
    else:
        assert code != 0, output[-4000:]
    assert "SIGKILLs itself at step" in output, output[-4000:]


def test_raw_door_killed_then_load_state_is_bit_exact(launched):
    _assert_killed(launched)
    s = launched.settings
    per_epoch = s["resume_steps_per_epoch"]
    for r in launched.case_result("raw_crash"):
        assert r == {"abandoned_at_step": s["kill_step"], "epoch": s["kill_step"] // per_epoch}
    ranks = launched.case_result("raw_resumed", phase="resume")
    for rank, r in enumerate(ranks):
        assert r["restored"] == {"steps": s["save_step"], "epoch": s["save_step"] // per_epoch}, rank
        assert r["finished"] == {"finished": per_epoch * s["resume_epochs"]}, rank
    assert_bit_equal(flat(ranks[0]["resumed"]).tolist(), flat(ranks[0]["uninterrupted"]).tolist(), "raw door")


def test_trainer_killed_then_fit_ckpt_path_last_is_bit_exact(launched):
    _assert_killed(launched)
    s = launched.settings
    per_epoch = s["resume_steps_per_epoch"]
    saved_epoch = s["save_step"] // per_epoch
    assert launched.latest_after_crash == f"epoch={saved_epoch}-step={s['save_step']}"
    ranks = launched.case_result("trainer_resumed", phase="resume")
    for rank, r in enumerate(ranks):
        assert r["start"] == [s["save_step"], saved_epoch], rank
        assert r["global_step"] == r["uninterrupted_global_step"] == per_epoch * s["resume_epochs"], rank
    assert_bit_equal(flat(ranks[0]["resumed"]).tolist(), flat(ranks[0]["uninterrupted"]).tolist(), "Trainer")


def test_the_resume_launch_exits_cleanly(launched):
    code, output, _ = launched.resume
    assert code == 0, output[-6000:]


# -- 7. bad input ------------------------------------------------------------------------------------------

def test_backward_of_a_non_scalar_loss_is_a_value_error_naming_the_shape(launched):
    for rank, r in enumerate(launched.case_result("bad_input")):
        err = r["backward_non_scalar"]
        assert err is not None, f"rank {rank}: backward() of a (3, 3) loss raised nothing"
        assert err["type"] == "ValueError" and "(3, 3)" in err["message"], (rank, err)


def test_a_training_step_returning_a_non_scalar_loss_is_a_value_error_naming_the_shape(launched):
    per_rank = launched.settings["global_batch"] // launched.case.data_parallel
    for rank, r in enumerate(launched.case_result("bad_input")):
        err = r["trainer_non_scalar"]
        assert err is not None and err["type"] == "ValueError" and f"({per_rank},)" in err["message"], (rank, err)


def test_trainer_accumulate_grad_batches_zero_is_a_value_error(launched):
    for rank, r in enumerate(launched.case_result("bad_input")):
        err = r["accumulate_zero"]
        assert err is not None, f"rank {rank}: Trainer(accumulate_grad_batches=0) raised nothing"
        assert err["type"] == "ValueError" and "accumulate_grad_batches=0" in err["message"], (rank, err)
