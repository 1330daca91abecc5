"""Hugging Face Accelerate's example scripts (nlp_example, complete_nlp_example, by_feature/*), written again on
data and a model of our own with the same fabric_lite calls in the same order (tests/workers/accelerate_style/),
run alone and under `fabric-lite launch --num_processes 2 --cpu`: they finish, evaluation metrics see every
sample exactly once, accumulation equals the bigger batch, a run resumed from its epoch and step checkpoints
ends where the uninterrupted run ended, and the profiler writes a trace per process. All scripts run one after
the other in one process per mode (one Python start, one process group), each test checks its script's part."""

import json
import sys

import pytest

from conftest import WORKERS, free_port, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPTS = WORKERS / "accelerate_style"
VALIDATION = list(range(41))
RESUMED_FROM = ["epoch_0", "step_3"]


@pytest.fixture(scope="module", params=[1, 2], ids=["alone", "launch2"])
def runs(request, tmp_path_factory):
    """Every script in one process (alone) or one launch of 2 processes (tests/workers/accelerate_style/
    run_examples.py): the full run checkpoints every 3 steps and every epoch, then is resumed from epoch_0 and
    step_3; then the by_feature scripts. Returns each rank's results and the launch's output."""
    nproc = request.param
    tmp = tmp_path_factory.mktemp(f"examples_{nproc}")
    out, ckpt = tmp / "out", tmp / "ckpt"
    script = [str(SCRIPTS / "run_examples.py"), "--cpu", "--out", str(out), "--checkpointing_steps", "3",
              "--output_dir", str(ckpt), "--resumed_output_dir", str(tmp / "ckpt2"),
              "--project_dir", str(tmp / "project"), "--log_with", "tensorboard",
              "--resume_from_checkpoint", *RESUMED_FROM]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", "--num_processes", str(nproc), "--cpu",
               "--main_process_port", str(free_port()), *script]
    proc = run_command(cmd, timeout=240, cwd=tmp, env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp)})
    assert proc.returncode == 0, f"the examples on {nproc} process(es) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert [r["rank"] for r in results] == list(range(nproc))
    return {"nproc": nproc, "results": results, "stdout": proc.stdout, "tmp": tmp, "ckpt": ckpt}


def section(runs, name):
    """Each rank's results of one script; a script that raised fails here with its traceback."""
    for r in runs["results"]:
        assert "error" not in r[name], f"{name} on rank {r['rank']} of {runs['nproc']} raised:\n{r[name]['error']}"
    return [r[name] for r in runs["results"]]


@pytest.fixture
def core_runs(runs):
    full = section(runs, "core")
    return {**runs, "full": full}


def test_nlp_and_tracking(core_runs):
    """nlp_example / complete_nlp_example / tracking: each epoch's metric saw the 41 validation rows once."""
    nproc, full = core_runs["nproc"], core_runs["full"]
    assert [r["world"] for r in full] == [nproc] * nproc
    assert all(r["distributed"] == (nproc > 1) for r in full)
    for r in full:
        metrics = r["nlp"]["metrics"]
        assert sorted(metrics) == ["0", "1", "2"]
        assert all(m["samples"] == 41 and m["seen"] == VALIDATION for m in metrics.values())
        assert r["nlp"]["steps_per_epoch"] == 4 // nproc
    # accelerator.print: once per run (the full one and each resumed one), from the main process
    assert core_runs["stdout"].count("epoch 2:") == 1 + len(RESUMED_FROM)
    assert sorted(p.name for p in core_runs["ckpt"].iterdir()) == sorted(
        [f"epoch_{e}" for e in range(3)] + [f"step_{s}" for s in range(3, 3 * (4 // nproc) + 1, 3)])
    assert list((core_runs["tmp"] / "project").rglob("events.out.tfevents.*")), "tensorboard wrote nothing"
    assert full[0]["trackers"] == ["TensorBoardTracker"]


def test_checkpoint_resume_equals_the_uninterrupted_run(core_runs):
    """checkpointing / complete_nlp_example --resume_from_checkpoint: from an epoch checkpoint and from a step
    checkpoint inside an epoch (skip_first_batches), the rest of the run ends on the same weights and losses."""
    for full in core_runs["full"]:
        final, resumed = full["nlp"]["final"], full["resumed"]
        assert sorted(resumed) == RESUMED_FROM
        for name, run_ in resumed.items():
            assert max(abs(a - b) for a, b in zip(run_["final"], final)) < 1e-6, name
            assert run_["losses"] == full["nlp"]["losses"][-len(run_["losses"]):], name
            assert all(m["samples"] == 41 and m["seen"] == VALIDATION for m in run_["metrics"].values())
        # the resumed step checkpoint skipped exactly the batches trained before it
        assert len(resumed["step_3"]["losses"]) == len(full["nlp"]["losses"]) - 3
        assert len(resumed["epoch_0"]["losses"]) == len(full["nlp"]["losses"]) * 2 // 3
    # the run trains (its losses change), so the comparisons above can fail
    assert len(set(core_runs["full"][0]["nlp"]["losses"])) > 3


def test_multi_process_metrics(core_runs):
    """gather + truncating the last batch by use_distributed and the dataset's length: every row once."""
    for r in core_runs["full"]:
        assert r["multi_process_metrics"]["seen"] == VALIDATION


def test_gradient_accumulation_equals_the_bigger_batch(core_runs):
    """gradient_accumulation / automatic_gradient_accumulation: batches of 8 accumulated 2 steps (the steps set
    on the Accelerator) give the weights of batches of 16, schedule included."""
    for r in core_runs["full"]:
        acc = r["accumulation"]
        assert acc["moved"] > 1e-2
        assert acc["diff"] < 1e-6
        assert acc["seen"] == [VALIDATION, VALIDATION]


def test_early_stopping_stops_every_process(core_runs):
    """early_stopping: set_trigger on the last process only; check_trigger stops all at the same step."""
    assert [r["early_stopping"] for r in core_runs["full"]] == [{"stopped_at": 1, "steps_run": 2}] * core_runs["nproc"]


def test_cross_validation(core_runs):
    """cross_validation: a model prepared per fold, free_memory between; each fold's test predictions are the
    test rows in the same order in every fold (the script averages them position by position). The script does
    not prepare its test loader, so every process predicts all 41 rows and the gather holds them once per process."""
    nproc = core_runs["nproc"]
    for r in core_runs["full"]:
        cv = r["cross_validation"]
        assert cv["n_preds"] == 41 * nproc
        assert sorted(cv["orders"][0]) == sorted(VALIDATION * nproc) and cv["orders"][0] == cv["orders"][1]
        assert [sorted(s) for s in cv["fold_eval_seen"]] == [list(range(0, 64, 2)), list(range(1, 64, 2))]


def test_autoregressive_accumulation(core_runs):
    """gradient_accumulation_for_autoregressive_models: gathered token counts, no_sync on all but the last
    micro-batch, loss times steps and processes: the gradient is the token mean over the whole update."""
    for r in core_runs["full"]:
        ar = r["autoregressive"]
        assert ar["updates"] == 4
        assert all(a == b for a, b in ar["counts"])
        assert ar["grad_diff"] < 1e-6
        assert ar["eval_loss_finite"]


@pytest.mark.parametrize("feature", ["memory", "automatic_gradient_accumulation"])
def test_find_executable_batch_size(feature, runs):
    """memory / automatic_gradient_accumulation: an out-of-memory error at 16 retries at 8 (with 2 accumulation
    steps for the automatic one, equal to the batch of 16); the evaluation still sees every row once."""
    for r in section(runs, feature):
        assert r["tried"] == [16, 8] and r["seen"] == VALIDATION
        if feature == "automatic_gradient_accumulation":
            assert r["steps"] == 2 and r["diff_to_batch_16"] < 1e-6


def test_profiler(runs):
    """profiler: ProfileKwargs(record_shapes, profile_memory, with_flops, output_trace_dir) and `with
    accelerator.profile() as prof` around each epoch's training, then prof.key_averages().table(...) printed by
    the main process. Each epoch, every process's trace holds that epoch's steps (the file is written again),
    with input shapes, and on 2 processes the gradient all-reduces; the averages hold flops and memory."""
    nproc, steps = runs["nproc"], 4 // runs["nproc"]
    for r in section(runs, "profiler"):
        assert r["steps_per_epoch"] == steps and len(r["epochs"]) == 2
        for epoch in r["epochs"]:
            assert epoch["trace_files"] == [f"profile_{i}.json" for i in range(nproc)]
            trace = epoch["trace"]
            assert trace["optimizer_steps"] == steps and trace["addmm_shapes"]
            assert trace["all_reduces"] >= steps if nproc > 1 else trace["all_reduces"] == 0
            assert epoch["averaged_steps"] == steps
            assert epoch["table_has_addmm"] and epoch["table_columns"] == ["CPU Mem", "FLOPs", "# of Calls"]
            assert epoch["addmm_flops"] > 0 and epoch["memory_recorded"]
            assert epoch["seen"] == VALIDATION
    # accelerator.print: the table once per epoch, from the main process
    assert runs["stdout"].count("Self CPU %") == 2


def test_ddp_comm_hook(runs):
    """ddp_comm_hook: DistributedDataParallelKwargs(comm_hook=fp16, comm_wrapper=no) trains; processes agree."""
    results = section(runs, "ddp_comm_hook")
    assert all(r["seen"] == VALIDATION and r["moved"] > 1e-2 for r in results)
    assert all(r["weights"] == results[0]["weights"] for r in results)


def test_local_sgd(runs):
    """local_sgd: LocalSGD(accelerator, model, local_sgd_steps=2, enabled=True) with local_sgd.step() in the
    accumulate block: processes part between averagings, agree after every second step and at the end."""
    for r in section(runs, "local_sgd"):
        assert r["seen"] == VALIDATION and r["final_spread"] < 1e-6
        spread = r["differed"]
        assert len(spread) == 8 // runs["nproc"] and all(s < 1e-6 for s in spread[1::2])
        if runs["nproc"] > 1:
            assert max(spread[0::2]) > 1e-6


def test_schedule_free(runs):
    """schedule_free: utils.is_schedulefree_available() says whether the package is there; a prepared
    optimizer's train()/eval() reach the optimizer (step() in eval mode would raise)."""
    for r in section(runs, "schedule_free"):
        assert r["available"] == r["expected"]
        assert r["modes"] == ["train", "eval", "train", "eval"] and r["seen"] == VALIDATION
