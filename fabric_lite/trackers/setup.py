"""Whether a tracker that reports to a hosted service can start here as it is, decided from the configuration
each service documents (environment variables, its config files, `init_kwargs`), without the network and
without importing the service's package.

The raw door's `log_with="all"` asks this of every installed tracker and skips, with one warning, those that
would stop for an account nobody set up (an API key, a login) and have no offline mode switched on; a tracker
named in `log_with` is started whatever this says, and when it fails the error says what is missing.

Each `*_setup_missing(init_kwargs)` returns None when the tracker can start, else what is missing and how to
enable it, in a few words: the variable or login for online use, and the switch for offline use.

  comet_ml  api_key=, COMET_API_KEY (environment, ./.env, COMET_CONFIG, ./.comet.config, ~/.comet.config);
            offline: online=False or COMET_START_ONLINE=false (the same places)
  wandb     WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the netrc entry `wandb login` writes (NETRC, ~/.netrc)
            for WANDB_BASE_URL's host, an api_key in its settings files; offline or disabled:
            mode=, WANDB_MODE, or `wandb offline` (the mode in ./wandb/settings or
            WANDB_CONFIG_DIR/settings, ~/.config/wandb/settings)
  clearml   CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY, CLEARML_AUTH_TOKEN, the credentials in the
            config file `clearml-init` writes (CLEARML_CONFIG_FILE, else ~/clearml.conf); offline:
            CLEARML_OFFLINE_MODE=1 (or `Task.set_offline(True)` before); a task the script started is used
  swanlab   SWANLAB_API_KEY, the key file `swanlab login` writes (.netrc in SWANLAB_ROOT / SWANLAB_SAVE_DIR,
            ~/.swanlab or ./.swanlab); offline: mode= or SWANLAB_MODE offline, local or disabled
  trackio   local unless space_id= or TRACKIO_SPACE_ID names a Space, which needs a Hugging Face token
            (HF_TOKEN, or the file `hf auth login` writes)
MLflow, TensorBoard, CSV, DVCLive and Aim need no account: they write local files.
"""

from __future__ import annotations

import configparser
import netrc
import os
import sys
from typing import Any, Dict, Iterable, Mapping, Optional
from urllib.parse import urlsplit

__all__ = ["comet_setup_missing", "wandb_setup_missing", "clearml_setup_missing", "swanlab_setup_missing",
           "trackio_setup_missing", "env_flag", "netrc_password", "nested_ini_values"]

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


# -- reading configuration ----------------------------------------------------------------------------

def env_flag(value: Optional[str]) -> Optional[bool]:
    """"1"/"true"/"yes"/"on" -> True, "0"/"false"/"no"/"off" -> False, anything else (or None) -> None."""
    if value is None:
        return None
    text = str(value).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def _as_bool(value: Any) -> Optional[bool]:
    return value if isinstance(value, bool) else env_flag(value)


def netrc_password(path: str, host: str) -> Optional[str]:
    """The password of `host` (or of the `default` entry) in the netrc file `path`; None when there is none
    or the file cannot be read."""
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry and entry[2] else None


def nested_ini_values(path: str) -> Dict[str, str]:
    """The values of an INI file whose sections may nest (`[comet]`, `[[start]]`, the configobj format), each
    under its section names and key joined by '_' in capitals (`[comet] api_key` -> COMET_API_KEY); {} when
    the file is missing or unreadable."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    sections: list = []
    values: Dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            depth = len(line) - len(line.lstrip("["))
            name = line.strip("[] \t")
            sections = sections[:depth - 1] + [name]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        full = "_".join(sections + [key.strip()]).upper()
        values.setdefault(full, value.strip().strip("'\""))
    return values


def _dotenv_values(path: str) -> Dict[str, str]:
    """KEY=VALUE lines of a `.env` file (comments and `export ` allowed)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    values: Dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            values.setdefault(key.strip(), value.strip().strip("'\""))
    return values


def _first(sources: Iterable[Mapping[str, str]], name: str) -> Optional[str]:
    for source in sources:
        value = source.get(name)
        if value not in (None, ""):
            return value
    return None


def _setting(settings: Any, name: str) -> Any:
    """`settings.name` or `settings[name]` (a settings object or a dict), or None."""
    if isinstance(settings, Mapping):
        return settings.get(name)
    return getattr(settings, name, None)


# -- Comet --------------------------------------------------------------------------------------------

def _comet_sources() -> list:
    """Where comet_ml reads its settings, first one first: the environment, ./.env, the COMET_CONFIG file
    (or folder), ./.comet.config, ~/.comet.config."""
    sources: list = [os.environ, _dotenv_values(".env")]
    chosen = os.environ.get("COMET_INI") or os.environ.get("COMET_CONFIG")
    if chosen:
        chosen = os.path.expanduser(chosen)
        sources.append(nested_ini_values(os.path.join(chosen, ".comet.config") if os.path.isdir(chosen) else chosen))
    sources += [nested_ini_values(".comet.config"), nested_ini_values("~/.comet.config")]
    return sources


def comet_setup_missing(init_kwargs: Mapping[str, Any]) -> Optional[str]:
    online = init_kwargs.get("online")
    sources = None
    if online is None:
        sources = _comet_sources()
        online = _as_bool(_first(sources, "COMET_START_ONLINE"))
    if online is False:
        return None
    if init_kwargs.get("api_key") or _first(sources or _comet_sources(), "COMET_API_KEY"):
        return None
    return "no API key: set COMET_API_KEY or run `comet login`, or COMET_START_ONLINE=false to log offline"


# -- Weights & Biases ---------------------------------------------------------------------------------

_WANDB_OFFLINE = ("offline", "dryrun", "disabled")


def _wandb_settings_files() -> list:
    """The values of wandb's settings files, workspace first: WANDB_DIR (or .)/wandb/settings (or .wandb),
    then WANDB_CONFIG_DIR/settings (or ~/.config/wandb/settings)."""
    root = os.environ.get("WANDB_DIR") or "."
    paths = [os.path.join(root, ".wandb", "settings"), os.path.join(root, "wandb", "settings"),
             os.path.join(os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb"), "settings")]
    found = []
    for path in paths:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_section("default"):
            found.append(dict(parser.items("default")))
    return found


def _wandb_netrc_key(base_url: str) -> Optional[str]:
    host = urlsplit(base_url).netloc or base_url
    chosen = os.environ.get("NETRC")
    paths = [os.path.expanduser(chosen)] if chosen else [os.path.expanduser("~/.netrc"),
                                                         os.path.expanduser("~/_netrc")]
    for path in paths:
        if os.path.isfile(path):
            return netrc_password(path, host)
    return None


def wandb_setup_missing(init_kwargs: Mapping[str, Any]) -> Optional[str]:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:  # the script started a run itself
        return None
    settings = init_kwargs.get("settings")
    files = _wandb_settings_files()
    mode = init_kwargs.get("mode")
    if mode is None and settings is not None:  # a wandb.Settings counts only a mode it was given
        given = getattr(settings, "model_fields_set", None)
        if isinstance(settings, Mapping) or given is None or "mode" in given:
            mode = _setting(settings, "mode")
    mode = mode or os.environ.get("WANDB_MODE") or _first(files, "mode")
    if str(mode or "").lower() in _WANDB_OFFLINE:
        return None
    if _setting(settings, "api_key") or os.environ.get("WANDB_API_KEY") or \
            os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _first(files, "api_key"):
        return None
    base_url = os.environ.get("WANDB_BASE_URL") or _first(files, "base_url") or "https://api.wandb.ai"
    if _wandb_netrc_key(base_url):
        return None
    return "not logged in: set WANDB_API_KEY or run `wandb login`, or WANDB_MODE=offline to log offline"


# -- ClearML ------------------------------------------------------------------------------------------

def _clearml_config_file() -> Optional[str]:
    chosen = os.environ.get("CLEARML_CONFIG_FILE") or os.environ.get("TRAINS_CONFIG_FILE")
    candidates = [chosen] if chosen else ["~/trains.conf", "~/clearml.conf"]
    for path in candidates:
        path = os.path.expanduser(os.path.expandvars(path))
        if os.path.isfile(path):
            return path
    return None


def clearml_setup_missing(init_kwargs: Mapping[str, Any]) -> Optional[str]:
    env = os.environ
    if env_flag(env.get("CLEARML_OFFLINE_MODE") or env.get("TRAINS_OFFLINE_MODE")):
        return None
    clearml = sys.modules.get("clearml")
    if clearml is not None:  # already imported: offline switched on, or a task started, in this process
        try:
            if clearml.Task.is_offline() or clearml.Task.current_task() is not None:
                return None
        except Exception:
            pass
    if env.get("CLEARML_AUTH_TOKEN") or env_flag(env.get("CLEARML_IGNORE_MISSING_CONFIG")):
        return None
    if (env.get("CLEARML_API_ACCESS_KEY") or env.get("TRAINS_API_ACCESS_KEY")) and \
            (env.get("CLEARML_API_SECRET_KEY") or env.get("TRAINS_API_SECRET_KEY")):
        return None
    if env_flag(env.get("CLEARML_NO_DEFAULT_SERVER") or env.get("TRAINS_NO_DEFAULT_SERVER")) is False:
        return None  # the public demo server, with its own key
    path = _clearml_config_file()
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                if "access_key" in f.read():
                    return None
        except (OSError, UnicodeDecodeError):
            pass
    return ("no credentials: run `clearml-init` or set CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY, or "
            "CLEARML_OFFLINE_MODE=1 to log offline")


# -- SwanLab ------------------------------------------------------------------------------------------

def swanlab_setup_missing(init_kwargs: Mapping[str, Any]) -> Optional[str]:
    mode = init_kwargs.get("mode") or os.environ.get("SWANLAB_MODE")
    if str(mode or "").lower() in ("offline", "local", "disabled"):
        return None
    if init_kwargs.get("api_key") or os.environ.get("SWANLAB_API_KEY"):
        return None
    folders = [os.environ.get("SWANLAB_ROOT"), os.environ.get("SWANLAB_SAVE_DIR"), "~/.swanlab", ".swanlab"]
    for folder in folders:
        if folder:
            path = os.path.join(os.path.expanduser(folder), ".netrc")
            try:
                if os.path.isfile(path) and netrc.netrc(path).hosts:
                    return None
            except (OSError, netrc.NetrcParseError):
                pass
    return "not logged in: set SWANLAB_API_KEY or run `swanlab login`, or SWANLAB_MODE=offline to log offline"


# -- Trackio ------------------------------------------------------------------------------------------

def trackio_setup_missing(init_kwargs: Mapping[str, Any]) -> Optional[str]:
    space = init_kwargs.get("space_id") or os.environ.get("TRACKIO_SPACE_ID")
    if not space:
        return None  # local: a SQLite database in TRACKIO_DIR
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    token_file = os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")
    if os.path.isfile(os.path.expanduser(token_file)):
        return None
    return (f"no Hugging Face token for the Space {space!r}: set HF_TOKEN or run `hf auth login`, or leave "
            f"space_id and TRACKIO_SPACE_ID unset to log locally")
