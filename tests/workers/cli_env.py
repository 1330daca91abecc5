"""Report what `fabric-lite launch` handed this worker: the launch variables and the Accelerator's reading."""

import json
import os
from pathlib import Path

from common import parse
from fabric_lite import Accelerator

args = parse()
acc = Accelerator()
names = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT", "FABRIC_LITE_MIXED_PRECISION",
         "FABRIC_LITE_GRADIENT_ACCUMULATION_STEPS", "FABRIC_LITE_USE_CPU", "FABRIC_LITE_STRATEGY")
result = {"env": {name: os.environ.get(name) for name in names},
          "mixed_precision": acc.mixed_precision, "accum": acc.gradient_accumulation_steps,
          "device": str(acc.device), "world": acc.num_processes}
Path(args.out, f"rank{acc.process_index}.json").write_text(json.dumps(result))
