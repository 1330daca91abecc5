"""One Accelerator logging to the trackers named on the command line, offline, under a network guard.

    python offline_trackers.py OUT_DIR comet_ml,clearml,dvclive,...

Logs the configuration and three steps of scalars, then ends training, and writes OUT_DIR/result.json: the
trackers started, what each says about where it wrote, and every network connection that was tried (none may
be: any address but loopback and local sockets is refused and recorded).
"""

import ipaddress
import json
import os
import socket
import sys

OUT, NAMES = sys.argv[1], sys.argv[2].split(",")
attempts = []


def _local(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX
        return True
    host = address[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo


def connect(self, address):
    if not _local(address):
        attempts.append(repr(address))
        raise OSError(f"network refused in this test: {address!r}")
    return _connect(self, address)


def connect_ex(self, address):
    if not _local(address):
        attempts.append(repr(address))
        return 111
    return _connect_ex(self, address)


def getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name not in (None, "localhost") and not _local((name, 0)):
        attempts.append(f"resolve {name}")
        raise socket.gaierror(f"network refused in this test: {name}")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo

import torch  # noqa: E402

from fabric_lite import Accelerator  # noqa: E402

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
}
if "comet_ml" in NAMES:
    import comet_ml

    init_kwargs["comet_ml"]["experiment_config"] = comet_ml.ExperimentConfig(
        name="offline-run", log_code=False, log_git_metadata=False, log_git_patch=False, log_env_details=False,
        log_env_gpu=False, log_env_cpu=False, log_env_host=False, log_env_network=False, log_env_disk=False,
        auto_metric_logging=False, auto_param_logging=False, auto_output_logging=False, auto_log_co2=False,
        display_summary_level=0)

acc = Accelerator(log_with=NAMES, project_dir=os.path.join(OUT, "project"))
acc.init_trackers("offline-proj", config={"lr": 0.1, "nested": {"a": 1}, "name": "tiny"},
                  init_kwargs={name: init_kwargs[name] for name in NAMES})
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
started = [t.name for t in acc.trackers]
acc.end_training()
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump({"started": started, "where": where, "network": attempts}, f)
