"""Two "nodes" on one machine: the multi-node launch, tried out before going to a cluster.

    python examples/two_nodes.py

On a real cluster you run one launcher per machine, each told the number of nodes, its own node rank and
where node 0 listens:

    fabric-lite launch --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 train.py
    fabric-lite launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 train.py

This file starts both launchers on this machine (node 0's address is 127.0.0.1), each running this file with
`--worker`: a small DDP model trained with the Accelerator (gloo on CPU). It waits for both and checks that
the two ranks end with the same weights, as DDP promises. Outputs go under runs/two_nodes.
"""

import argparse
import os
import socket
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric_lite import Accelerator, set_seed

OUT = "runs/two_nodes"


def worker() -> None:
    set_seed(0)
    accelerator = Accelerator()
    # Ranks and sizes come from the launchers' environment; nothing in the script names the nodes.
    print(f"rank {accelerator.process_index} of world size {accelerator.num_processes} "
          f"on node {accelerator.strategy.process.node_rank} (local rank {accelerator.local_process_index})", flush=True)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    # Each process gets its own half of every global batch of 2 x 16 samples.
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for _ in range(3):
        for inputs, targets in loader:
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)      # DDP averages the gradients over both nodes here
            optimizer.step()
            optimizer.zero_grad()
    # Each rank's loss is over its own half of the last batch. (`accelerator.print` would print once per
    # node, as in Accelerate: on the local main process of each machine.)
    print(f"rank {accelerator.process_index}: last loss {loss.item():.4f}", flush=True)

    os.makedirs(OUT, exist_ok=True)
    weights = accelerator.unwrap_model(model).state_dict()
    torch.save(weights, f"{OUT}/rank{accelerator.process_index}.pt")   # each rank's own copy, to compare
    accelerator.end_training()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="train (started by the launchers)")
    args = parser.parse_args()
    if args.worker:
        worker()
        return

    for rank in (0, 1):                          # no stale results from an earlier run
        if os.path.exists(f"{OUT}/rank{rank}.pt"):
            os.remove(f"{OUT}/rank{rank}.pt")
    port = free_port()                           # node 0 listens there; on a cluster, pick a fixed open port
    launchers = [
        subprocess.Popen([sys.executable, "-m", "fabric_lite.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                          "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          os.path.abspath(__file__), "--worker"])
        for node in (0, 1)
    ]
    try:
        statuses = [launcher.wait(timeout=120) for launcher in launchers]
    finally:  # one launcher failed to start, or a hang: do not leave the other one waiting for it
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    if statuses != [0, 0]:
        sys.exit(f"the launchers exited with {statuses}")

    rank0, rank1 = (torch.load(f"{OUT}/rank{r}.pt", weights_only=True) for r in (0, 1))
    same = all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    print(f"both ranks end with the same weights: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
