"""`fabric-lite config update`: bring a config file up to date.

The file is the one `fabric-lite launch` would read (`--config-file`, else fabric_lite's default file, else
Accelerate's). It is rewritten with every key the current version knows, each key the user set keeping its
value (normalized: `16-mixed` becomes `fp16`), and the command prints what changed. A fabric_lite file gets
fabric_lite's keys; an Accelerate file stays in Accelerate's format (so `accelerate` still reads it) and gets
the keys Accelerate writes, its older spellings (``fp16: true``, ``dynamo_backend``) turned into the current
ones. Nothing is written when nothing changes, nor when the result could not be launched (the error says why).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["update_config_file", "update_command", "ACCELERATE_DEFAULTS"]

# The top-level keys Accelerate's `config` writes for a local machine, with the value an absent key means.
# (num_processes has no default here: Accelerate's -1, "not said", is not a count a launch can use.)
ACCELERATE_DEFAULTS: Dict[str, Any] = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "NO",
    "mixed_precision": "no",
    "use_cpu": False,
    "debug": False,
    "machine_rank": 0,
    "num_machines": 1,
    "rdzv_backend": "static",
    "same_network": False,
    "main_training_function": "main",
    "enable_cpu_affinity": False,
    "downcast_bf16": False,
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
}


def _read(path: Path) -> Dict[str, Any]:
    """The raw mapping of a YAML (or JSON) config file; ConfigError for anything else."""
    import yaml

    from fabric_lite.launch.config_file import ConfigError, parse_config

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        parse_config(text, str(path))  # raises the launcher's one-line message (line, column, problem)
        raise
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values (key: value lines), "
                          f"not a {type(data).__name__}.")
    return data


def _updated_fabric_lite(raw: Mapping[str, Any], source: str) -> Dict[str, Any]:
    from fabric_lite.launch.config_file import validate

    return validate(raw, source).to_dict()  # every key, in the class's order; ConfigError names a bad one


def _updated_accelerate(raw: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """(the mapping with Accelerate's current keys, {old key: the line saying what it became})."""
    out = dict(raw)
    notes: Dict[str, str] = {}
    if "fp16" in out:  # Accelerate's first spelling of mixed precision
        fp16 = out.pop("fp16")
        if "mixed_precision" not in out:
            out["mixed_precision"] = "fp16" if fp16 in (True, "true", "yes", 1) else "no"
        notes["fp16"] = f"fp16: {_show(fp16)} -> mixed_precision: {_show(out['mixed_precision'])}"
    if "dynamo_backend" in out:  # now a section of its own
        backend = out.pop("dynamo_backend")
        section = dict(out.get("dynamo_config") or {})
        if str(backend).strip().upper() not in ("NO", "NONE", ""):
            section.setdefault("dynamo_backend", backend)
        if section:
            out["dynamo_config"] = section
        notes["dynamo_backend"] = f"dynamo_backend: {_show(backend)} -> dynamo_config: {_show(section)}"
    if out.get("mixed_precision") is False or ("mixed_precision" in out and out["mixed_precision"] is None):
        out["mixed_precision"] = "no"  # YAML 1.1 reads a bare `no` as false
    for key, value in ACCELERATE_DEFAULTS.items():
        out.setdefault(key, value)
    if "num_processes" not in out and str(out["distributed_type"]).strip().upper() == "NO":
        out["num_processes"] = 1
    return out, notes


def _changes(before: Mapping[str, Any], after: Mapping[str, Any], renamed: Mapping[str, str]) -> List[str]:
    """What turned `before` into `after`, one line each; `renamed`: {old key: the line saying what it became}."""
    lines = [f"renamed {note}" for note in renamed.values()]
    for key, value in after.items():
        if key not in before:
            if not any(note.split(" -> ", 1)[1].startswith(f"{key}:") for note in renamed.values()):
                lines.append(f"added {key}: {_show(value)}")
        elif before[key] != value:
            lines.append(f"changed {key}: {_show(before[key])} -> {_show(value)}")
    lines += [f"removed {key}" for key in before if key not in after and key not in renamed]
    return lines


def _show(value: Any) -> str:
    """A value as the file spells it (JSON, which YAML reads too): true, null, "fp16", {"a": 1}."""
    return json.dumps(value, default=str)


def _write(path: Path, data: Mapping[str, Any], text: Optional[str] = None) -> None:
    """Atomically: a half-written config would break every later launch."""
    import yaml

    if text is None:
        text = (json.dumps(dict(data), indent=2) + "\n" if path.suffix == ".json"
                else yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def update_config_file(config_file: Optional[str], env: Mapping[str, str]) -> Tuple[Path, str, List[str]]:
    """Update the config file `fabric-lite launch` would read (`config_file` if given): (its path, "fabric_lite"
    or "Accelerate", what changed, one line each; empty: the file was already up to date and is left alone)."""
    from fabric_lite.launch.config_file import (
        ConfigError, accelerate_config_path, default_config_path, dump_config, find_config,
        is_accelerate_config, parse_accelerate_config, validate,
    )

    path = find_config(config_file, env)
    if path is None:
        raise ConfigError(f"no config file to update: none at {default_config_path(env)}, nor Accelerate's at "
                          f"{accelerate_config_path(env)}; write one with `fabric-lite config`.")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; write one with `fabric-lite config` "
                          f"(or `fabric-lite config --config-file {path}`).")
    raw = _read(path)
    if is_accelerate_config(raw):
        kind = "Accelerate"
        updated, notes = _updated_accelerate(raw)
        try:
            parse_accelerate_config(updated, str(path))  # what the launcher will make of it
        except ConfigError as err:
            raise ConfigError(f"{err}; nothing was written.") from None
        text = None
    else:
        kind = "fabric_lite"
        updated, notes = _updated_fabric_lite(raw, str(path)), {}
        text = None if path.suffix == ".json" else dump_config(validate(updated))
    changes = _changes(raw, updated, notes)
    if changes:
        _write(path, updated, text)
    return path, kind, changes


def update_command(args: List[str]) -> int:
    from fabric_lite.cli.parsing import CliParser
    from fabric_lite.launch.config_file import ConfigError

    parser = CliParser(
        prog="fabric-lite config update",
        description="Bring an existing config file up to date: rewrite it with every key this version knows, "
                    "keeping your values, and print what changed. The file is the one `fabric-lite launch` reads: "
                    "--config-file, else fabric_lite's default file, else Accelerate's default_config.yaml (which "
                    "stays in Accelerate's format). Nothing is written when nothing changes.")
    parser.add_argument("--config-file", "--config_file", default=None, metavar="PATH",
                        help="the file to update (default: the one `fabric-lite launch` reads)")
    parsed = parser.parse_args(args)
    try:
        path, kind, changes = update_config_file(parsed.config_file, os.environ)
    except ConfigError as err:
        print(f"fabric-lite config update: error: {err}", file=sys.stderr)
        return 2
    if not changes:
        print(f"{path} ({kind}'s format) is up to date; nothing changed.")
        return 0
    print(f"Updated {path} ({kind}'s format):")
    for line in changes:
        print(f"  {line}")
    return 0
