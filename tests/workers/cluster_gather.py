"""Started by mpirun/srun with no launcher: ranks come from the scheduler's variables."""

import argparse
import json
import os

import torch

from fabric_lite import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    acc = Accelerator()
    gathered = acc.gather(torch.tensor([acc.process_index]))
    result = {"rank": acc.process_index, "world": acc.num_processes, "gathered": gathered.tolist(),
              "source": acc.strategy.process.source, "local_rank": acc.local_process_index}
    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
