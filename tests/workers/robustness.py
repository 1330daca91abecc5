"""Failure paths on real processes: a save that fails on one rank, save from the main process only,
negative-dim padding, trigger_sync_in_backward, set_trigger/check_trigger."""

import datetime
import time

import torch
import torch.nn.functional as F

from common import make_model, parse, write_result
from fabric_lite import Accelerator, InitProcessGroupKwargs
from fabric_lite.checkpoint.files import CheckpointError

args = parse({"--ckpt": {}})
acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])
r = acc.process_index
res = {}
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)


class Flaky:
    fail = False

    def state_dict(self):
        if self.fail and r == 1:
            raise OSError("disk full (simulated on rank 1)")
        return {"ok": 1}

    def load_state_dict(self, state):
        pass


flaky = Flaky()
acc.register_for_checkpointing(flaky)
acc.save_state(args.ckpt)
before = [p.detach().clone() for p in model.parameters()]
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
flaky.fail = True
start = time.time()
try:
    acc.save_state(args.ckpt)
    res["save_error"] = None
except CheckpointError as err:
    res["save_error"] = str(err)
res["save_error_seconds"] = time.time() - start
flaky.fail = False
acc.load_state(args.ckpt)  # the first checkpoint is intact
res["previous_intact"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

# Accelerate idiom: save from the main process only (no collective inside save)
if acc.is_main_process:
    acc.save({"w": torch.ones(2)}, f"{args.ckpt}_single.pt")
res["after_main_only_save"] = acc.reduce(torch.tensor([1.0])).item()

padded = acc.pad_across_processes(torch.ones(2, 3 + 2 * r), dim=-1)
res["pad_neg_shape"] = list(padded.shape)

# trigger_sync_in_backward inside no_sync: gradients are all-reduced after all
x = torch.randn(4, 4) + r
with acc.no_sync(model):
    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 0]))
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss)
res["grad"] = acc.unwrap_model(model)[0].weight.grad.flatten()[:4].tolist()

if r == 1:
    acc.set_trigger()
res["trigger"] = acc.check_trigger()
res["trigger_again"] = acc.check_trigger()
write_result(args.out, r, res)
