"""find_executable_batch_size on several processes (each scenario's outcome per rank), then a profiled DDP run.

Out-of-memory errors are real: the CPU allocator refuses 2**50 bytes (more than any address space holds).
The last scenario is the documented limit (one rank out of memory while the other waits in DDP's gradient
all-reduce): it must end in errors on both ranks within the process group's timeout, not hang.
"""

import datetime
import hashlib
import os
import time

import torch
import torch.nn.functional as F

from common import make_model, parse, write_result
from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import InitProcessGroupKwargs
from fabric_lite.accelerator.memory import find_executable_batch_size
from fabric_lite.accelerator.profiling import ProfileKwargs, profile_context

TIMEOUT_S = 10
args = parse({"--trace-dir": {"required": True}})
handler = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
                        record_shapes=True, with_flops=True, output_trace_dir=args.trace_dir)
accelerator = Accelerator(cpu=True, kwargs_handlers=[
    InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=TIMEOUT_S)), handler])
rank = accelerator.process_index
result = {}


def out_of_memory():
    torch.empty(2**50, dtype=torch.uint8)


def outcome(fn):
    """What fn() did on this rank: its return value, or the error's type and message."""
    try:
        return {"returned": fn()}
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}


# 1. Rank 1 runs out of memory on its first try only; rank 0 never: both retry, both end at 64.
tried = []


@find_executable_batch_size(starting_batch_size=128)
def first_try_fails(batch_size):
    tried.append(batch_size)
    if rank == 1 and len(tried) == 1:
        out_of_memory()
    return batch_size


result["one_rank_first_try"] = {**outcome(first_try_fails), "tried": list(tried)}

# 2. Different starting sizes: the smallest is tried first everywhere; rank 0 fails above 40.
tried = []


@find_executable_batch_size(starting_batch_size=100 if rank == 0 else 64)
def uneven_start(batch_size):
    tried.append(batch_size)
    if rank == 0 and batch_size > 40:
        out_of_memory()
    return batch_size


result["different_starts"] = {**outcome(uneven_start), "tried": list(tried)}

# 3. A reduce_batch_size_fn that differs between ranks: each calls its own once per failed attempt, the
# smallest proposal wins.
tried, reduce_calls = [], []
current = 128


def reduce_fn():
    global current
    current = current - 10 if rank == 0 else current // 2
    reduce_calls.append(current)
    return current


@find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=reduce_fn)
def custom_reduce(batch_size):
    tried.append(batch_size)
    if rank == 1 and batch_size > 50:
        out_of_memory()
    return batch_size


result["custom_reduce"] = {**outcome(custom_reduce), "tried": list(tried), "reduce_calls": list(reduce_calls)}

# 4. Another error on rank 1 goes on untouched there; rank 0, which succeeded, raises too instead of going on alone.
tried = []


@find_executable_batch_size(starting_batch_size=8)
def other_error(batch_size):
    tried.append(batch_size)
    if rank == 1:
        raise ValueError("boom on rank 1")
    return batch_size


start = time.monotonic()
result["other_error"] = {**outcome(other_error), "tried": list(tried), "seconds": time.monotonic() - start}

# 5. Rank 0 never fits: both reach zero together.
tried = []


@find_executable_batch_size(starting_batch_size=4)
def never_fits(batch_size):
    tried.append(batch_size)
    if rank == 0:
        out_of_memory()
    return batch_size


result["reach_zero"] = {**outcome(never_fits), "tried": list(tried)}

# 6. DDP training rebuilt at each attempt (Accelerate's memory example); every rank runs out of memory in the
# forward pass above 32, before any of them waits in the gradient all-reduce: the run recovers at 32.
tried = []


@find_executable_batch_size(starting_batch_size=128)
def train(batch_size):
    tried.append(batch_size)
    accelerator.free_memory()
    model = make_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)
    if batch_size > 32:
        out_of_memory()  # (stands for the activations of a batch too large)
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


result["ddp_all_ranks_oom"] = {**outcome(train), "tried": list(tried)}

# 7. The profiler over a few DDP steps, with a schedule: one Chrome trace per rank.
accelerator.free_memory()
model = make_model(seed=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
through_method = hasattr(accelerator, "profile")
context = accelerator.profile() if through_method else profile_context(handler, rank, accelerator.wait_for_everyone)
with context as prof:
    for step in range(5):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        prof.step()
averages = prof.key_averages()
result["profile"] = {
    "through_method": through_method,
    "ops": sorted({e.key for e in averages}),
    "flops": sum(e.flops for e in averages),
    "addmm_shapes": [e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::addmm"],
    "traces": sorted(os.listdir(args.trace_dir)),  # (after the context: every rank has written its own)
}

# 8. The limit: rank 1 runs out of memory in the forward pass while rank 0 waits for it in the gradient
# all-reduce. Both must fail within the process group's timeout (plus grace), not hang.
tried = []


@find_executable_batch_size(starting_batch_size=16)
def one_rank_mid_step(batch_size):
    tried.append(batch_size)
    x, y = torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))
    if rank == 1:
        out_of_memory()
    accelerator.backward(F.cross_entropy(model(x), y))
    return batch_size


start = time.monotonic()
result["one_rank_mid_step"] = {**outcome(one_rank_mid_step), "tried": list(tried),
                               "seconds": time.monotonic() - start, "timeout_s": TIMEOUT_S}
write_result(args.out, rank, result)
# The process group is broken by the timed-out all-reduce: leave without tearing it down.
os._exit(0)
