"""Experiment trackers for the raw door: `Accelerator(log_with=["tensorboard", "mlflow", "wandb", "csv", "comet_ml",
"aim", "clearml", "dvclive", "swanlab", "trackio"])`, and the names Accelerate's `accelerate.tracking` has.

Each tracker's package is an extra (`pip install 'fabric-lite[mlflow]'`) imported only when the tracker starts,
so `import fabric_lite` stays fast and a missing package is named when it is needed, in one sentence. Trackers run
on the main process only (`Accelerator.init_trackers` starts none elsewhere).

The trackers live in tracker_mlflow.py, trackers_core.py, trackers_services.py and trackers_local.py, and what
they share (the base class, `on_main_process`, the helpers the Trainer's logger callbacks use too) in
tracker_base.py; this module gathers them, knows them by name and starts those `log_with` names.

`log_with="all"` starts the installed trackers that can start here as things are: one that would need an
account nobody set up (no API key or login, and no offline mode switched on; tracker_setup.py decides, from
the environment and config files) or a project directory that was not given is left out, and one warning
names each with what it needs. A tracker named in `log_with` is started anyway, and fails loudly.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

from fabric_lite.accelerator.tracker_base import GeneralTracker, is_installed, on_main_process
from fabric_lite.accelerator.tracker_mlflow import MLflowTracker
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
    """Every tracker whose package is installed (what `log_with="all"` tries; it skips those `setup_missing`
    says lack an account here)."""
    return [name for name, cls in KNOWN_TRACKERS.items() if cls.package is None or is_installed(cls.package)]


def get_available_trackers() -> List[str]:
    """Accelerate's name for `available_trackers`."""
    return available_trackers()


def make_trackers(
    log_with: Union[None, str, GeneralTracker, Sequence[Union[str, GeneralTracker]]],
    run_name: str, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]],
) -> List[GeneralTracker]:
    """The trackers `log_with` names, started.

    A name given in `log_with` is started whatever it lacks: an error of its package comes with what
    `setup_missing` says is missing. `"all"` adds every installed tracker that can start here as things are,
    and names the others in one warning with what each needs: a project directory, or an account (an API key,
    a login) for a service where no offline mode is switched on.
    """
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, GeneralTracker)) else list(log_with)
    named = {str(i).lower() for i in items if isinstance(i, str) and i != "all"}
    skipped: List[str] = []
    if "all" in items:
        items = [i for i in items if i != "all"]
        for name in available_trackers():
            reason = None if name in named else _cannot_start(KNOWN_TRACKERS[name], logging_dir, init_kwargs)
            if reason is None:
                items.append(name)
            else:
                skipped.append(f"{name} ({reason})")
    if skipped:
        warnings.warn(f"log_with='all' skips {'; '.join(skipped)}. A tracker named in log_with is started anyway.",
                      UserWarning, stacklevel=3)
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
            started[name] = _start(cls, run_name, logging_dir, init_kwargs.get(cls.name, {}))
            trackers.append(started[name])
    except BaseException:
        for tracker in started.values():  # those started here are not left open (an MLflow run, a wandb process)
            try:
                tracker.finish()
            except Exception:
                pass
        raise
    return trackers


def _cannot_start(cls: type, logging_dir: Optional[str], init_kwargs: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why `log_with="all"` leaves `cls` out here, or None."""
    if cls.requires_logging_directory and logging_dir is None:
        return "no directory: pass Accelerator(project_dir=...)"
    return cls.setup_missing(init_kwargs.get(cls.name, {}))


def _start(cls: type, run_name: str, logging_dir: Optional[str], kwargs: Dict[str, Any]) -> GeneralTracker:
    """`cls` started; when its package refuses and `setup_missing` knows why, the error says what to set."""
    try:
        return cls(run_name, logging_dir=logging_dir, **kwargs)
    except ImportError:
        raise
    except Exception as err:
        missing = cls.setup_missing(kwargs)
        if missing is None:
            raise
        said = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"log_with={cls.name!r} could not start ({missing}). {cls.name} said: "
                         f"{type(err).__name__}: {said}") from err
