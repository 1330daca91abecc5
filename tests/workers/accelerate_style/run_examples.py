"""All of Accelerate's example scripts rewritten here, one after the other in one process, each with an
Accelerator of its own (their end_training calls are made at the end, see shared.end_training), so that a
test starts Python and the process group once per launch: core.run_core (nlp / complete_nlp / checkpointing with its resumed runs /
tracking / multi_process_metrics / gradient_accumulation / early_stopping / cross_validation / autoregressive),
then by_feature's scripts. A script that raises is recorded as {"error": traceback} and the next one runs.
Each process writes rank<r>.json: {"rank", "world", "core": {...}, "<feature>": {...}}."""

import argparse
import os
import traceback

import torch.distributed as dist

from by_feature import FEATURES
from core import add_arguments, run_core
from shared import end_all, write_result


def guarded(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded for the test to show, the next script still runs
        return {"error": traceback.format_exc()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--features", nargs="*", default=list(FEATURES), choices=list(FEATURES))
    add_arguments(parser)
    args = parser.parse_args()
    result = {"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1))}
    result["core"] = guarded(run_core, args)
    for name in args.features:
        result[name] = guarded(FEATURES[name], args)
    end_all()
    assert not dist.is_initialized(), "the process group outlived end_training"
    write_result(args.out, result["rank"], result)


if __name__ == "__main__":
    main()
