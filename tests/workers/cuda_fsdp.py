"""FSDP2 on one GPU (tests/test_cuda.py): CPUOffloadPolicy keeps the shards in CPU memory between uses,
bf16 compute, a sharded save_state/load_state round trip."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric_lite import Accelerator, FSDPStrategy

out = Path(sys.argv[sys.argv.index("--out") + 1])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


torch.manual_seed(0)
acc = Accelerator(strategy=FSDPStrategy(auto_wrap_policy={"Block"}, cpu_offload=True), mixed_precision="bf16")
model = nn.Sequential(nn.Linear(16, 64), Block(), Block(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 16, generator=g).to(acc.device), torch.randn(64, 4, generator=g).to(acc.device)
losses = []
for _ in range(20):
    loss = nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    losses.append(float(loss))
shard_devices = sorted({p.to_local().device.type for p in model.parameters()})
acc.save_state(str(out / "ckpt"))
before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(1.0)
acc.load_state(str(out / "ckpt"))
after = acc.get_state_dict(model)
result = {"device": str(acc.device), "shard_devices": shard_devices, "first_loss": losses[0], "last_loss": losses[-1],
          "master_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
          "restored_equal": all(torch.equal(before[k], after[k]) for k in before)}
(out / "rank0.json").write_text(json.dumps(result))
acc.end_training()
