"""`fabric-lite tpu-config`: run setup commands on every worker of a Cloud TPU VM pod, before `fabric-lite launch`.

It builds one ``gcloud compute tpus tpu-vm ssh NAME --zone ZONE --command "..." --worker all`` call: the commands
(``--command``, repeatable, or the lines of ``--command_file``) run in ``/usr/share`` on each worker, after
``pip install`` of fabric-lite where ``--install_fabric_lite`` (Accelerate's ``--install_accelerate``) asks for it.
The TPU's name and zone and the commands default to the config file's ``tpu_name``, ``tpu_zone``, ``commands`` and
``command_file`` (keys of an Accelerate config file). ``--debug`` prints the command instead of running it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["tpu_command", "build_gcloud_command", "install_line", "PACKAGE"]

PACKAGE = "fabric-lite"


def install_line(version: str) -> str:
    """The pip command that installs fabric-lite on a worker: ``latest`` (the newest release), a version
    (``0.1.0``), or any requirement pip takes (``fabric-lite>=0.1``, a ``git+https://...`` URL, a path)."""
    version = version.strip()
    if version == "latest":
        return f"pip install -U {PACKAGE}"
    if version == "dev":
        raise ValueError("--fabric_lite_version dev: fabric-lite has no development channel to install from; pass "
                         "a requirement pip understands instead (a git+https:// URL or a path on the workers).")
    if re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(\.dev\d+)?", version):
        return f"pip install {PACKAGE}=={version}"
    return f"pip install {shlex.quote(version)}"


def _config_values(config_file: Optional[str], env: Mapping[str, str]) -> Dict[str, Any]:
    """The TPU keys of the config file in force (`config_file`, else fabric_lite's, else Accelerate's)."""
    import yaml

    from fabric_lite.launch.config_file import ConfigError, find_config

    path = find_config(config_file, env)
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; write one with `fabric-lite config`, or pass "
                          f"--tpu_name, --tpu_zone and --command.") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        return {}
    out = {key: data.get(key) for key in ("tpu_name", "tpu_zone", "command_file", "commands")}
    # older Accelerate files spell two of them with a tpu_ prefix
    out["command_file"] = out["command_file"] or data.get("tpu_command_file")
    out["commands"] = out["commands"] or data.get("tpu_commands")
    out["source"] = str(path)
    return out


def _read_commands(path: str) -> List[str]:
    """The command lines of a file; blank lines and ``#`` comments are left out (joined with ``;`` a comment would
    swallow every command after it)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read the command file {path}: {err.strerror or err}.") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def build_gcloud_command(tpu_name: Optional[str], tpu_zone: Optional[str], commands: List[str],
                         install: Optional[str] = None, use_alpha: bool = False) -> List[str]:
    """The argv of the gcloud call that runs `commands` (after `install`, a pip command, if given) in
    /usr/share on every worker of the TPU VM `tpu_name` in `tpu_zone`."""
    if not tpu_name:
        raise ValueError("no TPU name: pass --tpu_name NAME (or set tpu_name in the config file).")
    if not tpu_zone:
        raise ValueError("no TPU zone: pass --tpu_zone ZONE, e.g. us-central2-b (or set tpu_zone in the config "
                         "file).")
    if not commands:
        raise ValueError("nothing to run on the TPU workers: pass --command CMD (repeatable) or --command_file "
                         "PATH (or set commands / command_file in the config file).")
    remote = "; ".join(["cd /usr/share", *([install] if install else []), *commands])
    return ["gcloud", *(["alpha"] if use_alpha else []), "compute", "tpus", "tpu-vm", "ssh", tpu_name,
            "--zone", tpu_zone, "--command", remote, "--worker", "all"]


def tpu_command(args: List[str]) -> int:
    from fabric_lite.cli.parsing import CliParser

    parser = CliParser(
        prog="fabric-lite tpu-config",
        description="Run setup commands on every worker of a Cloud TPU VM pod through `gcloud compute tpus tpu-vm "
                    "ssh ... --worker all` (for example to install fabric-lite and your requirements before "
                    "`fabric-lite launch --tpu`). Defaults come from the config file's tpu_name, tpu_zone, commands "
                    "and command_file.")
    config = parser.add_argument_group("config arguments", "defaults read from the config file")
    config.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                        help="the config file (default: the one `fabric-lite launch` reads)")
    config.add_argument("--tpu-name", "--tpu_name", default=None, help="the TPU VM's name")
    config.add_argument("--tpu-zone", "--tpu_zone", default=None, help="the TPU VM's zone")
    pod = parser.add_argument_group("TPU arguments", "what runs on the workers")
    pod.add_argument("--command", "--tpu-command", "--tpu_command", dest="command", action="append", nargs="+",
                     default=None, help="a command to run on every worker (repeatable; in order)")
    pod.add_argument("--command-file", "--command_file", "--tpu-command-file", "--tpu_command_file",
                     dest="command_file", default=None, help="a file of commands, one a line")
    pod.add_argument("--install-fabric-lite", "--install_fabric_lite", "--install-accelerate",
                     "--install_accelerate", dest="install", action="store_true",
                     help="pip install fabric-lite on every worker first")
    pod.add_argument("--fabric-lite-version", "--fabric_lite_version", "--accelerate-version",
                     "--accelerate_version", dest="version", default="latest",
                     help="with --install_fabric_lite: latest (default), a version, or a pip requirement")
    pod.add_argument("--use-alpha", "--use_alpha", action="store_true", help="run `gcloud alpha ...`")
    pod.add_argument("--debug", action="store_true", help="print the gcloud command instead of running it")
    parsed = parser.parse_args(args)
    defaults = _config_values(parsed.config_file, os.environ)
    commands: List[str]
    if parsed.command_file:
        commands = _read_commands(parsed.command_file)
    elif parsed.command:
        commands = [" ".join(words) for words in parsed.command]
    elif defaults.get("command_file"):
        commands = _read_commands(str(defaults["command_file"]))
    else:
        listed = defaults.get("commands") or []
        commands = [listed] if isinstance(listed, str) else [str(c) for c in listed]
    cmd = build_gcloud_command(parsed.tpu_name or defaults.get("tpu_name"), parsed.tpu_zone or defaults.get("tpu_zone"),
                               commands, install_line(parsed.version) if parsed.install else None, parsed.use_alpha)
    if parsed.debug:
        print(f"Running {shlex.join(cmd)}")
        return 0
    if shutil.which("gcloud") is None:
        print("fabric-lite tpu-config: error: gcloud (the Google Cloud CLI) is not on PATH; install it "
              "(https://cloud.google.com/sdk/docs/install), or pass --debug to print the command instead.",
              file=sys.stderr)
        return 2
    code = subprocess.run(cmd).returncode
    if code != 0:
        print(f"fabric-lite tpu-config: error: gcloud exited with status {code}; the pod may be set up only in "
              f"part.", file=sys.stderr)
        return code
    print("Set up the pod: the commands ran on every worker.")
    return 0
