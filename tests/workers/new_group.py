"""One process starts, ends and starts again its run several times (an Accelerator, end_training, another
Accelerator), as a notebook or a script running several trainings does; each new process group must come up."""

import torch

from common import parse, write_result
from fabric_lite import Accelerator

args = parse()
sums = []
for generation in range(4):
    acc = Accelerator()
    rank = acc.process_index
    sums.append(acc.reduce(torch.tensor([float(rank + 1 + generation)])).item())
    acc.end_training()
write_result(args.out, rank, {"sums": sums})
