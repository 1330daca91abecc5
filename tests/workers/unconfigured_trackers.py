"""`log_with="all"` on a machine where no tracker service is set up (run it with an empty HOME and no tracker
variables), under a network guard; then each name given on the command line, alone; then "all" again with
the offline switch of Comet in its config file (~/.comet.config), as `comet` users keep it.

    python unconfigured_trackers.py OUT_DIR comet_ml,clearml,wandb

Writes OUT_DIR/result.json: {"all": {"started", "warnings"}, "named": {name: error or None},
"comet_file": {"started", "warnings", "archives"}, "network": [...]}.
"""

import glob
import json
import os
import sys
import warnings

import network_guard

network_guard.install()

from fabric_lite import Accelerator  # noqa: E402

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
    result["comet_file"] = run_all(project, {"comet_ml": {"experiment_config": config}})
    result["comet_file"]["archives"] = glob.glob(os.path.join(project, "comet_ml", "*.zip"))

result["network"] = network_guard.attempts
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(result, f)
