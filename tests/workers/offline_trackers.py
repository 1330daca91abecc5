"""One Accelerator logging to the trackers named on the command line, offline, under a network guard.

    python offline_trackers.py OUT_DIR comet_ml,clearml,dvclive,...
    python offline_trackers.py OUT_DIR all

Logs the configuration and three steps of scalars, then ends training, and writes OUT_DIR/result.json: the
trackers started, what each says about where it wrote, the warnings `log_with="all"` gave, and every network
connection that was tried (none may be: any address but loopback and local sockets is refused and recorded).
"""

import json
import os
import sys
import warnings

import network_guard

network_guard.install()

import torch  # noqa: E402

from fabric_lite import Accelerator  # noqa: E402
from fabric_lite.accelerator.tracking import is_installed  # noqa: E402

OUT, NAMES = sys.argv[1], sys.argv[2].split(",")

init_kwargs = {
    # no repository scan or framework hooks (they take seconds to minutes under pytest and log nothing asked for)
    "clearml": {"task_name": "offline-run", "auto_connect_frameworks": {"detect_repository": False, "pytorch": False,
                                                                         "tensorboard": False, "matplotlib": False},
                "auto_resource_monitoring": False, "auto_connect_streams": False, "auto_connect_arg_parser": False},
    "comet_ml": {"experiment_config": None},
    "dvclive": {"report": None},
    "swanlab": {"experiment_name": "offline-run"},
    "trackio": {"name": "offline-run"},
    "aim": {"experiment": "offline"},
    "wandb": {"name": "offline-run"},
}
if ("comet_ml" in NAMES or NAMES == ["all"]) and is_installed("comet_ml"):
    import comet_ml

    init_kwargs["comet_ml"]["experiment_config"] = comet_ml.ExperimentConfig(
        name="offline-run", log_code=False, log_git_metadata=False, log_git_patch=False, log_env_details=False,
        log_env_gpu=False, log_env_cpu=False, log_env_host=False, log_env_network=False, log_env_disk=False,
        auto_metric_logging=False, auto_param_logging=False, auto_output_logging=False, auto_log_co2=False,
        display_summary_level=0)

log_with = "all" if NAMES == ["all"] else NAMES
acc = Accelerator(log_with=log_with, project_dir=os.path.join(OUT, "project"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acc.init_trackers("offline-proj", config={"lr": 0.1, "nested": {"a": 1}, "name": "tiny"},
                      init_kwargs=init_kwargs if log_with == "all" else {name: init_kwargs[name] for name in NAMES})
where = {}
for step, loss in enumerate([1.0, 0.5, 0.25]):
    acc.log({"loss": torch.tensor(loss), "eval_acc": 0.25 * step}, step=step)
tracker = {t.name: t for t in acc.trackers}
if "clearml" in tracker:
    where["clearml"] = tracker["clearml"].tracker.get_offline_mode_folder().as_posix()
if "swanlab" in tracker:
    where["swanlab"] = str(tracker["swanlab"].tracker.public.run_dir)
if "aim" in tracker:
    where["aim"] = tracker["aim"].tracker.hash
if "wandb" in tracker:
    where["wandb"] = tracker["wandb"].tracker.id
started = [t.name for t in acc.trackers]
acc.end_training()
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump({"started": started, "where": where, "network": network_guard.attempts,
               "all_warnings": [str(w.message) for w in caught if "log_with='all'" in str(w.message)]}, f)
