"""The TensorBoard, Weights & Biases and CSV trackers (`log_with="tensorboard"`, `"wandb"`, `"csv"`)."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List, Optional, Union

from fabric_lite.accelerator.tracker_base import GeneralTracker, config_for_file, flatten, is_number, require, scalar
from fabric_lite.accelerator.tracker_setup import wandb_setup_missing

__all__ = ["TensorBoardTracker", "WandBTracker", "CSVTracker"]


class TensorBoardTracker(GeneralTracker):
    """Write scalars, texts and the run configuration to TensorBoard event files under `logging_dir/run_name`."""

    name = "tensorboard"
    requires_logging_directory = True
    package = "tensorboard"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        require("tensorboard", "log_with='tensorboard'", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=2, default=str) + "\n```")
        self.writer.flush()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = scalar(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                raise ValueError(
                    f"Cannot log {key!r}={value!r} to TensorBoard: pass a number, a one-element tensor, "
                    f"a string or a dict of numbers."
                )
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    """A Weights & Biases run in the project named by `init_trackers(project_name)`.

    `init_kwargs={"wandb": {...}}` go to `wandb.init` (`name`, `entity`, `tags`, `mode="offline"`, ...); its
    files go under the logging directory (`dir=`) when there is one. Offline: WANDB_MODE=offline or
    `mode="offline"`. `tracker` is the `wandb` run.
    """

    name = "wandb"
    package = "wandb"

    @classmethod
    def setup_missing(cls, init_kwargs: Dict[str, Any]) -> Optional[str]:
        """An API key (WANDB_API_KEY, `wandb login`) unless offline (WANDB_MODE=offline, `mode="offline"`)."""
        return wandb_setup_missing(init_kwargs)

    def __init__(self, run_name: str, logging_dir: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> None:
        wandb = require("wandb", "log_with='wandb'", "wandb")
        if logging_dir is not None and kwargs.get("dir") is None:
            os.makedirs(logging_dir, exist_ok=True)
            kwargs["dir"] = os.fspath(logging_dir)
        self.run_name = run_name
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.run.config.update(config_for_file(values), allow_val_change=True)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log({key: scalar(value) for key, value in values.items()}, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class CSVTracker(GeneralTracker):
    """Rows of `step` plus the values logged at it in `logging_dir/run_name/metrics.csv`; the configuration in
    `hparams.yaml` beside it.

    The file is written as values come (a new column rewrites it with the wider header); one that is there
    already (a resumed run) is read first and added to.
    """

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike]) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.metrics_file = os.path.join(self.logging_dir, "metrics.csv")
        self.hparams_file = os.path.join(self.logging_dir, "hparams.yaml")
        self.columns: List[str] = ["step"]
        self.rows: List[Dict[str, Any]] = []
        if os.path.exists(self.metrics_file):
            with open(self.metrics_file, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        import yaml

        with open(self.hparams_file, "w") as f:
            yaml.safe_dump(config_for_file(values), f, sort_keys=False)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        row: Dict[str, Any] = {"step": "" if step is None else step}
        for key, value in flatten(values).items():
            value = scalar(value)
            if not (is_number(value) or isinstance(value, str)):
                raise ValueError(f"Cannot log {key!r}={value!r} to CSV: pass a number, a one-element tensor, "
                                 f"a string or a dict of them.")
            row[key] = value
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns += new
            self._write(self.rows, "w")
        else:
            self._write([row], "a")

    def _write(self, rows: List[Dict[str, Any]], mode: str) -> None:
        with open(self.metrics_file, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def finish(self) -> None:
        pass
