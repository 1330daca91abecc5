"""A worker that imports fabric_lite, says its pid, and sleeps (for tests that stop its launcher)."""

import os
import sys
import time

import fabric_lite  # noqa: F401 - importing it is what ties the worker to its launcher

print(f"worker pid {os.getpid()} up", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
