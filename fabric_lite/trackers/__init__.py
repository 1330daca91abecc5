"""One backend per experiment-tracking service; the raw door's `log_with` trackers (accelerator/tracking.py)
and the Trainer's loggers (callbacks/loggers.py) are thin adapters over them.

  local.py       TensorBoardBackend, CSVBackend, DVCLiveBackend, AimBackend (local files, no account)
  mlflow_run.py  MLflowBackend (a server, or a SQLite store in a folder)
  services.py    WandbBackend, CometBackend, ClearMLBackend, SwanLabBackend, TrackioBackend
  setup.py       whether a hosted service can start here without an account (no network, no package import)
  base.py        lazy package imports with a one-sentence error; logged values made plain

A backend opens its run when it is made (TensorBoard's writer on first use), and knows nothing of processes
or doors: which process logs, and when, is the adapter's choice. Each service's package is imported only
when its backend opens.
"""

from fabric_lite.trackers.local import AimBackend, CSVBackend, DVCLiveBackend, TensorBoardBackend
from fabric_lite.trackers.mlflow_run import MLflowBackend
from fabric_lite.trackers.services import ClearMLBackend, CometBackend, SwanLabBackend, TrackioBackend, WandbBackend

__all__ = ["TensorBoardBackend", "CSVBackend", "MLflowBackend", "WandbBackend", "CometBackend", "ClearMLBackend",
           "SwanLabBackend", "TrackioBackend", "DVCLiveBackend", "AimBackend"]
