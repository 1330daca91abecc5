"""find_executable_batch_size, should_reduce_batch_size, release_memory, clear_device_cache.

Out-of-memory errors are real where possible: the CPU allocator refuses 2**50 bytes (more than any address
space holds) with its own RuntimeError.
"""

import gc
import weakref

import pytest
import torch

from fabric_lite.accelerator.memory import (
    clear_device_cache, find_executable_batch_size, release_memory, should_reduce_batch_size,
)


def cpu_out_of_memory():
    torch.empty(2**50, dtype=torch.uint8)


def test_a_real_cpu_allocation_failure_is_an_out_of_memory_error():
    with pytest.raises(RuntimeError) as info:
        cpu_out_of_memory()
    assert should_reduce_batch_size(info.value)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"),
    RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.1 GB, other allocations: 1.2 GB, max allowed: "
                 "18.1 GB)."),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                 "non-contiguous input."),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried ..."),
    MemoryError(),
], ids=lambda e: type(e).__name__ + ":" + str(e)[:20])
def test_out_of_memory_errors_reduce_the_batch_size(error):
    assert should_reduce_batch_size(error)


def test_an_error_raised_from_an_out_of_memory_error_reduces_too():
    try:
        try:
            cpu_out_of_memory()
        except RuntimeError as oom:
            raise ValueError("the model wrapper failed") from oom
    except ValueError as err:
        assert should_reduce_batch_size(err)


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x3)"),
    RuntimeError(123),
    RuntimeError(),
    ValueError("CUDA out of memory."),  # (only RuntimeErrors are read: a ValueError with these words is the user's)
    KeyError("out of memory."),
], ids=repr)
def test_other_errors_do_not(error):
    assert not should_reduce_batch_size(error)


def test_halves_until_it_fits_and_returns_the_result():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, name, scale=1):
        tried.append(batch_size)
        if batch_size > 16:
            cpu_out_of_memory()
        return name, batch_size * scale

    assert train("run", scale=2) == ("run", 32)
    assert tried == [128, 64, 32, 16]
    assert train("again") == ("again", 16)  # a later call starts from the size that ran
    assert tried[4:] == [16]


def test_without_arguments_starts_at_128():
    tried = []

    @find_executable_batch_size
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 100:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return batch_size

    assert train() == 64
    assert tried == [128, 64]


def test_reduce_batch_size_fn_gives_the_next_size_in_both_decorator_forms():
    for form in ("arguments", "call"):
        tried, calls = [], []
        current = [128]

        def minus_forty():
            current[0] -= 40
            calls.append(current[0])
            return current[0]

        def train(batch_size):
            tried.append(batch_size)
            if batch_size > 16:
                cpu_out_of_memory()
            return batch_size

        if form == "arguments":
            wrapped = find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=minus_forty)(train)
        else:
            wrapped = find_executable_batch_size(train, starting_batch_size=128, reduce_batch_size_fn=minus_forty)
        assert wrapped() == 8, form
        assert tried == [128, 88, 48, 8] and calls == [88, 48, 8], form


def test_reduce_batch_size_fn_must_shrink_and_return_an_integer():
    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: 64)
    def stuck(batch_size):
        cpu_out_of_memory()

    with pytest.raises(ValueError, match="after batch size 64 ran out of memory.*gave 64.*smaller"):
        stuck()

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: 31.5)
    def fractional(batch_size):
        cpu_out_of_memory()

    with pytest.raises(TypeError, match="returned 31.5 after batch size 64.*integer >= 0"):
        fractional()


def test_reaching_zero_says_what_was_tried():
    tried = []

    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        tried.append(batch_size)
        cpu_out_of_memory()

    with pytest.raises(RuntimeError, match=r"No executable batch size found, reached zero: never_fits ran out of "
                                           r"memory at every batch size tried \(4, 2, 1\)\. Last error: RuntimeError: "
                                           r".*DefaultCPUAllocator"):
        never_fits()
    assert tried == [4, 2, 1]


def test_other_errors_pass_through_untouched():
    raised = ValueError("a bug in the training loop")
    tried = []

    @find_executable_batch_size(starting_batch_size=32)
    def buggy(batch_size):
        tried.append(batch_size)
        raise raised

    with pytest.raises(ValueError) as info:
        buggy()
    assert info.value is raised and tried == [32]


def test_passing_the_batch_size_is_refused():
    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size, model, lr=0.1):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train` as the first argument.*`train\(model="
                                        r"'net', lr=0\.5\)`"):
        train(32, "net", 0.5)
    with pytest.raises(TypeError, match="as `batch_size=`"):
        train("net", batch_size=32)
    assert train("net") == 32

    @find_executable_batch_size
    def no_parameter():
        return 1

    with pytest.raises(TypeError, match="must take the batch size as its first parameter"):
        no_parameter()


def test_wrong_decorator_arguments_are_refused():
    with pytest.raises(TypeError, match=r"give the batch size by name: @find_executable_batch_size\("
                                        r"starting_batch_size=64\)"):
        find_executable_batch_size(64)
    with pytest.raises(ValueError, match=r"starting_batch_size=0\): pass an integer >= 1"):
        find_executable_batch_size(starting_batch_size=0)(lambda batch_size: None)
    with pytest.raises(TypeError, match="reduce_batch_size_fn=8"):
        find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=8)


def test_a_failed_attempts_memory_is_freed_before_the_next():
    """The attempt's tensors, held by its frames (through the error's traceback) and by a reference cycle,
    are gone when the next attempt starts."""
    alive = []

    class Cycle:
        def __init__(self):
            self.me = self
            self.activations = torch.zeros(1000)

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        alive.append([ref() is not None for ref in refs])
        activations = torch.zeros(batch_size, 1000)
        cycle = Cycle()
        refs[:] = [weakref.ref(activations), weakref.ref(cycle.activations)]
        if batch_size > 4:
            cpu_out_of_memory()
        return batch_size

    refs = []
    gc.disable()  # (only the decorator's own collection may free the cycle)
    try:
        assert train() == 4
    finally:
        gc.enable()
    assert alive == [[], [False, False]]


def test_release_memory_and_clear_device_cache():
    class Cycle:
        def __init__(self):
            self.me = self
            self.weights = torch.zeros(1000)

    garbage = Cycle()
    ref = weakref.ref(garbage.weights)
    gc.disable()  # (only release_memory's own collection may free the cycle)
    try:
        model = Cycle()
        del garbage
        model, other = release_memory(model, torch.zeros(3))
        assert (model, other) == (None, None) and ref() is None
    finally:
        gc.enable()
    assert release_memory() == []
    clear_device_cache()
    clear_device_cache(garbage_collection=True)
    assert not torch.cuda.is_initialized()  # (a device never used is not started to empty its cache)


_SEARCH_RUN = {}


def batch_size_search_run(tmp_path_factory):
    """Each rank's results of tests/workers/batch_size_search.py on 2 processes, and its trace directory.

    Launched once for every test that reads it (here and in test_profiling.py): it takes about 20 s, half of
    it the process group's timeout that its last scenario waits out on purpose."""
    if not _SEARCH_RUN:
        from conftest import WORKERS, torchrun

        out = tmp_path_factory.mktemp("batch_size_search")
        ranks = torchrun(WORKERS / "batch_size_search.py", 2, "--trace-dir", out / "traces", out_dir=out, timeout=240)
        _SEARCH_RUN.update(ranks=ranks, traces=out / "traces")
    return _SEARCH_RUN["ranks"], _SEARCH_RUN["traces"]


@pytest.mark.slow
def test_every_process_tries_the_same_batch_sizes(tmp_path_factory):
    """2 processes (gloo): a rank that runs out of memory on its first try only, different starting sizes,
    reduce functions that differ, another error on one rank, reaching zero, a DDP run rebuilt per attempt,
    and the limit (one rank out of memory while the other waits in DDP's all-reduce: both fail, no hang)."""
    ranks, _ = batch_size_search_run(tmp_path_factory)
    for rank, result in enumerate(ranks):
        assert result["one_rank_first_try"] == {"returned": 64, "tried": [128, 64]}, rank
        assert result["different_starts"] == {"returned": 32, "tried": [64, 32]}, rank
        custom = result["custom_reduce"]
        assert (custom["returned"], custom["tried"]) == (32, [128, 64, 32]), rank
        assert custom["reduce_calls"] == ([118, 108] if rank == 0 else [64, 32])  # once each per failed attempt
        zero = result["reach_zero"]
        assert zero["tried"] == [4, 2, 1] and zero["error"] == "RuntimeError", rank
        assert "No executable batch size found, reached zero" in zero["message"]
        assert "process 0: RuntimeError" in zero["message"] and "DefaultCPUAllocator" in zero["message"]
        ddp = result["ddp_all_ranks_oom"]
        assert ddp["tried"] == [128, 64, 32] and len(ddp["returned"]) == 64, rank
    assert ranks[0]["ddp_all_ranks_oom"]["returned"] == ranks[1]["ddp_all_ranks_oom"]["returned"]  # DDP in step

    error = [r["other_error"] for r in ranks]
    assert error[1]["error"] == "ValueError" and error[1]["message"] == "boom on rank 1"  # untouched
    assert error[0]["error"] == "RuntimeError" and error[0]["tried"] == [8]
    assert "process 1 stopped with ValueError: boom on rank 1" in error[0]["message"]
    assert error[0]["seconds"] < 5  # told, not timed out

    stuck = [r["one_rank_mid_step"] for r in ranks]
    timeout = stuck[0]["timeout_s"]
    assert all(s["tried"] == [16] and s["error"] == "RuntimeError" for s in stuck)
    assert "Timed out" in stuck[0]["message"]  # rank 0 waited in DDP's all-reduce until the group's timeout
    assert "process 0 stopped with RuntimeError" in stuck[1]["message"]
    assert "This process had run out of memory" in stuck[1]["message"]
    assert "cannot be recovered" in stuck[1]["message"]
    assert all(s["seconds"] < timeout + 8 for s in stuck)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_real_cuda_out_of_memory_error_is_recovered_and_its_memory_freed():
    free, total = torch.cuda.mem_get_info()
    base = torch.cuda.memory_allocated()
    tried, peaks = [], []

    @find_executable_batch_size(starting_batch_size=1024)
    def fill(batch_size):
        tried.append(batch_size)
        peaks.append(torch.cuda.memory_allocated() - base)
        # 1024 and 512 rows of total/256 bytes: 4x and 2x the card; 256 rows: the card itself (fails too,
        # other memory is in use); 128 rows: half of it
        held = [torch.empty(total // 256, dtype=torch.uint8, device="cuda") for _ in range(batch_size)]
        return len(held)

    assert fill() == 128
    assert tried == [1024, 512, 256, 128]
    assert max(peaks) < total // 256 * 2  # what a failed attempt allocated was freed before the next
    assert torch.cuda.memory_reserved() < total // 2 + 2**30  # the cache was emptied after the failures


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_training_step_too_large_for_the_gpu_finds_a_batch_that_fits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()  # (cuBLAS's workspaces, kept: part of the base)
    optimizer.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    start = 1 << (total // (1024 * 4)).bit_length()  # one input batch alone is larger than the card
    tried = []

    @find_executable_batch_size(starting_batch_size=start)
    def step(batch_size):
        tried.append(batch_size)
        x = torch.randn(batch_size, 1024, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch_size

    found = step()
    assert 0 < found < start and tried == [start >> i for i in range(len(tried))] and tried[-1] == found
    assert len(tried) >= 2
    assert torch.cuda.memory_allocated() - base < 2**20  # nothing of the attempts is left (gradients: set to None)
