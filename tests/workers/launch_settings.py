"""Report what the Accelerator read from the launcher; check the refusals that need real processes."""


from common import parse, write_result
from fabric_lite import Accelerator
from fabric_lite.strategies import SingleDeviceStrategy

args = parse()
acc = Accelerator()
result = {"mixed_precision": acc.mixed_precision, "accum": acc.gradient_accumulation_steps,
          "device": str(acc.device), "world": acc.num_processes}
try:
    Accelerator(strategy=SingleDeviceStrategy())
    result["single_error"] = None
except RuntimeError as err:
    result["single_error"] = str(err)
try:
    Accelerator(devices=acc.num_processes + 1)
    result["devices_error"] = None
except ValueError as err:
    result["devices_error"] = str(err)
# two Accelerators in one process keep their own settings
other = Accelerator(mixed_precision="no", gradient_accumulation_steps=1)
result["other"] = [other.mixed_precision, other.gradient_accumulation_steps, acc.mixed_precision]
write_result(args.out, acc.process_index, result)
