"""XLA workers for tests/xla (run in the XLA environment with PJRT_DEVICE=CPU). One mode per call:

replicas   under `fabric-lite launch --tpu`: the raw door with accumulation 2 and clipping, then gather_for_metrics,
           all_gather_object and reduce; every replica writes rank{r}.json
reference  one replica, the same samples in global batches (accumulation 2, clipping): what the replicas must equal
precisions one replica trains the same steps in 32-true, bf16-mixed and bf16-true, raw door and Trainer
moves     a checkpoint saved on XLA loads on the CPU (single device), and one saved on the CPU loads on XLA
errors     bad input on XLA: fp16, devices above what the runtime has, devices>1 in a lone replica
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, Trainer, TrainModule
from fabric_lite.utils import DistributedDataParallelKwargs

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", required=True)
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)

N, PER_REPLICA, CLIP, LR = 32, 4, 0.5, 0.1


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 1, generator=g)).squeeze(1))


def make_model(seed=0):
    """Weights drawn from a generator of its own: replicas that are threads share torch's global one."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def cpu_weights(acc, model):
    return {k: v.reshape(-1).tolist() for k, v in acc.get_state_dict(model).items()}


def train(acc, model, opt, loader, epochs=2):
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(F.mse_loss(model(x).squeeze(1), y))
                acc.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()


def write(rank, result):
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def mode_replicas():
    acc = Accelerator(gradient_accumulation_steps=2)
    # another initial model on each replica: replica 0's weights must reach every replica
    model = make_model(seed=acc.process_index)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(data(), batch_size=PER_REPLICA // 2)
    model, opt, loader = acc.prepare(model, opt, loader)
    train(acc, model, opt, loader)
    indices = DataLoader(torch.arange(13), batch_size=2)
    indices = acc.prepare(indices)
    seen = [int(i) for batch in indices for i in acc.gather_for_metrics(batch).cpu()]
    objects = acc.gather_for_metrics([f"r{acc.process_index}"], use_gather_object=True)
    total = acc.reduce(torch.tensor([acc.process_index + 1.0], device=acc.device), "sum").cpu().tolist()
    write(acc.process_index, {
        "world": acc.num_processes, "rank": acc.process_index, "device": str(acc.device),
        "distributed_type": str(acc.distributed_type), "weights": cpu_weights(acc, model),
        "for_metrics": seen, "objects": objects, "reduce_sum": total,
    })


def mode_reference():
    acc = Accelerator(accelerator="tpu", gradient_accumulation_steps=2)
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    # replicas r=0,1 take micro-batches 2k and 2k+1 of size b/2 each: in order, that is one loader of size b
    loader = DataLoader(data(), batch_size=PER_REPLICA)
    model, opt, loader = acc.prepare(model, opt, loader)
    train(acc, model, opt, loader)
    write(0, {"world": acc.num_processes, "weights": cpu_weights(acc, model)})


class Regression(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(1), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def mode_precisions():
    out = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        acc = Accelerator(accelerator="tpu", mixed_precision=precision)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt, loader = acc.prepare(model, opt, DataLoader(data(), batch_size=8))
        train(acc, model, opt, loader, epochs=1)
        trainer = Trainer(accelerator="tpu", devices=1, precision=precision, max_epochs=1, enable_progress_bar=False,
                          default_root_dir=os.path.join(args.out, precision))
        trainer.fit(Regression(), DataLoader(data(), batch_size=8))
        out[precision] = {
            "raw": cpu_weights(acc, model), "param_dtype": str(next(model.parameters()).dtype),
            "device": str(acc.device), "distributed_type": str(acc.distributed_type),
            "trainer": cpu_weights(trainer.accelerator, trainer.model), "trainer_steps": trainer.global_step,
            "trainer_device": str(trainer.device), "logged": sorted(trainer.logged_metrics),
        }
    write(0, out)


def mode_trainer_replicas():
    """Started with plain python: Trainer(devices=2) starts the script again as 2 XLA replicas."""
    trainer = Trainer(accelerator="tpu", devices=2, max_epochs=2, enable_progress_bar=False,
                      default_root_dir=os.path.join(args.out, "run"))
    trainer.fit(Regression(), DataLoader(data(), batch_size=4))
    write(trainer.accelerator.process_index, {"world": trainer.accelerator.num_processes, "steps": trainer.global_step,
                                "weights": cpu_weights(trainer.accelerator, trainer.model)})


def mode_moves():
    root = args.out
    xla = Accelerator(accelerator="tpu")
    model = make_model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = xla.prepare(model, opt, DataLoader(data(), batch_size=8))
    train(xla, model, opt, loader, epochs=1)
    xla.save_state(os.path.join(root, "from_xla"))
    xla.save({"weight": model[0].weight, "note": "x"}, os.path.join(root, "saved.pt"))  # Accelerate's save: CPU tensors
    saved = torch.load(os.path.join(root, "saved.pt"), weights_only=True)
    cpu = Accelerator(cpu=True)
    cpu_model = make_model(seed=2)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    cpu_model, cpu_opt, cpu_loader = cpu.prepare(cpu_model, cpu_opt, DataLoader(data(), batch_size=8))
    cpu.load_state(os.path.join(root, "from_xla"))
    on_cpu = cpu_weights(cpu, cpu_model)
    train(cpu, cpu_model, cpu_opt, cpu_loader, epochs=1)  # AdamW's moments came along: one more epoch on the CPU
    cpu.save_state(os.path.join(root, "from_cpu"))
    back = Accelerator(accelerator="tpu")
    back_model = make_model(seed=3)
    back_opt = torch.optim.AdamW(back_model.parameters(), lr=1e-2)
    back_model, back_opt, _ = back.prepare(back_model, back_opt, DataLoader(data(), batch_size=8))
    back.load_state(os.path.join(root, "from_cpu"))
    write(0, {"xla": cpu_weights(xla, model), "on_cpu": on_cpu, "cpu_device": str(cpu.device),
              "saved": [str(saved["weight"].device), saved["weight"].reshape(-1).tolist(), saved["note"]],
              "cpu_trained": cpu_weights(cpu, cpu_model), "back_on_xla": cpu_weights(back, back_model),
              "back_device": str(back.device),
              "steps": {k: int(v["step"]) for k, v in back_opt.state_dict()["state"].items()}})


def error_of(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads type and message
        return {"type": type(err).__name__, "message": str(err)}
    return None


def mode_errors():
    out = {
        "fp16": error_of(lambda: Accelerator(accelerator="tpu", mixed_precision="fp16")),
        "lone_devices": error_of(lambda: Accelerator(accelerator="tpu", devices=2)),
        "ddp_on_tpu": error_of(lambda: Accelerator(accelerator="tpu", strategy="ddp")),
        # an Accelerate script's DDP kwargs handler on a TPU: ignored there, as Accelerate does
        "ddp_kwargs_on_tpu": error_of(lambda: Accelerator(
            accelerator="tpu", kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])),
        "too_many": error_of(lambda: Accelerator(strategy="xla_spmd", devices=3)),  # (last: it turns SPMD on)
    }
    write(0, out)


globals()[f"mode_{args.mode}"]()
print(f"xla_cases {args.mode}: done", file=sys.stderr)
