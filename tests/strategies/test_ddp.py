"""Multi-process tests: real processes under torchrun / fabric-lite launch, gloo on CPU, with timeouts."""

import math

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_ddp_two_processes_batch_b_equals_one_process_batch_2b(launch):
    one = launch("train_parity", 1, "--batch-size", 8, "--optimizer", "adamw")
    two = launch("train_parity", 2, "--batch-size", 4, "--optimizer", "adamw")
    assert one[0]["strategy"] == "SingleDeviceStrategy"
    assert two[0]["strategy"] == "DDPStrategy" and two[0]["world"] == 2 and two[0]["backend"] == "gloo"
    # Global step k sees the same samples on 1 x 2b and 2 x b: the sharding keeps the user's order.
    assert two[0]["seen"] == one[0]["seen"]
    w1, w2 = torch.tensor(one[0]["weights"]), torch.tensor(two[0]["weights"])
    assert torch.allclose(w1, w2, atol=1e-6, rtol=0), (w1 - w2).abs().max()
    # Both ranks hold identical weights after DDP.
    assert two[0]["weights"] == two[1]["weights"]


def test_ddp_accumulation_equals_bigger_batch(launch):
    # 2 processes x batch 2 x 2 micro-steps == 1 process x batch 8
    one = launch("train_parity", 1, "--batch-size", 8, "--epochs", 1)
    accum = launch("train_parity", 2, "--batch-size", 2, "--accum", 2, "--epochs", 1)
    w1, w2 = torch.tensor(one[0]["weights"]), torch.tensor(accum[0]["weights"])
    assert torch.allclose(w1, w2, atol=1e-6, rtol=0), (w1 - w2).abs().max()


@pytest.mark.parametrize("nproc", [2, 3])
def test_gather_for_metrics_counts_every_sample_once(launch, nproc):
    results = launch("gather_metrics", nproc)
    for key, value in results[0].items():
        if "/" not in key:
            continue
        n = int(key.split("/")[0])
        assert sorted(value["tensors"]) == list(range(n)), key
        assert sorted(value["objects"]) == sorted(f"s{i}" for i in range(n)), key
    # uneven data: every rank ran the same number of steps and nobody hung
    assert len({r["uneven_steps"] for r in results}) == 1
    assert results[0]["len"] == math.ceil(math.ceil(13 / 2) / nproc)


def test_collectives_and_process_control(launch):
    res = launch("collectives", 2, launcher="fabric-lite")
    r0, r1 = res
    assert (r0["num_processes"], r0["process_index"], r1["process_index"]) == (2, 0, 1)
    assert r0["is_main_process"] and not r1["is_main_process"] and r1["is_last_process"]
    assert r0["distributed_type"] == "MULTI_CPU"
    for r in res:
        assert r["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert r["gather_scalar"] == [0, 1]
        assert r["gather_nested"] == {"a": [0, 1], "b": [0, 10]}
        assert r["gather_object"] == ["rank0", "rank1"]
        assert r["reduce_sum"] == [3.0] and r["reduce_mean"] == [1.5]
        assert r["broadcast"] == [1.0, 5.0]
        assert r["scheduler_last_epoch"] == 2 and r["lr_after_one_step"] == 0.25
        assert r["model_type"] == "DistributedDataParallel" and r["unwrapped_type"] == "Sequential"
    assert r0["pad"] == [[1.0] * 3, [-1.0] * 3] and r1["pad"] == [[1.0] * 3] * 2
    assert r0["pad_first"] == [[0.0, 1.0], [0.0, 1.0]]
    assert r0["split"] == [0, 1, 2, 3] and r1["split"] == [4, 5, 6]
    assert r0["split_padded"] == [0, 1, 2, 3] and r1["split_padded"] == [4, 5, 6, 6]
    assert r0["split_dict"] == {"a": [0, 1, 2], "b": [0, 1, 2]} and r1["split_dict"] == {"a": [3, 4], "b": [3, 4]}
    assert r1["marker_seen"] is True


@pytest.mark.parametrize("nproc,precision,workers", [(2, "no", 0), (2, "fp16", 0), (1, "bf16", 2)])
def test_save_state_load_state_resumes_bit_for_bit(launch, tmp_path, nproc, precision, workers):
    results = launch("resume", nproc, "--ckpt", tmp_path / "ckpt", "--precision", precision, "--workers", workers)
    for r in results:
        assert r["equal"], r
    assert (tmp_path / "ckpt" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("rng_*.pt")) == [f"rng_{i}.pt" for i in range(nproc)]


def test_a_process_ends_its_run_and_starts_another(launch):
    """Accelerator, end_training, a new Accelerator, four times in each process under `fabric-lite launch`: each
    new process group comes up (its keys are named apart from the ended one's in the launcher's store, which
    would otherwise stall the new group's start on some rank) and its collectives answer."""
    res = launch("new_group", 2, launcher="fabric-lite", timeout=120)
    for r in res:
        assert r["sums"] == [3.0, 5.0, 7.0, 9.0]


def test_failures_are_errors_on_every_rank_not_hangs(launch, tmp_path):
    results = launch("robustness", 2, "--ckpt", tmp_path / "ckpt")
    for r in results:
        assert r["save_error"] is not None and "rank 1" in r["save_error"] and "disk full" in r["save_error"]
        assert r["save_error_seconds"] < 30
        assert r["previous_intact"] is True
        assert r["after_main_only_save"] == 2.0
        assert r["pad_neg_shape"] == [2, 5]
        assert r["trigger"] is True and r["trigger_again"] is False
    assert results[0]["grad"] == results[1]["grad"]  # synced despite no_sync
    assert not list(tmp_path.glob("ckpt.staging-*"))  # the failed save left nothing behind


def test_a_crash_on_one_rank_ends_the_job_quickly(tmp_path):
    import time

    from conftest import free_port, run_command, sys

    script = tmp_path / "crash.py"
    script.write_text(
        "import torch\nfrom fabric_lite import Accelerator\nacc = Accelerator()\n"
        "if acc.process_index == 1:\n    raise RuntimeError('boom on rank 1')\n"
        "acc.gather(torch.ones(1))\n"
    )
    start = time.time()
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], timeout=120)
    assert proc.returncode != 0 and "boom on rank 1" in proc.stderr
    assert time.time() - start < 60


@pytest.mark.parametrize("gpus, refused", [(["a", "a", "b"], [0, 1]), (["a", "b", "c"], []), (["a"] * 3, [0, 1, 2])])
def test_processes_sharing_a_gpu_are_refused_each(gpus, refused):
    """NCCL needs a GPU per process: every process whose GPU (told apart by UUID) another one picked
    raises, the others go on; processes that each see one GPU through CUDA_VISIBLE_DEVICES are fine."""
    import threading

    import torch.distributed as dist

    from fabric_lite.strategies.ddp import refuse_shared_gpus

    store = dist.HashStore()
    errors = {}

    def process(rank):
        try:
            refuse_shared_gpus(store, rank, len(gpus), gpus[rank], "cuda:0 of 1 visible")
        except RuntimeError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=process, args=(r,)) for r in range(len(gpus))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(errors) == refused
    for rank, message in errors.items():
        assert f"Rank {rank} and {gpus.count(gpus[rank]) - 1} other process(es) of this job picked the same GPU " \
               f"(cuda:0 of 1 visible, {gpus[rank]}): NCCL needs a GPU of its own for each process." in message


def test_the_doors_shard_and_gather_over_the_data_parallel_dimension_of_a_two_dimensional_mesh(launch):
    res = launch("mesh_groups", 4)
    assert [r["dp"] for r in res] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    # ranks that share a data-parallel coordinate read the same samples; the two shards cover the data (10 samples,
    # batches of 2: 3 batches per shard, the last one padded with repeated samples)
    assert res[0]["seen"] == res[1]["seen"] and res[2]["seen"] == res[3]["seen"] and len(res[0]["seen"]) == 6
    assert set(res[0]["seen"] + res[2]["seen"]) == set(range(10))
    for r in res:  # gather_for_metrics counts each sample once: over "dp" (padding dropped), not over the 4 processes
        assert sorted(r["gathered"]) == list(range(10))
        assert r["world_sum"] == 6.0
    assert [r["objects"] for r in res] == [["r0", "r2"], ["r1", "r3"], ["r0", "r2"], ["r1", "r3"]]
    assert [r["dp_sum"] for r in res] == [2.0, 4.0, 2.0, 4.0]  # {0, 2} and {1, 3}
    assert [r["tp_sum"] for r in res] == [1.0, 1.0, 5.0, 5.0]  # {0, 1} and {2, 3}
    assert [r["tp_gather"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_broadcast"] for r in res] == ["from2", "from3", "from2", "from3"]  # src is a rank in the group
    assert [r["tp_broadcast"] for r in res] == [[0], [0], [2], [2]]
