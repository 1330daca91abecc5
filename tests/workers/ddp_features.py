"""The DDP communication-hook checks (ddp_comm_hooks.py) and the LocalSGD checks (local_sgd_runs.py) in one
launch: starting processes costs seconds, the checks a fraction of one. The command line has the flags of both
Accelerate examples they are shaped like (by_feature/ddp_comm_hook.py and by_feature/local_sgd.py)."""

import argparse
import json
from pathlib import Path

import ddp_comm_hooks
import local_sgd_runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--ddp_comm_hook", type=str, default="no",
                        choices=["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"])
    parser.add_argument("--ddp_comm_wrapper", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--local_sgd_steps", type=int, default=8)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    hooks, accelerator = ddp_comm_hooks.run(args)
    result = {"hooks": hooks, "local_sgd": local_sgd_runs.run(args)}
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
