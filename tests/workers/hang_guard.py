"""Rank 1 skips a collective that rank 0 enters; rank 0 must fail within the timeout, naming rank 1."""

import argparse
import datetime
import json
import os
import time

import torch

from fabric_lite import Accelerator, InitProcessGroupKwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=4))])
    acc.reduce(torch.ones(1))
    acc.wait_for_everyone()
    result = {"error": None}
    if acc.process_index == 0:
        start = time.monotonic()
        try:
            acc.gather(torch.ones(2))  # rank 1 never calls it
        except Exception as err:  # reported, not raised: the test reads it
            result = {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    else:
        time.sleep(8)  # alive but elsewhere: the timeout, not a dropped connection, ends rank 0's wait
    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
