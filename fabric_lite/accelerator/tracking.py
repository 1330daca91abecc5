"""Experiment trackers for the raw door: `Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv", "comet_ml",
"aim", "clearml", "dvclive", "swanlab", "trackio"])`, and the names Accelerate's `accelerate.tracking` has.

Each tracker's package is an extra (`pip install 'fabric-lite[mlflow]'`) imported only when the tracker starts,
so `import fabric_lite` stays fast and a missing package is named when it is needed, in one sentence. Trackers run
on the main process only (`Accelerator.init_trackers` starts none elsewhere).

The trackers live in tracker_mlflow.py, trackers_core.py, trackers_services.py and trackers_local.py, and what
they share (the base class, `on_main_process`, the helpers the Trainer's logger callbacks use too) in
tracker_base.py; this module gathers them, knows them by name and starts those `log_with` names.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from fabric_lite.accelerator.tracker_base import (  # noqa: F401  (names importers take from here)
    GeneralTracker, config_for_file, flatten, is_installed, is_number, on_main_process, require, scalar, warn_once,
)
from fabric_lite.accelerator.tracker_mlflow import (  # noqa: F401
    MLFLOW_MAX_METRICS_PER_BATCH, MLFLOW_MAX_PARAM_LENGTH, MLFLOW_MAX_PARAMS_PER_BATCH, MLflowTracker,
    mlflow_experiment_id, mlflow_key, mlflow_local_uri, mlflow_log_metrics, mlflow_log_params,
)
from fabric_lite.accelerator.trackers_core import CSVTracker, TensorBoardTracker, WandBTracker
from fabric_lite.accelerator.trackers_local import AimTracker, DVCLiveTracker
from fabric_lite.accelerator.trackers_services import ClearMLTracker, CometMLTracker, SwanLabTracker, TrackioTracker

__all__ = ["GeneralTracker", "on_main_process", "TensorBoardTracker", "MLflowTracker", "WandBTracker", "CSVTracker",
           "CometMLTracker", "AimTracker", "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker", "TrackioTracker",
           "KNOWN_TRACKERS", "LOGGER_TYPE_TO_CLASS", "available_trackers", "get_available_trackers", "make_trackers"]


KNOWN_TRACKERS = {cls.name: cls for cls in (TensorBoardTracker, MLflowTracker, WandBTracker, CSVTracker, CometMLTracker,
                                             AimTracker, ClearMLTracker, DVCLiveTracker, SwanLabTracker,
                                             TrackioTracker)}
LOGGER_TYPE_TO_CLASS = KNOWN_TRACKERS  # Accelerate's name for it


def available_trackers() -> List[str]:
    """The names `log_with="all"` starts: every tracker whose package is installed."""
    return [name for name, cls in KNOWN_TRACKERS.items() if cls.package is None or is_installed(cls.package)]


def get_available_trackers() -> List[str]:
    """Accelerate's name for `available_trackers`."""
    return available_trackers()


def make_trackers(
    log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]],
    run_name: str, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]],
) -> List[GeneralTracker]:
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, GeneralTracker)) else list(log_with)
    if "all" in items:
        items = [i for i in items if i != "all"] + available_trackers()
    trackers: List[GeneralTracker] = []
    started: Dict[str, GeneralTracker] = {}
    try:
        for item in items:
            if isinstance(item, GeneralTracker):
                trackers.append(item)
                continue
            name = str(item).lower()
            cls = KNOWN_TRACKERS.get(name)
            if cls is None:
                raise ValueError(f"Unknown tracker {item!r}. Allowed: {', '.join(KNOWN_TRACKERS)}, 'all', or a "
                                 f"GeneralTracker.")
            if name in started:  # ["tensorboard", "all"]: one of each
                continue
            if cls.requires_logging_directory and logging_dir is None:
                raise ValueError(
                    f"log_with={item!r} needs a directory: pass Accelerator(project_dir='runs/') or a "
                    f"ProjectConfiguration."
                )
            started[name] = cls(run_name, logging_dir=logging_dir, **init_kwargs.get(cls.name, {}))
            trackers.append(started[name])
    except BaseException:
        for tracker in started.values():  # those started here are not left open (an MLflow run, a wandb process)
            try:
                tracker.finish()
            except Exception:
                pass
        raise
    return trackers
