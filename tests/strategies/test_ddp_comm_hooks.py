"""DDP communication hooks (Accelerate's DDPCommunicationHookType / DistributedDataParallelKwargs(comm_hook=...)):
the names and checks in-process; training with every hook on 2 real processes (gloo) and alone."""

import json
import sys

import pytest
import torch

from conftest import WORKERS, free_port, run_command
from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import (DDPCommunicationHookType, DeepSpeedPlugin, DistributedDataParallelKwargs,
                                             FullyShardedDataParallelPlugin, strategy_from_handlers)
from fabric_lite.strategies.comm_hooks import CommHook
from fabric_lite.strategies.ddp import DDPStrategy

H = DDPCommunicationHookType


def test_hook_type_has_accelerates_members_and_values():
    assert {m.name: m.value for m in H} == {"NO": "no", "FP16": "fp16", "BF16": "bf16", "POWER_SGD": "power_sgd",
                                            "BATCHED_POWER_SGD": "batched_power_sgd"}
    assert H("power_sgd") is H.POWER_SGD and H("FP16") is H.FP16 and str(H.BF16) == "bf16" and H.FP16 == "fp16"
    assert "fp16" in H and "int8" not in H
    with pytest.raises(ValueError):
        H("int8")


def test_kwargs_fields_defaults_and_ddp_keywords():
    kwargs = DistributedDataParallelKwargs()
    assert (kwargs.comm_hook, kwargs.comm_wrapper, kwargs.comm_state_option) == (H.NO, H.NO, {})
    kwargs = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="bf16", static_graph=True,
                                           comm_state_option={"matrix_approximation_rank": 2})
    assert kwargs.comm_hook is H.POWER_SGD and kwargs.comm_wrapper is H.BF16  # (strings become members)
    # the hook's fields are not DistributedDataParallel constructor keywords
    assert kwargs.to_kwargs() == {"static_graph": True}
    strategy = strategy_from_handlers("ddp", {DistributedDataParallelKwargs: kwargs}, 2)
    assert strategy.ddp_kwargs == {"static_graph": True}
    assert strategy.comm_hook == CommHook("power_sgd", "bf16", {"matrix_approximation_rank": 2})
    assert strategy.explain_lines([], [], 2) == [
        ("precision", "gradient all-reduce", "PowerSGD (layer-wise low-rank) on bf16 gradients, "
                                             "{'matrix_approximation_rank': 2}")]
    assert DDPStrategy().comm_hook == CommHook() and not DDPStrategy().comm_hook.enabled


@pytest.mark.parametrize("fields, words", [
    ({"comm_hook": "int8"}, ["comm_hook='int8'", "'power_sgd'"]),
    ({"comm_wrapper": "power_sgd", "comm_hook": "power_sgd"}, ["comm_wrapper='power_sgd'", "'fp16', 'bf16'"]),
    ({"comm_wrapper": H.FP16}, ["comm_wrapper=FP16 wraps a PowerSGD hook", "comm_hook=NO", "comm_hook=POWER_SGD"]),
    ({"comm_hook": H.FP16, "comm_wrapper": H.BF16}, ["comm_hook=FP16 already compresses", "drop comm_wrapper"]),
    ({"comm_hook": "bf16", "comm_state_option": {"matrix_approximation_rank": 2}},
     ["configures PowerSGD's state", "comm_hook=BF16 has none"]),
    ({"comm_hook": "power_sgd", "comm_state_option": {"rank": 2}}, ["'rank'", "matrix_approximation_rank"]),
    ({"comm_hook": "power_sgd", "comm_state_option": {"matrix_approximation_rank": 0}}, ["an integer >= 1"]),
    ({"comm_hook": "power_sgd", "comm_state_option": {"start_powerSGD_iter": 1}},
     ["PowerSGDState refused it", "start_powerSGD_iter"]),
])
def test_invalid_settings_are_refused_when_built(fields, words):
    with pytest.raises(ValueError) as err:
        DistributedDataParallelKwargs(**fields)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ValueError):  # (the strategy's own keywords, the same checks)
        DDPStrategy(**fields)


def test_batched_power_sgd_is_refused_where_torchs_hook_cannot_compress():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:  # what torch's batched hook does with its 2-D Q at its first compressing step
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
        broken = False
    except AssertionError:
        broken = True
    if not broken:  # a torch that fixed it: the hook is let through
        assert DistributedDataParallelKwargs(comm_hook="batched_power_sgd").comm_hook is H.BATCHED_POWER_SGD
        return
    with pytest.raises(ValueError, match=r"batched_powerSGD_hook stops training with an AssertionError.*"
                                         r"Use comm_hook=POWER_SGD"):
        DistributedDataParallelKwargs(comm_hook=H.BATCHED_POWER_SGD)


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed", "fsdp_plugin", "deepspeed_plugin"])
def test_a_hook_is_refused_where_no_ddp_wrapper_carries_it(strategy):
    handlers = {DistributedDataParallelKwargs: DistributedDataParallelKwargs(comm_hook=H.FP16)}
    if strategy == "deepspeed" or strategy == "deepspeed_plugin":
        pytest.importorskip("deepspeed")
    target = {"fsdp_plugin": lambda: FullyShardedDataParallelPlugin().to_strategy(),
              "deepspeed_plugin": lambda: DeepSpeedPlugin(zero_stage=2).to_strategy()}.get(strategy, lambda: strategy)()
    with pytest.raises(ValueError) as err:
        strategy_from_handlers(target, handlers, 2)
    kind = "FSDP" if "fsdp" in strategy else "DEEPSPEED"
    assert "comm_hook=FP16" in str(err.value) and f"({kind}) does not use" in str(err.value)
    assert "strategy='ddp'" in str(err.value) and "DDPCommunicationHookType.NO" in str(err.value)
    # NO is no hook: nothing to refuse
    assert strategy_from_handlers(target, {DistributedDataParallelKwargs: DistributedDataParallelKwargs()}, 2)


def test_accelerator_refuses_before_starting_anything():
    with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP\) does not use"):
        Accelerator(strategy="fsdp", kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="power_sgd")])
    assert not torch.distributed.is_initialized()


# One launch per number of processes serves this file and tests/accelerator/test_local_sgd.py (ddp_features.py runs
# both sets of checks), with the command-line flags of the Accelerate examples they are shaped like.
FEATURE_ARGS = {
    1: ["--ddp_comm_hook", "fp16", "--gradient_accumulation_steps", "2"],
    2: ["--ddp_comm_hook", "power_sgd", "--ddp_comm_wrapper", "bf16", "--gradient_accumulation_steps", "2",
        "--local_sgd_steps", "2"],
}
_FEATURE_RUNS = {}


def ddp_feature_runs(tmp_path_factory, nproc):
    """Each rank's results of tests/workers/ddp_features.py on `nproc` processes (started once per session: alone
    as a plain script, on 2 with `fabric-lite launch` and Accelerate's flags), and the launch's stdout."""
    if nproc not in _FEATURE_RUNS:
        out = tmp_path_factory.mktemp(f"ddp_features_{nproc}")
        script = str(WORKERS / "ddp_features.py")
        if nproc == 1:
            cmd = [sys.executable, script]
        else:
            cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", "--cpu", "--num_processes", str(nproc),
                   "--main_process_port", str(free_port()), script]
        proc = run_command(cmd + ["--out", str(out), "--cpu", *FEATURE_ARGS[nproc]], timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        _FEATURE_RUNS[nproc] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)], proc.stdout
    return _FEATURE_RUNS[nproc]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    results, stdout = ddp_feature_runs(tmp_path_factory, 2)
    return [r["hooks"] for r in results], stdout


def _gap(a, b):
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_hook_trains_on_two_processes(two_processes):
    (r0, r1), _ = two_processes
    runs, reference = r0["runs"], r0["reference"]
    assert r0["world"] == 2
    for name, run in runs.items():
        assert run["strategy"] == "DDPStrategy" and run["model_type"] == "DistributedDataParallel", name
        assert run["weights"] == r1["runs"][name]["weights"], f"{name}: the processes' weights differ"
        assert run["handler_hook"] == name.split("+")[0]
    # NO: DDP's plain all-reduce, equal to one process taking every step on the global batch
    assert _gap(runs["no"]["weights"], reference) < 1e-6
    # FP16 / BF16: close to it, and not equal to the plain all-reduce (the compressed one really ran)
    assert 1e-6 < _gap(runs["fp16"]["weights"], runs["no"]["weights"]) and _gap(runs["fp16"]["weights"], reference) < 2e-3
    assert 1e-5 < _gap(runs["bf16"]["weights"], runs["no"]["weights"]) and _gap(runs["bf16"]["weights"], reference) < 1e-2
    assert _gap(runs["fp16"]["weights"], reference) < _gap(runs["bf16"]["weights"], reference)  # fp16 keeps more bits
    # PowerSGD (alone and wrapped): the hook's state counted every step, compressed from step 2 on, kept error feedback
    for name in ("power_sgd", "power_sgd+fp16", "power_sgd+bf16"):
        run = runs[name]
        assert run["state"]["type"] == "PowerSGDState" and run["state"]["iter"] == len(run["losses"]) == 16, name
        assert run["state"]["numel_compressed"] > 0 and run["state"]["error_feedback"] >= 1, name
        assert run["state"]["rank"] == 1
        assert _gap(run["weights"], runs["no"]["weights"]) > 1e-3, name  # a rank-1 approximation: not the exact mean
        first, last = sum(run["losses"][:4]) / 4, sum(run["losses"][-4:]) / 4
        assert last < 0.5 * first, (name, first, last)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_accelerate_example_shape_on_two_processes(two_processes):
    (r0, r1), stdout = two_processes
    example = r0["example"]
    assert (example["hook"], example["wrapper"], example["distributed_type"]) == ("power_sgd", "bf16", "MULTI_CPU")
    assert example["weights"] == r1["example"]["weights"]
    assert example["evaluated"] == 40  # gather_for_metrics: each evaluation sample once
    assert example["accuracies"][-1] > 0.5
    assert stdout.count("epoch 2:") == 2  # accelerator.print: the main process (this example and LocalSGD's one)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_alone_the_hook_has_nothing_to_apply_to(tmp_path_factory):
    (result,), stdout = ddp_feature_runs(tmp_path_factory, 1)
    r0 = result["hooks"]
    for name, run in r0["runs"].items():
        # silently unused, as in Accelerate: one process reduces nothing, so every hook trains exactly as none
        assert run["strategy"] == "SingleDeviceStrategy" and run["state"]["type"] is None, name
        assert _gap(run["weights"], r0["reference"]) == 0, name
    example = r0["example"]
    assert (example["hook"], example["distributed_type"], example["evaluated"]) == ("fp16", "NO", 40)
    assert "epoch 2:" in stdout
