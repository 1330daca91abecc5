"""Run llama.one_by_one_mesh_against_plain_torch in a process of its own (its process group of one is started and
ended there) and write the result."""

from common import parse, write_result
from llama import one_by_one_mesh_against_plain_torch

args = parse({"--accelerator": {"default": "cpu"}})
diff, kinds = one_by_one_mesh_against_plain_torch(args.accelerator)
write_result(args.out, 0, {"diff": diff, "kinds": kinds})
