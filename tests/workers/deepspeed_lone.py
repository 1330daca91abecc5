"""DeepSpeed in a lone process (no launcher): the Trainer in bf16, a checkpoint, and the errors a user meets.

Writes rank0.json with what the test asserts: losses, parameter and input dtypes, the checkpoint's files,
and the message of each expected error (or None where no error came).
"""

import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import parse, write_result
from fabric_lite import Accelerator, DeepSpeedPlugin, Trainer, TrainModule, set_seed
from fabric_lite.checkpoint.files import CheckpointError

args = parse({"--root": {"required": True}, "--foreign": {"default": None}})


class Regression(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.input_dtypes = set()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.input_dtypes.add(str(x.dtype))
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def error_of(fn):
    try:
        fn()
    except (ValueError, CheckpointError) as err:
        return f"{type(err).__name__}: {err}"
    return None


set_seed(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(128, 4, generator=g)
data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
module = Regression()
trainer = Trainer(max_epochs=4, strategy="deepspeed_stage_2", precision="bf16-mixed", default_root_dir=args.root,
                  enable_progress_bar=False, accumulate_grad_batches=2, gradient_clip_val=1.0)
trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)))
checkpoint = f"{args.root}/checkpoints/last-check"
trainer.save_checkpoint(checkpoint)
result = {
    "first_loss": sum(module.losses[:8]) / 8, "last_loss": sum(module.losses[-8:]) / 8,
    "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}), "input_dtypes": sorted(module.input_dtypes),
    "config": trainer.strategy.config, "checkpoint": checkpoint,
    # a checkpoint of another strategy, and a DeepSpeed checkpoint loaded without DeepSpeed
    "foreign_into_deepspeed": error_of(lambda: trainer.accelerator.load_state(args.foreign)) if args.foreign else None,
    "clip_by_value": error_of(lambda: trainer.strategy.clip_gradients([], None, clip_value=1.0)),
}
ddp_door = Accelerator(strategy="ddp")
ddp_model = torch.nn.Linear(4, 1)
ddp_door.prepare(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1))
result["deepspeed_into_ddp"] = error_of(lambda: ddp_door.load_state(checkpoint))
conflicting = Accelerator(strategy=__import__("fabric_lite.strategies.deepspeed", fromlist=["x"]).DeepSpeedStrategy(
    stage=1, config={"train_micro_batch_size_per_gpu": 4}))
model = torch.nn.Linear(4, 1)
result["conflicting_batch"] = error_of(lambda: conflicting.prepare(
    model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8)))
# Accelerate's spelling: DeepSpeedPlugin, and save_model() of a ZeRO-3 model (gathered, the module's own keys)
plugin_door = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2,
                                                           gradient_clipping=1.0))
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
net, opt, loader = plugin_door.prepare(net, opt, DataLoader(data, batch_size=8))
for xb, yb in loader:
    with plugin_door.accumulate(net):
        plugin_door.backward(F.mse_loss(net(xb), yb))
        opt.step()
        opt.zero_grad()
plugin_door.save_model(net, f"{args.root}/exported")
from safetensors.torch import load_file  # noqa: E402

exported = load_file(f"{args.root}/exported/model.safetensors")
result["plugin"] = {
    "distributed_type": plugin_door.distributed_type, "stage": plugin_door.strategy.stage,
    "accumulation": plugin_door.gradient_accumulation_steps,
    "clipping": plugin_door.strategy.config["gradient_clipping"],
    "exported_keys": sorted(exported), "exported_numel": sum(t.numel() for t in exported.values()),
}
# the Trainer at ZeRO-3: get_state_dict gathers the TrainModule's weights under its own keys
module3 = Regression()
trainer3 = Trainer(max_epochs=1, strategy="deepspeed_stage_3", default_root_dir=f"{args.root}/z3",
                   enable_progress_bar=False)
trainer3.fit(module3, DataLoader(data, batch_size=16))
result["trainer_z3_keys"] = sorted(trainer3.accelerator.get_state_dict(trainer3.model))
# a checkpoint inside an accumulation window says what it cannot carry
mid = Accelerator(strategy="deepspeed_stage_2", gradient_accumulation_steps=2)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
net, opt, loader = mid.prepare(net, opt, DataLoader(data, batch_size=8))
xb, yb = next(iter(loader))
with mid.accumulate(net):
    mid.backward(F.mse_loss(net(xb), yb))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mid.save_state(f"{args.root}/mid-window")
result["mid_window_warnings"] = [str(w.message) for w in caught]
# prepare() again with a loader only (Accelerate scripts do); a second model is refused; a checkpoint of
# another model is refused even with strict=False (ZeRO restores its partitions by position)
extra = mid.prepare(DataLoader(data, batch_size=4))
result["second_prepare_batches"] = len(extra)
other = torch.nn.Linear(4, 2)
result["second_model"] = None
try:
    mid.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
except RuntimeError as err:
    result["second_model"] = str(err)
changed = Accelerator(strategy="deepspeed_stage_2")
wide = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Linear(1, 1))
changed.prepare(wide, torch.optim.SGD(wide.parameters(), lr=0.1), DataLoader(data, batch_size=8))
result["strict_false_other_model"] = error_of(lambda: changed.load_state(f"{args.root}/mid-window", strict=False))
write_result(args.out, 0, result)
