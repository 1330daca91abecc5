"""`log_with="all"` on a machine where no tracker service is set up (run it with an empty HOME and no tracker
variables), under a network guard; then each name given on the command line, alone; then Comet with its
offline switch in its config file (~/.comet.config): what "all" decides from it, and what comet_ml does.

    python unconfigured_trackers.py OUT_DIR comet_ml,clearml,wandb

Writes OUT_DIR/result.json: {"all": {"started", "warnings"}, "named": {name: error or None},
"comet_file": {"missing", "archives"}, "network": [...]}.
"""

import glob
import json
import os
import sys
import warnings

import network_guard

network_guard.install()

from fabric_lite import Accelerator  # noqa: E402
from fabric_lite.accelerator.tracking import KNOWN_TRACKERS  # noqa: E402

OUT, NAMES = sys.argv[1], [name for name in sys.argv[2].split(",") if name]
result = {"named": {}}


def run_all(project_dir, init_kwargs=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(log_with="all", project_dir=project_dir)
        acc.init_trackers("proj", config={"lr": 0.1}, init_kwargs=init_kwargs or {})
        acc.log({"loss": 1.0}, step=0)
        started = [t.name for t in acc.trackers]
        acc.end_training()
    return {"started": started, "warnings": [str(w.message) for w in caught if "log_with=" in str(w.message)]}


result["all"] = run_all(os.path.join(OUT, "all"))

for name in NAMES:
    try:
        Accelerator(log_with=name, project_dir=os.path.join(OUT, name)).init_trackers("proj")
        result["named"][name] = None
    except Exception as err:
        result["named"][name] = f"{type(err).__name__}: {err}"

if "comet_ml" in NAMES:
    import comet_ml

    with open(os.path.expanduser("~/.comet.config"), "w") as f:
        f.write("[comet_start]\nonline = false\n")
    config = comet_ml.ExperimentConfig(log_code=False, log_git_metadata=False, log_git_patch=False,
                                       log_env_details=False, auto_metric_logging=False, auto_param_logging=False,
                                       auto_output_logging=False, display_summary_level=0)
    project = os.path.join(OUT, "comet_file")
    missing = KNOWN_TRACKERS["comet_ml"].setup_missing({})  # what "all" decides from the file
    acc = Accelerator(log_with="comet_ml", project_dir=project)  # and what comet_ml makes of it
    acc.init_trackers("proj", init_kwargs={"comet_ml": {"experiment_config": config}})
    acc.log({"loss": 1.0}, step=0)
    acc.end_training()
    result["comet_file"] = {"missing": missing, "archives": glob.glob(os.path.join(project, "comet_ml", "*.zip"))}

result["network"] = network_guard.attempts
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(result, f)
