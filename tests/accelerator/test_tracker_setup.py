"""What `log_with="all"` asks of each installed tracker before starting it: can it start here as things are, or
does it need an account nobody set up (fabric_lite/trackers/setup.py), read from each service's own
variables and config files in an empty HOME; and what `make_trackers` does with the answer, with stand-in
trackers. tests/accelerator/test_more_trackers.py runs the real packages under "all"."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from fabric_lite.accelerator import tracking
from fabric_lite.accelerator.tracker_base import GeneralTracker
from fabric_lite.trackers.setup import (
    clearml_setup_missing, comet_setup_missing, nested_ini_values, swanlab_setup_missing, trackio_setup_missing,
    wandb_setup_missing,
)

SERVICE_PREFIXES = ("COMET_", "CLEARML_", "TRAINS_", "WANDB_", "SWANLAB_", "TRACKIO_", "NETRC", "HF_TOKEN",
                    "HUGGING_FACE_HUB_TOKEN", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty HOME and working directory, no service variables, no service package imported."""
    for name in list(os.environ):
        if name.startswith(SERVICE_PREFIXES):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for module in ("wandb", "clearml"):  # (an earlier test's run or task would count as set up)
        monkeypatch.delitem(sys.modules, module, raising=False)
    return home


def test_comet_reads_its_key_and_offline_switch_where_comet_does(home, monkeypatch):
    missing = comet_setup_missing({})
    assert missing.startswith("no API key") and "COMET_API_KEY" in missing and "COMET_START_ONLINE=false" in missing
    assert comet_setup_missing({"online": False}) is None and comet_setup_missing({"api_key": "k"}) is None
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    assert comet_setup_missing({}) is None
    assert comet_setup_missing({"online": True}) is not None  # the argument wins over the variable
    monkeypatch.delenv("COMET_START_ONLINE")

    (home / ".comet.config").write_text("[comet]\napi_key = abc\n")  # what `comet login` writes
    assert comet_setup_missing({}) is None
    (home / ".comet.config").write_text("[comet]\nworkspace = me\n  [[start]]\n  online = false\n")  # nested section
    assert nested_ini_values(str(home / ".comet.config")) == {"COMET_WORKSPACE": "me", "COMET_START_ONLINE": "false"}
    assert comet_setup_missing({}) is None
    monkeypatch.setenv("COMET_START_ONLINE", "true")  # the environment comes first
    assert comet_setup_missing({}) is not None
    monkeypatch.delenv("COMET_START_ONLINE")
    (home / ".comet.config").unlink()

    os.makedirs("conf")
    (home.parent / "work" / "conf" / ".comet.config").write_text("[comet]\napi_key = abc\n")
    monkeypatch.setenv("COMET_CONFIG", "conf")  # a folder: its .comet.config
    assert comet_setup_missing({}) is None
    monkeypatch.delenv("COMET_CONFIG")
    with open(".env", "w") as f:
        f.write("# keys\nexport COMET_API_KEY=abc\n")
    assert comet_setup_missing({}) is None
    os.remove(".env")
    with open(".comet.config", "w") as f:
        f.write("[comet_start]\nonline = 0\n")
    assert comet_setup_missing({}) is None


def test_wandb_reads_its_key_and_mode_where_wandb_does(home, monkeypatch):
    missing = wandb_setup_missing({})
    assert missing.startswith("not logged in") and "WANDB_API_KEY" in missing and "WANDB_MODE=offline" in missing
    for mode in ("offline", "disabled", "dryrun"):
        assert wandb_setup_missing({"mode": mode}) is None
    assert wandb_setup_missing({"settings": {"mode": "offline"}}) is None
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_setup_missing({}) is None
    assert wandb_setup_missing({"mode": "online"}) is not None  # the argument wins over the variable
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_setup_missing({}) is None
    monkeypatch.delenv("WANDB_API_KEY")

    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")  # `wandb login`
    assert wandb_setup_missing({}) is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a key for another server is not one
    assert wandb_setup_missing({}) is not None
    (home / "other_netrc").write_text("machine wandb.example.com login user password k\n")
    monkeypatch.setenv("NETRC", str(home / "other_netrc"))
    assert wandb_setup_missing({}) is None
    monkeypatch.delenv("NETRC")
    monkeypatch.delenv("WANDB_BASE_URL")
    (home / ".netrc").unlink()

    config_dir = home / ".config" / "wandb"
    config_dir.mkdir(parents=True)
    (config_dir / "settings").write_text("[default]\nmode = disabled\n")
    assert wandb_setup_missing({}) is None
    (config_dir / "settings").unlink()


def test_wandb_offline_command_is_read(home):
    """`wandb offline` (its own command) switches this folder offline; `wandb online` back."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    for command, expected_missing in (("offline", False), ("online", True)):
        subprocess.run([sys.executable, "-m", "wandb", command], env=env, check=True, capture_output=True, timeout=60)
        assert (wandb_setup_missing({}) is not None) is expected_missing, command


def test_clearml_reads_its_credentials_and_offline_switch(home, monkeypatch):
    missing = clearml_setup_missing({})
    assert missing.startswith("no credentials") and "clearml-init" in missing and "CLEARML_OFFLINE_MODE=1" in missing
    for name in ("CLEARML_OFFLINE_MODE", "TRAINS_OFFLINE_MODE"):
        monkeypatch.setenv(name, "1")
        assert clearml_setup_missing({}) is None
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "a")
    assert clearml_setup_missing({}) is not None  # both keys, or none
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "s")
    assert clearml_setup_missing({}) is None
    monkeypatch.delenv("CLEARML_API_ACCESS_KEY")
    monkeypatch.delenv("CLEARML_API_SECRET_KEY")

    (home / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")  # no credentials in it
    assert clearml_setup_missing({}) is not None
    (home / "clearml.conf").write_text('api {\n  credentials {"access_key": "A", "secret_key": "S"}\n}\n')
    assert clearml_setup_missing({}) is None
    (home / "other.conf").write_text("sdk {}\n")
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(home / "other.conf"))  # then the only file read
    assert clearml_setup_missing({}) is not None


def test_swanlab_and_trackio(home, monkeypatch):
    missing = swanlab_setup_missing({})
    assert missing.startswith("not logged in") and "SWANLAB_API_KEY" in missing and "SWANLAB_MODE=offline" in missing
    assert swanlab_setup_missing({"mode": "local"}) is None
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    assert swanlab_setup_missing({}) is None
    monkeypatch.delenv("SWANLAB_MODE")
    (home / ".swanlab").mkdir()
    (home / ".swanlab" / ".netrc").write_text("machine https://api.swanlab.cn/api login u password k\n")
    assert swanlab_setup_missing({}) is None

    assert trackio_setup_missing({}) is None  # local by default
    missing = trackio_setup_missing({"space_id": "me/runs"})
    assert "'me/runs'" in missing and "HF_TOKEN" in missing
    monkeypatch.setenv("TRACKIO_SPACE_ID", "me/runs")
    assert trackio_setup_missing({}) == missing
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    (home / "hf").mkdir()
    (home / "hf" / "token").write_text("hf_x")
    assert trackio_setup_missing({}) is None


# -- make_trackers with stand-in trackers --------------------------------------------------------------------

class _Local(GeneralTracker):
    name = "local"
    requires_logging_directory = True

    def __init__(self, run_name, logging_dir=None, **kwargs):
        self.logging_dir = logging_dir


class _Service(GeneralTracker):
    """Needs an account unless SERVICE_OFFLINE is set, as a hosted service's tracker."""
    name = "service"

    @classmethod
    def setup_missing(cls, init_kwargs):
        return None if os.environ.get("SERVICE_OFFLINE") or init_kwargs.get("key") else "no key: set SERVICE_KEY"

    def __init__(self, run_name, logging_dir=None, **kwargs):
        if not (os.environ.get("SERVICE_OFFLINE") or kwargs.get("key")):
            raise RuntimeError("Service needs a key\nsecond line")
        self.finished = False

    def finish(self):
        self.finished = True


class _Broken(GeneralTracker):
    name = "broken"

    def __init__(self, run_name, logging_dir=None, **kwargs):
        raise RuntimeError("disk full")


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.delenv("SERVICE_OFFLINE", raising=False)
    monkeypatch.setattr(tracking, "KNOWN_TRACKERS", {"local": _Local, "service": _Service})


def test_all_leaves_out_what_cannot_start_with_one_warning(stand_ins, tmp_path, monkeypatch):
    with pytest.warns(UserWarning) as caught:
        trackers = tracking.make_trackers("all", "run", None, {})
    assert trackers == []
    assert [str(w.message) for w in caught] == [
        "log_with='all' skips local (no directory: pass Accelerator(project_dir=...)); service (no key: set "
        "SERVICE_KEY). A tracker named in log_with is started anyway."]
    with pytest.warns(UserWarning, match=r"skips service \(no key: set SERVICE_KEY\)\. A tracker") as caught:
        trackers = tracking.make_trackers(["all"], "run", str(tmp_path), {})
    assert len(caught) == 1 and [t.name for t in trackers] == ["local"]

    with warnings.catch_warnings():  # set up: no warning, both start
        warnings.simplefilter("error")
        assert [t.name for t in tracking.make_trackers("all", "run", str(tmp_path), {"service": {"key": "k"}})] == \
            ["local", "service"]
        monkeypatch.setenv("SERVICE_OFFLINE", "1")
        assert [t.name for t in tracking.make_trackers("all", "run", str(tmp_path), {})] == ["local", "service"]


def test_a_named_tracker_is_started_anyway_and_fails_loudly(stand_ins, tmp_path, monkeypatch):
    for log_with in ("service", ["all", "service"], ["Service"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # named: not skipped, so no warning either
            with pytest.raises(ValueError) as err:
                tracking.make_trackers(log_with, "run", str(tmp_path), {})
        assert str(err.value) == ("log_with='service' could not start (no key: set SERVICE_KEY). service said: "
                                  "RuntimeError: Service needs a key")
        assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="needs a directory"):  # named without a project dir: an error, as before
        tracking.make_trackers("local", "run", None, {})

    # a failure setup_missing knows nothing about is the tracker's own error; what started before is finished
    monkeypatch.setattr(tracking, "KNOWN_TRACKERS", {"service": _Service, "broken": _Broken})
    monkeypatch.setenv("SERVICE_OFFLINE", "1")
    started = []
    monkeypatch.setattr(_Service, "finish", lambda self: started.append("finished"))
    with pytest.raises(RuntimeError, match="^disk full$"):
        tracking.make_trackers(["service", "broken"], "run", str(tmp_path), {})
    assert started == ["finished"]
