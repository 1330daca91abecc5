"""The self-check with a broken `Accelerator.reduce` on rank 0: its verdict must say FAIL and the run exit 1."""

import sys

from fabric_lite import Accelerator
from fabric_lite.cli import selftest

_reduce = Accelerator.reduce


def broken_reduce(self, tensor, *args, **kwargs):
    result = _reduce(self, tensor, *args, **kwargs)
    return result + 1 if self.process_index == 0 else result


Accelerator.reduce = broken_reduce
sys.exit(selftest.main())
