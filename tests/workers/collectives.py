"""Every collective and process-control name of the Accelerator, on real processes."""

import os
import time

import torch

from common import make_model, parse, write_result
from fabric_lite import Accelerator

args = parse()
acc = Accelerator()
r, w = acc.process_index, acc.num_processes
res = {"num_processes": w, "process_index": r, "local_process_index": acc.local_process_index,
       "is_main_process": acc.is_main_process, "is_local_main_process": acc.is_local_main_process,
       "is_last_process": acc.is_last_process, "distributed_type": acc.distributed_type,
       "device": str(acc.device)}
# gather: rank r contributes r+1 rows (different first dimensions on purpose)
res["gather"] = acc.gather(torch.full((r + 1, 2), float(r))).tolist()
res["gather_scalar"] = acc.gather(torch.tensor(r)).tolist()
res["gather_nested"] = {k: v.tolist() for k, v in acc.gather({"a": torch.tensor([r]), "b": torch.tensor([r * 10])}).items()}
res["gather_object"] = acc.gather_object([f"rank{r}"])
res["reduce_sum"] = acc.reduce(torch.tensor([float(r + 1)])).tolist()
res["reduce_mean"] = acc.reduce(torch.tensor([float(r + 1)]), reduction="mean").tolist()
padded = acc.pad_across_processes(torch.ones(r + 1, 3), dim=0, pad_index=-1)
res["pad"] = padded.tolist()
res["pad_first"] = acc.pad_across_processes(torch.ones(2, r + 1), dim=1, pad_first=True).tolist()
res["broadcast"] = acc.broadcast(torch.tensor([float(r), 5.0]), from_process=w - 1).tolist()
with acc.split_between_processes(list(range(7))) as part:
    res["split"] = part
with acc.split_between_processes(list(range(7)), apply_padding=True) as part:
    res["split_padded"] = part
with acc.split_between_processes({"a": list(range(5)), "b": torch.arange(5)}) as part:
    res["split_dict"] = {"a": part["a"], "b": part["b"].tolist()}

# main_process_first: the main process finishes its block before the others start theirs.
marker = os.path.join(args.out, "marker")
with acc.main_process_first():
    if acc.is_main_process:
        time.sleep(0.5)
        open(marker, "w").write("main was here")
    else:
        res["marker_seen"] = os.path.exists(marker)
acc.wait_for_everyone()

# prepared scheduler: steps once per process per optimizer step (Accelerate's rule without split_batches)
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model, opt, sched = acc.prepare(model, opt, sched)
model(torch.randn(2, 4)).sum().backward()
opt.step()
sched.step()
res["scheduler_last_epoch"] = sched.last_epoch
res["lr_after_one_step"] = sched.get_last_lr()[0]
res["model_type"] = type(model).__name__
res["unwrapped_type"] = type(acc.unwrap_model(model)).__name__

# accelerator.print prints on the local main process only
acc.print(f"PRINTED-BY-RANK-{r}")
acc.end_training()
write_result(args.out, r, res)
