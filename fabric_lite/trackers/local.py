"""Backends that write local files: TensorBoard event files, a CSV of metrics, DVCLive's plain files and an Aim
repository. Each needs no account; its package is imported when it opens, and a missing one is named with the
extra to install (`who` says which front asked: ``"log_with='aim'"``, ``"TensorBoardLogger"``)."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Union

from fabric_lite.trackers.base import config_for_file, flatten, is_number, open_url, require, scalar, url_exists, \
    warn_once

__all__ = ["TensorBoardBackend", "CSVBackend", "DVCLiveBackend", "AimBackend"]

PathLike = Union[str, "os.PathLike[str]"]


class TensorBoardBackend:
    """Event files in `log_dir`, through torch's `SummaryWriter(log_dir, **writer_kwargs)`, opened on first use
    (and again after `close`)."""

    def __init__(self, log_dir: Optional[str], who: str, **writer_kwargs: Any) -> None:
        self.log_dir, self.who, self.writer_kwargs = log_dir, who, writer_kwargs
        self.opened: Any = None

    @property
    def writer(self) -> Any:
        if self.opened is None:
            require("tensorboard", self.who, "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.opened = SummaryWriter(self.log_dir, **self.writer_kwargs)
        return self.opened

    def log_config(self, tag: str, values: Any) -> None:
        """`values` as indented JSON in a text entry called `tag`."""
        self.writer.add_text(tag, "```\n" + json.dumps(values, indent=2, default=str) + "\n```")

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers (and one-element tensors) as scalars, strings as texts, dicts of numbers as grouped scalars."""
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

    def flush(self) -> None:
        if self.opened is not None:
            self.opened.flush()

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()
            self.opened = None


class CSVBackend:
    """`directory/metrics.csv`: a header of `step` and every name logged, one row per `log` (nested dicts
    flattened with '/'); `directory/hparams.yaml` for the configuration. `directory` is a path or any fsspec URL.
    With `strict` (the default), `log` refuses values other than numbers, one-element tensors and strings.

    Columns come in the order names first appear, or `step` then the names sorted (`sort_columns`). `resume`
    reads a file that is there already and adds to it. Rows are kept; `write_all` writes the file whole,
    `write_last` appends the newest row (when it brought no new column).
    """

    def __init__(self, directory: Optional[str], sort_columns: bool = False, resume: bool = False) -> None:
        self.directory = directory  # (may be set later, before the first write)
        self.sort_columns = sort_columns
        self.columns: List[str] = ["step"]
        self.rows: List[Dict[str, Any]] = []
        if resume and url_exists(self.metrics_file):
            with open_url(self.metrics_file, "r", newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)

    @property
    def metrics_file(self) -> str:
        return f"{str(self.directory).rstrip('/')}/metrics.csv"

    @property
    def hparams_file(self) -> str:
        return f"{str(self.directory).rstrip('/')}/hparams.yaml"

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, strict: bool = True) -> bool:
        """Add a row; whether it brought a new column. `strict`: refuse values other than numbers and strings."""
        row: Dict[str, Any] = {"step": "" if step is None else step}
        for key, value in flatten(values).items():
            value = scalar(value)
            if strict and not (is_number(value) or isinstance(value, str)):
                raise ValueError(f"Cannot log {key!r}={value!r} to CSV: pass a number, a one-element tensor, "
                                 f"a string or a dict of them.")
            row[key] = value
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if self.sort_columns:
            self.columns = ["step"] + sorted({*self.columns[1:], *new})
        else:
            self.columns += new
        return bool(new)

    def write_all(self) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(self.rows)
        with open_url(self.metrics_file, "w", newline="") as f:
            f.write(buffer.getvalue())

    def write_last(self) -> None:
        with open_url(self.metrics_file, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(self.rows[-1])

    def log_config(self, values: Any) -> None:
        import yaml

        with open_url(self.hparams_file, "w") as f:
            yaml.safe_dump(config_for_file(values), f, sort_keys=False)


class DVCLiveBackend:
    """A `dvclive.Live` run: `live` when given, else `Live(**kwargs)`, its files in `dir`, else
    `logging_dir/dvclive` when there is a logging directory, else DVCLive's default (`./dvclive`)."""

    def __init__(self, who: str, live: Optional[Any] = None, logging_dir: Optional[PathLike] = None,
                 **kwargs: Any) -> None:
        if live is None:
            require("dvclive", who, "dvclive")
            from dvclive import Live

            if logging_dir is not None and kwargs.get("dir") is None:
                kwargs["dir"] = os.path.join(os.fspath(logging_dir), "dvclive")
            live = Live(**kwargs)
        self.run = live
        self.warned: set = set()

    def log_config(self, values: Any) -> None:
        """`values` (nested dicts kept) in params.yaml."""
        self.run.log_params(config_for_file(values))

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers (nested dicts flattened with '/') as metrics at `step`, then on to the next step; other values
        are left out with a warning. `kwargs` go to `Live.log_metric`."""
        from dvclive.plots import Metric

        if step is not None:
            self.run.step = step
        for key, value in flatten(values).items():
            value = scalar(value)
            if Metric.could_log(value):
                self.run.log_metric(key, value, **kwargs)
            else:
                warn_once(self.warned, key, f"DVCLive logs numbers: {key}={value!r} is not logged.")
        self.run.next_step()

    def finish(self) -> None:
        self.run.end()


class AimBackend:
    """An `aim.Run(repo=repo, **kwargs)` named `run_name`; the configuration is its "hparams"."""

    def __init__(self, who: str, run_name: str, repo: str, **kwargs: Any) -> None:
        aim = require("aim", who, "aim")
        self.run = aim.Run(repo=repo, **kwargs)
        self.run.name = run_name

    def log_config(self, values: Any) -> None:
        self.run["hparams"] = config_for_file(values)

    def log(self, values: Mapping[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Each value tracked under its name at `step`; `kwargs` (`context=`, `epoch=`) go to `Run.track`."""
        for key, value in values.items():
            self.run.track(scalar(value), name=key, step=step, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: Optional[int] = None,
                   kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Each image (an array or PIL image, or an `(image, caption)` pair) at `step`; `kwargs={"aim_image":
        {...}, "track": {...}}` go to `aim.Image` and `Run.track`."""
        import aim

        image_kwargs = (kwargs or {}).get("aim_image", {})
        track_kwargs = (kwargs or {}).get("track", {})
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.run.track(aim.Image(image, caption=caption, **image_kwargs), name=key, step=step, **track_kwargs)

    def finish(self) -> None:
        self.run.close()
