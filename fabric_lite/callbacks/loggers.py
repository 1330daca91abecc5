"""Loggers are callbacks: TensorBoardLogger writes event files, CSVLogger a metrics.csv (rank 0 only)."""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from fabric_lite.callbacks.base import Callback

if TYPE_CHECKING:
    from fabric_lite.trainer.module import TrainModule
    from fabric_lite.trainer.trainer import Trainer

__all__ = ["TensorBoardLogger", "CSVLogger"]


def version_dir(root: str, name: str, version: Optional[int]) -> str:
    from fabric_lite.checkpoint import files as checkpoint_io

    base = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
    if version is None:
        fs, path = checkpoint_io.filesystem(base)
        existing = []
        if fs.exists(path):
            for entry in fs.ls(path, detail=False):
                tail = entry.rstrip("/").rsplit("/", 1)[-1]
                if tail.startswith("version_") and tail[8:].isdigit():
                    existing.append(int(tail[8:]))
        version = max(existing) + 1 if existing else 0
    return f"{base}/version_{version}"


class VersionedLogger(Callback):
    """A logger writing under save_dir/name/version_N, N chosen by rank 0 (the next free one)."""

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None) -> None:
        self.save_dir, self.name, self.version = os.fspath(save_dir), name, version
        self.log_dir: Optional[str] = None

    def setup(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self.log_dir is None:
            version = self.version
            if version is None and trainer.is_global_zero:
                version = int(version_dir(self.save_dir, self.name, None).rsplit("_", 1)[-1])
            self.log_dir = version_dir(self.save_dir, self.name, trainer.strategy.broadcast_object(version))


class TensorBoardLogger(VersionedLogger):
    """Scalars at every `log_every_n_steps` and epoch end, hyperparameters as text, under save_dir/name/version_N.

    With `log_graph=True`, the module's graph is traced once at fit start from `module.example_input_array`.
    """

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None, log_graph: bool = False,
                 **writer_kwargs: Any):
        super().__init__(save_dir, name, version)
        self.log_graph = log_graph
        self.writer_kwargs = writer_kwargs
        self._writer: Any = None
        self._graph_logged = False
        self._warned_no_example = False

    @property
    def writer(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("TensorBoardLogger needs tensorboard: pip install 'fabric-lite[tensorboard]'") from err
            self._writer = SummaryWriter(self.log_dir, **self.writer_kwargs)
        return self._writer

    def on_fit_start(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self.log_graph and trainer.is_global_zero and not self._graph_logged:
            self._add_graph(trainer, module)

    def _add_graph(self, trainer: "Trainer", module: "TrainModule") -> None:
        """Trace `module` on its example input, leaving its modes, gradients and the RNG streams as they were."""
        import torch

        example = getattr(module, "example_input_array", None)
        if example is None:
            if not self._warned_no_example:
                self._warned_no_example = True
                warnings.warn(
                    f"TensorBoardLogger(log_graph=True) has no input to trace {type(module).__name__} with; set "
                    f"`self.example_input_array` (a tensor or a tuple of tensors) in its __init__. No graph is "
                    f"written."
                )
            return
        if isinstance(example, torch.Tensor):
            args: Any = (example,)
        elif isinstance(example, (tuple, list)) and example and all(isinstance(t, torch.Tensor) for t in example):
            args = tuple(example)
        else:
            raise TypeError(
                f"{type(module).__name__}.example_input_array must be a tensor or a tuple of tensors to log the "
                f"graph, got {type(example).__name__}."
            )
        device = module.device
        args = trainer.strategy.precision.convert_input(tuple(t.to(device) for t in args))
        modes = [(m, m.training) for m in module.modules()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"`torch\.jit\.trace", category=DeprecationWarning)
                self.writer.add_graph(module, args)
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)
            for m, training in modes:
                m.training = training
        self.writer.flush()
        self._graph_logged = True

    def on_log(self, trainer: "Trainer", metrics: Dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, global_step=step)

    def on_hyperparameters(self, trainer: "Trainer", params: Dict[str, Any]) -> None:
        if trainer.is_global_zero and params:
            self.writer.add_text("hparams", "```\n" + json.dumps(params, indent=2, default=str) + "\n```")

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        if self._writer is not None:
            self._writer.flush()

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVLogger(VersionedLogger):
    """Rows of `step` plus every metric logged at that step, in save_dir/name/version_N/metrics.csv."""

    def __init__(self, save_dir: str = "runs", name: str = "", version: Optional[int] = None):
        super().__init__(save_dir, name, version)
        self.rows: List[Dict[str, Any]] = []

    def on_log(self, trainer: "Trainer", metrics: Dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            self.rows.append({"step": step, **metrics})

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainModule") -> None:
        self._write(trainer)

    def teardown(self, trainer: "Trainer", module: "TrainModule", stage: str) -> None:
        self._write(trainer)

    def _write(self, trainer: "Trainer") -> None:
        if not trainer.is_global_zero or not self.rows:
            return
        from fabric_lite.checkpoint import files as checkpoint_io

        columns = ["step"] + sorted({k for row in self.rows for k in row if k != "step"})
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(self.rows)
        fs, path = checkpoint_io.filesystem(self.log_dir)
        fs.makedirs(path, exist_ok=True)
        with fs.open(f"{path}/metrics.csv", "w") as f:
            f.write(buffer.getvalue())
