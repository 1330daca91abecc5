"""One of two runs that save into the same directory at once (`--mode explicit`: the same checkpoint name;
`auto`: automatic naming with total_limit, so both also prune). Reports every save's error, if any."""

import torch
from torch import nn

from common import parse, write_result
from fabric_lite import Accelerator
from fabric_lite.accelerator.configs import ProjectConfiguration

args = parse({"--dir": {"required": True}, "--mode": {"required": True}, "--rank": {"type": int, "required": True},
              "--saves": {"type": int, "default": 40}, "--background": {"action": "store_true"}})
torch.manual_seed(args.rank)
if args.mode == "auto":
    config = ProjectConfiguration(project_dir=args.dir, automatic_checkpoint_naming=True, total_limit=3)
    acc = Accelerator(project_config=config)
else:
    acc = Accelerator()
model = nn.Linear(128, 128)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
errors = []
for _ in range(args.saves):
    try:
        acc.save_state(None if args.mode == "auto" else f"{args.dir}/ckpt", blocking=not args.background)
        acc.wait_for_checkpoint()
    except Exception as err:  # noqa: BLE001 - reported to the test
        errors.append(f"{type(err).__name__}: {err}")
write_result(args.out, args.rank, {"errors": errors})
