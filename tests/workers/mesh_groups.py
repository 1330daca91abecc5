"""The doors over a strategy whose device mesh has two dimensions ("dp" x "tp", 2 x 2 on 4 processes), as a
tensor-parallel strategy's would: data is sharded, metrics gathered and logged values reduced over the
data-parallel group only; `collectives.over(...)` runs in each dimension's own group."""

import torch
from torch.utils.data import DataLoader

from common import IndexDataset, parse, write_result
from fabric_lite import Accelerator
from fabric_lite.strategies.base import Mesh
from fabric_lite.strategies.ddp import DDPStrategy


class TwoDimensions(DDPStrategy):
    """DDP's process group and set-up under a 2 x 2 mesh: ranks 0,1 hold data shard 0, ranks 2,3 shard 1."""

    @property
    def device_mesh(self) -> Mesh:
        return Mesh(("dp", "tp"), (2, 2), (self.global_rank // 2, self.global_rank % 2))


args = parse()
acc = Accelerator(strategy=TwoDimensions())
rank = acc.process_index
res = {"dp": [acc.strategy.dp_size, acc.strategy.dp_rank]}
loader = acc.prepare(DataLoader(IndexDataset(10), batch_size=2))
seen, gathered = [], []
for x, idx in loader:
    seen += idx.tolist()
    gathered += acc.gather_for_metrics(idx).tolist()
res["seen"], res["gathered"] = seen, gathered
res["objects"] = acc.gather_for_metrics([f"r{rank}"], use_gather_object=True)
collectives = acc.strategy.collectives
res["world_sum"] = collectives.all_reduce(torch.tensor([float(rank)])).item()
res["dp_sum"] = collectives.over("dp").all_reduce(torch.tensor([float(rank)])).item()
res["tp_sum"] = collectives.over("tp").all_reduce(torch.tensor([float(rank)])).item()
res["tp_gather"] = collectives.over("tp").all_gather(torch.tensor([rank])).tolist()
res["dp_broadcast"] = collectives.over("dp").broadcast_object(f"from{rank}", src=1)
res["tp_broadcast"] = collectives.over("tp").broadcast(torch.tensor([rank]), src=0).tolist()
collectives.over("dp").barrier()
write_result(args.out, rank, res)
acc.end_training()
