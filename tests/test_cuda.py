"""The CUDA paths: batches fed to the GPU on a side stream, bf16/fp16 autocast, GradScaler, NCCL, resume.

Every test here needs an NVIDIA GPU and skips without one (CI has none).
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import WORKERS, free_port, run_command

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(64, 4))


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def _flat(model):
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_prepared_loader_yields_the_cpu_batches_on_the_gpu(pin_memory, num_workers):
    from fabric_lite import Accelerator

    def batches(cpu):
        acc = Accelerator(cpu=cpu)
        torch.manual_seed(0)  # the shuffle's seed is drawn from the global generator
        loader = acc.prepare(DataLoader(_data(), batch_size=32, shuffle=True, pin_memory=pin_memory,
                                        num_workers=num_workers))
        return acc, [tuple(t.clone() for t in b) for epoch in range(2) for b in loader]

    acc, on_gpu = batches(cpu=False)
    _, on_cpu = batches(cpu=True)
    assert acc.device.type == "cuda"
    assert len(on_gpu) == len(on_cpu) == 16
    for g, c in zip(on_gpu, on_cpu):
        assert all(t.device == acc.device for t in g)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(g, c))


def test_feed_keeps_batches_apart_while_the_gpu_lags():
    """The step's stream is held back (torch.cuda._sleep) while the side stream copies the next
    batches into fresh memory and the loader refills one pinned host buffer: every batch must still be
    read whole and unchanged (the step waits for its copy; no copy lands in memory a queued kernel
    will read; the host buffer is not refilled under a copy in flight)."""
    from fabric_lite import Accelerator

    n, width = 24, 1 << 20  # 4 MiB a batch: copies that take a while
    shared = torch.empty(1, width).pin_memory()

    def collate(indices):
        shared.fill_(float(indices[0]))  # the same host memory for every batch
        return shared

    loader = DataLoader(list(range(n)), batch_size=1, collate_fn=collate)
    acc = Accelerator()
    prepared = acc.prepare(loader)
    sums = []
    for batch in prepared:
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time ahead of the read below
        sums.append(batch.sum())
        del batch
    got = torch.stack(sums).cpu()
    assert torch.equal(got, torch.arange(n, dtype=torch.float32) * width)


def _lagging_reads(loader, lag_stream, n):
    """Read every batch while `lag_stream` (the copy stream or the step stream) is held back."""
    sums = []
    for batch in loader:
        if lag_stream == "step":
            torch.cuda._sleep(2_000_000)
        x = batch["x"] if isinstance(batch, dict) else batch
        sums.append(x.sum())
        del batch, x
        if lag_stream == "copy":  # the next copy queues behind ~1 ms of GPU work
            with torch.cuda.stream(loader._cuda_feed().stream):
                torch.cuda._sleep(2_000_000)
    return torch.stack(sums).cpu()


@pytest.mark.parametrize("lag_stream", ["copy", "step"])
@pytest.mark.parametrize("as_dict", [False, True])
def test_each_batch_is_read_only_after_its_copy(lag_stream, as_dict):
    """With the copy stream held back, a step that did not wait for its copy would read stale memory;
    with the step stream held back, a copy into memory a queued kernel still reads would show."""
    from fabric_lite import Accelerator

    n, width = 16, 1 << 20
    data = [torch.full((width,), float(i)) for i in range(n)]

    def collate(items):
        return {"x": items[0][None], "i": torch.tensor([0])} if as_dict else items[0][None]

    acc = Accelerator()
    loader = acc.prepare(DataLoader(data, batch_size=1, collate_fn=collate, pin_memory=True))
    _lagging_reads(loader, lag_stream, n)  # warm the allocator (a first cudaMalloc waits for the device)
    got = _lagging_reads(loader, lag_stream, n)
    assert torch.equal(got, torch.arange(n, dtype=torch.float32) * width)


def test_the_host_does_not_wait_for_queued_kernels_to_get_a_batch():
    from fabric_lite import Accelerator

    acc = Accelerator()
    loader = acc.prepare(DataLoader(_data(), batch_size=32, pin_memory=True))
    it = iter(loader)
    next(it)
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU work queued on the step's stream
    x, _ = next(it)
    assert not torch.cuda.current_stream().query()  # the kernel is still running: the host did not wait
    assert x.device.type == "cuda"
    torch.cuda.synchronize()


def test_sparse_batches_are_moved_the_plain_way():
    from fabric_lite import Accelerator

    sparse = [torch.eye(4).to_sparse() * i for i in range(3)]
    acc = Accelerator()
    loader = acc.prepare(DataLoader(sparse, batch_size=None))
    got = [b.to_dense().sum().item() for b in loader]
    assert got == [0.0, 4.0, 8.0]


def test_feed_moves_dict_batches_and_objects_with_their_own_to():
    from fabric_lite import Accelerator

    class Box:
        def __init__(self, t):
            self.t = t

        def to(self, device):
            return Box(self.t.to(device))

    data = [{"x": torch.full((3,), float(i)), "box": Box(torch.tensor([i]))} for i in range(4)]
    acc = Accelerator()
    loader = acc.prepare(DataLoader(data, batch_size=2, collate_fn=lambda items: {
        "x": torch.stack([d["x"] for d in items]), "box": Box(torch.cat([d["box"].t for d in items]))}))
    seen = list(loader)
    assert [b["x"].device.type for b in seen] == ["cuda", "cuda"]
    assert [b["box"].t.device.type for b in seen] == ["cuda", "cuda"]
    assert seen[1]["x"][1, 0].item() == 3.0 and seen[1]["box"].t.tolist() == [2, 3]


def _hand_loop(model, loader, steps, dtype, scaler=None, inject_inf_at=None):
    device = torch.device("cuda")
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    it = iter(loader)
    for step in range(steps):
        x, y = (t.to(device) for t in next(it))
        with torch.autocast("cuda", dtype=dtype):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        if step == inject_inf_at:
            loss = loss * float("inf")
        skipped = False
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            before = scaler.get_scale()
            scaler.update()
            skipped = scaler.get_scale() < before  # the scale shrinks exactly when the step was skipped
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        if not skipped:
            scheduler.step()
    return model, optimizer, scheduler


def _accelerator_loop(model, loader_fn, steps, precision, inject_inf_at=None):
    from fabric_lite import Accelerator

    acc = Accelerator(mixed_precision=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader_fn(), scheduler)
    it = iter(loader)
    skipped = []
    for step in range(steps):
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        if step == inject_inf_at:
            loss = loss * float("inf")
        acc.backward(loss)
        optimizer.step()
        skipped.append(acc.optimizer_step_was_skipped)
        optimizer.zero_grad()
        scheduler.step()
    return acc, model, optimizer, scheduler, skipped


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_matches_the_hand_written_autocast_loop(precision, dtype):
    """Same weights bit for bit as torch.autocast (+ GradScaler for fp16) written by hand."""
    def loader():
        return DataLoader(_data(), batch_size=32)

    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    ref, _, ref_sched = _hand_loop(_mlp(), loader(), 6, dtype, scaler)
    acc, model, _, sched, skipped = _accelerator_loop(_mlp(), loader, 6, precision)
    assert acc.device.type == "cuda" and not any(skipped)
    assert torch.equal(_flat(ref), _flat(acc.unwrap_model(model)))
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    with torch.no_grad():
        out = model(torch.randn(2, 16, device="cuda"))
    assert out.dtype == torch.float32  # outputs come back in fp32
    if scaler is not None:
        assert acc.scaler.get_scale() == scaler.get_scale()


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    def loader():
        return DataLoader(_data(), batch_size=32)

    scaler = torch.amp.GradScaler("cuda")
    ref, ref_opt, ref_sched = _hand_loop(_mlp(), loader(), 5, torch.float16, scaler, inject_inf_at=2)
    acc, model, optimizer, sched, skipped = _accelerator_loop(_mlp(), loader, 5, "fp16", inject_inf_at=2)
    assert skipped == [False, False, True, False, False]
    assert torch.equal(_flat(ref), _flat(acc.unwrap_model(model)))
    assert acc.scaler.get_scale() == scaler.get_scale() == 65536.0 / 2
    # the skipped step did not move the schedule: 4 of 5 scheduler steps took effect
    assert sched.get_last_lr()[0] == ref_sched.get_last_lr()[0] == pytest.approx(1e-2 * 0.5 ** 4)
    assert ref_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"] == 4


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_on_the_gpu_is_bit_exact(tmp_path, precision):
    """Save mid-run (CUDA RNG for dropout, GradScaler state, loader position), restore into fresh
    objects, finish: the same weights as the run that never stopped."""
    from fabric_lite import Accelerator

    def start():
        acc = Accelerator(mixed_precision=precision)
        model = _mlp(dropout=0.3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(_data(), batch_size=32, shuffle=True, pin_memory=True)
        return (acc, *acc.prepare(model, optimizer, loader))

    def train(acc, model, optimizer, loader, steps, it):
        for _ in range(steps):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            acc.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return it

    torch.manual_seed(7)
    acc, model, optimizer, loader = start()
    it = train(acc, model, optimizer, loader, 5, iter(loader))
    acc.save_state(tmp_path / "ckpt")
    train(acc, model, optimizer, loader, 7, it)  # crosses the epoch end (8 batches an epoch)
    straight = _flat(acc.unwrap_model(model))

    torch.manual_seed(123)  # a different RNG state that the restore must overwrite
    torch.cuda.manual_seed(123)
    acc2, model2, optimizer2, loader2 = start()
    acc2.load_state(tmp_path / "ckpt")
    train(acc2, model2, optimizer2, loader2, 7, iter(loader2))
    assert torch.equal(straight, _flat(acc2.unwrap_model(model2)))


def test_trainer_on_the_gpu_trains_and_its_checkpoint_loads_on_the_cpu(tmp_path):
    from fabric_lite import Trainer, TrainModule

    class Module(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss, on_epoch=True)
            assert x.device.type == "cuda"
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    trainer = Trainer(max_epochs=3, precision="bf16-mixed", enable_progress_bar=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(_data(), batch_size=32, shuffle=True, pin_memory=True))
    assert trainer.device.type == "cuda" and trainer.global_step == 24
    assert next(module.parameters()).device.type == "cuda"
    assert trainer.callback_metrics["train/loss_epoch"].device.type == "cuda"

    from fabric_lite.cli.main import main

    (ckpt,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()]
    out = tmp_path / "weights.pt"
    assert main(["consolidate", str(ckpt), str(out)]) == 0
    fresh = Module()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(torch.load(out, map_location="cpu", weights_only=True))
    assert torch.equal(_flat(fresh), _flat(module))


def test_prepare_moves_the_model_without_keeping_a_second_copy():
    from fabric_lite import Accelerator

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = torch.nn.Linear(1024, 1024)
    acc = Accelerator()
    model = acc.prepare(model)
    grown = torch.cuda.memory_allocated() - before
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert params <= grown <= params + 4096  # (a few bytes of flags at most: no second copy)


def _launch_nccl(tmp_path, nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(WORKERS / "cuda_nccl.py"), "--out", str(tmp_path)]
    return run_command(cmd, timeout=240, gpus=True)


def test_nccl_process_group_collectives_and_checkpoint(tmp_path):
    """One process per GPU over NCCL: the group's backend, gather_for_metrics, reduce, broadcast,
    save_state/load_state round trip."""
    import json

    n = torch.cuda.device_count()
    proc = _launch_nccl(tmp_path, n)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for r in range(n):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["backend"] == "nccl"
        assert result["gathered"] == list(range(10 * n))
        assert result["reduced"] == sum(range(n))
        assert result["restored_equal"] is True
        assert result["device"] == f"cuda:{r}"


def test_more_processes_than_gpus_is_a_clear_error(tmp_path):
    n = torch.cuda.device_count()
    proc = _launch_nccl(tmp_path, n + 1)
    assert proc.returncode != 0
    assert "other process(es) of this job picked the same GPU" in proc.stderr + proc.stdout
    assert "NCCL needs a GPU of its own for each process" in proc.stderr + proc.stdout


def test_deepcopy_of_a_prepared_gpu_model_runs_its_own_weights():
    from fabric_lite import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_mlp())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = torch.randn(4, 16, device="cuda")
    assert not torch.equal(model(x), twin(x))


def test_deepspeed_fp16_on_the_gpu_skips_overflow_and_resumes_exactly(tmp_path):
    """ZeRO-2 in fp16: DeepSpeed's own loss scaler (the torch GradScaler is dropped), its skipped step
    seen by `optimizer_step_was_skipped` and by the scheduler; checkpoint round trip bit for bit."""
    import json

    pytest.importorskip("deepspeed")
    proc = run_command([sys.executable, str(WORKERS / "cuda_deepspeed.py"), "--out", str(tmp_path)],
                       timeout=400, gpus=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["device"].startswith("cuda")
    assert "torch.float16" in r["param_dtypes"]
    assert r["skipped"][30] is True
    # the overflow at step 30, and none after the first steps (the initial 2**16 scale may overflow too)
    assert not any(r["skipped"][10:30]) and not any(r["skipped"][31:])
    steps_taken = 40 - sum(r["skipped"])
    assert r["lr_after"] == pytest.approx(1e-2 * 0.9 ** steps_taken)
    assert r["last_loss"] < r["first_loss"]
    assert r["resumed_equal"] is True


def test_fsdp_cpu_offload_on_the_gpu(tmp_path):
    """FSDP2 with CPUOffloadPolicy on one GPU: shards live in CPU memory, compute runs on the GPU in bf16,
    training converges and a sharded checkpoint restores the weights exactly."""
    import json

    proc = run_command([sys.executable, str(WORKERS / "cuda_fsdp.py"), "--out", str(tmp_path)], timeout=300, gpus=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["device"].startswith("cuda")
    assert r["shard_devices"] == ["cpu"]
    assert r["master_dtypes"] == ["torch.float32"]
    assert r["last_loss"] < r["first_loss"]
    assert r["restored_equal"] is True


def test_background_save_copies_gpu_state_to_pinned_memory_without_waiting_for_the_gpu(tmp_path):
    """The snapshot of a background save is queued on the step's stream (after the kernels before it, before
    the ones after it) into pinned host buffers: save_state returns while the GPU is still busy, training goes
    on changing the weights in place, and the checkpoint holds the weights of the call."""
    from fabric_lite import Accelerator

    def build(seed):
        acc = Accelerator()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return (acc, *acc.prepare(model, opt))

    def step(model, opt):
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    acc, model, opt = build(0)
    step(model, opt)
    expected = [p.detach().clone() for p in model.parameters()]  # queued: the values at the call
    torch.cuda._sleep(500_000_000)  # hold the stream back (~0.3 s): the copies queue behind it
    acc.save_state(tmp_path / "ckpt", blocking=False)
    assert not torch.cuda.current_stream().query()  # returned without waiting for the GPU
    for _ in range(3):
        step(model, opt)  # queued after the copies: they read the weights of the call
    acc.wait_for_checkpoint()
    copies_of_gpu_tensors = [b for b in acc.checkpoint_saver.buffers.buffers if b.dtype == torch.float32 and b.dim()]
    assert copies_of_gpu_tensors and all(b.is_pinned() for b in copies_of_gpu_tensors)  # (RNG states: plain)
    acc2 = Accelerator(cpu=True)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    cpu_model, cpu_opt = acc2.prepare(cpu_model, cpu_opt)
    acc2.load_state(tmp_path / "ckpt")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(expected, cpu_model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))  # training did go on


def test_a_llama_style_model_on_a_1x1_mesh_trains_on_the_gpu_as_plain_torch(tmp_path):
    """N-D parallelism on the one GPU there is: ModelParallelStrategy(1, 1) applies the tensor-parallel plan and
    FSDP2 over meshes of one rank (NCCL), and trains as the plain model does on the same GPU."""
    import json

    proc = run_command([sys.executable, str(WORKERS / "llama_1x1.py"), "--out", str(tmp_path), "--accelerator", "gpu"],
                       timeout=240, gpus=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["kinds"] == ["DTensor"]
    assert result["diff"] < 1e-4, result["diff"]


def test_the_rehearsal_of_64_ranks_runs_on_the_gpu_and_reports_its_peak_memory(tmp_path):
    """`fabric-lite explain --rehearse` on a GPU machine: rank 0 of 64 (FSDP 8 x TP 8, bf16) on the fake process
    group, on cuda:0; its shards and peak allocation are reported."""
    import re

    proc = run_command([sys.executable, "-m", "fabric_lite.cli", "explain", "--rehearse", "--num_processes", "64",
                        "--use_parallelism_config", "--parallelism_config_dp_shard_size", "8",
                        "--parallelism_config_tp_size", "8", str(WORKERS / "rehearse_llama.py"), "--out", str(tmp_path),
                        "--dim", "1024", "--layers", "8", "--heads", "16"], timeout=300, gpus=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = proc.stdout[proc.stdout.index("Rehearsal:"):]
    print(out)
    params = int(re.search(r"parameters\s+([\d,]+) B", out).group(1).replace(",", ""))
    peak = int(re.search(r"peak on cuda:0\s+([\d,]+) B", out).group(1).replace(",", ""))
    # 8 blocks of 4 x 1024^2 + 3 x 1024 x 4096 weights split 64 ways, embeddings and output 8 ways (fp32 shards)
    blocks = 8 * (4 * 1024 * 1024 + 3 * 1024 * 4096) * 4 / 64
    assert blocks < params < blocks + 2 * 256 * 1024 * 4 / 8 + 65536
    assert peak > params  # (the gathered weights and the activations come on top)


def test_a_background_sharded_fsdp_save_on_the_gpu_stages_into_pinned_memory_and_loads_exactly(tmp_path):
    """FSDP2 with sharded (DCP) checkpoints on the GPU: save_state(blocking=False) copies the shards into pinned host
    buffers on the step's stream and returns; training goes on; the checkpoint holds the weights of the call."""
    from fabric_lite import Accelerator
    from fabric_lite.strategies import FSDPStrategy

    def build(seed):
        acc = Accelerator(strategy=FSDPStrategy(state_dict_type="sharded"))
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return (acc, *acc.prepare(model, opt))

    def step(model, opt):
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def full(model):
        return [p.detach().full_tensor().cpu().clone() for p in model.parameters()]

    acc, model, opt = build(0)
    step(model, opt)
    expected = full(model)
    acc.save_state(tmp_path / "ckpt", blocking=False)
    for _ in range(3):
        step(model, opt)
    acc.wait_for_checkpoint()
    assert acc.checkpoint_saver.history[-1].background
    staged = [b for b in acc.checkpoint_saver.buffers.buffers if b.dtype == torch.float32 and b.dim()]
    assert staged and all(b.is_pinned() for b in staged)
    assert not all(torch.equal(a, b) for a, b in zip(expected, full(model)))  # training did go on
    acc.end_training()
    acc2, model2, opt2 = build(1)
    acc2.load_state(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(expected, full(model2)))
    acc2.end_training()
