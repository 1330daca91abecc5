"""`XLAProfiler` (`Trainer(profiler="xla")`): torch_xla's profiler server and trace annotations, for TPU runs.

Where torch_xla is installed, each Trainer action is a named trace range (the steps as step traces) and a
profiler server listens on `port`, from which TensorBoard's profile plugin captures a trace while training runs.
Without torch_xla it is refused when built.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Optional

from fabric_lite.trainer.profiler import Profiler
from fabric_lite.utils.refusals import NotSupportedError, message

__all__ = ["XLAProfiler"]

_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class XLAProfiler(Profiler):
    """torch_xla's profiler: `port` is where its server listens for TensorBoard's capture."""

    def __init__(self, port: int = 9012) -> None:
        if importlib.util.find_spec("torch_xla") is None:
            raise NotSupportedError(message(
                "XLAProfiler", "profiling XLA devices (TPU) with torch_xla's profiler server",
                "it needs torch_xla, which is not installed here: install torch_xla on the TPU host, or profile CPU "
                "and GPU runs with profiler='pytorch' (PyTorchProfiler)"))
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"XLAProfiler(port={port!r}): pass a TCP port number, 1 to 65535.")
        super().__init__()
        self.port = port
        self.server: Any = None
        self.open: Dict[str, List[Any]] = {}

    def setup(self, stage: str, rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        super().setup(stage, rank, log_dir)
        if self.server is None:
            import torch_xla.debug.profiler as xp

            self.server = xp.start_server(self.port)

    def start(self, action: str) -> None:
        import torch_xla.debug.profiler as xp

        trace = xp.StepTrace(action) if action.endswith(_STEPS) else xp.Trace(action)
        trace.__enter__()
        self.open.setdefault(action, []).append(trace)

    def stop(self, action: str) -> None:
        stack = self.open.get(action)
        if not stack:
            raise ValueError(f"XLAProfiler.stop({action!r}): that action was not started.")
        stack.pop().__exit__(None, None, None)

    def summary(self) -> str:
        return ""  # (the trace is captured from the server, by TensorBoard's profile plugin)
