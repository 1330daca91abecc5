"""`fabric-lite config update`, `fabric-lite estimate-memory` and `fabric-lite tpu-config` (Accelerate's
`accelerate config update`, `estimate-memory` and `tpu-config`), run in this process through `main`."""

import json
import sys
import textwrap

import pytest
import torch
import yaml
from torch import nn

from fabric_lite.cli.estimate import build_empty_model, format_bytes, memory_rows
from fabric_lite.cli.main import main
from fabric_lite.launch.config_file import AccelerateConfig, LaunchConfigFile, load_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """fabric_lite's config dir, HF_HOME (Accelerate's config, the Hub cache) under tmp_path; the Hub offline."""
    config, hf = tmp_path / "config", tmp_path / "hf"
    monkeypatch.setenv("FABRIC_LITE_CONFIG_DIR", str(config))
    monkeypatch.setenv("HF_HOME", str(hf))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return config, hf


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- config update ---------------------------------------------------------------------------------

def test_config_update_fills_in_the_keys_keeps_the_values_and_says_what_changed(dirs, capsys):
    config_dir, _ = dirs
    path = config_dir / "default_config.yaml"
    config_dir.mkdir()
    path.write_text("nproc_per_node: '2'\nmixed_precision: 16-mixed\nuse_cpu: true\n")
    code, out, err = run(capsys, "config", "update")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"Updated {path} (fabric_lite's format):"
    assert '  changed nproc_per_node: "2" -> 2' in lines and '  changed mixed_precision: "16-mixed" -> "fp16"' in lines
    assert '  added strategy: "auto"' in lines and "  added master_port: null" in lines
    assert not any("use_cpu" in line for line in lines)  # kept as it was: not a change
    written = yaml.safe_load(path.read_text())
    assert list(written) == list(LaunchConfigFile().to_dict())  # every current key, in order
    assert load_config(path) == LaunchConfigFile(nproc_per_node=2, mixed_precision="fp16", use_cpu=True)
    before = path.read_text()
    code, out, _ = run(capsys, "config", "update", "--config_file", path)
    assert code == 0 and out.strip() == f"{path} (fabric_lite's format) is up to date; nothing changed."
    assert path.read_text() == before


def test_config_update_brings_an_accelerate_file_up_to_date_in_its_own_format(dirs, capsys, tmp_path):
    _, hf = dirs
    path = hf / "accelerate" / "default_config.yaml"  # the file launch reads when fabric_lite has none
    path.parent.mkdir(parents=True)
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nfp16: true\ndynamo_backend: 'NO'\n"
                    "main_process_port: 29555\n")
    code, out, err = run(capsys, "config", "update")
    assert code == 0, err
    assert out.splitlines()[0] == f"Updated {path} (Accelerate's format):"
    assert '  renamed fp16: true -> mixed_precision: "fp16"' in out.splitlines()
    assert '  added rdzv_backend: "static"' in out.splitlines() and "  added debug: false" in out.splitlines()
    written = yaml.safe_load(path.read_text())
    assert "fp16" not in written and "dynamo_backend" not in written and "dynamo_config" not in written
    assert written["compute_environment"] == "LOCAL_MACHINE" and written["main_process_port"] == 29555
    config = load_config(path)
    assert isinstance(config, AccelerateConfig)
    assert (config.nproc_per_node, config.mixed_precision, config.use_cpu, config.master_port) == (2, "fp16", True, 29555)
    assert config.ignored == ()  # nothing left that the launcher would have to ignore
    # a JSON file stays JSON
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"distributed_type": "NO", "fp16": False}))
    assert run(capsys, "config", "update", "--config-file", old)[0] == 0
    data = json.loads(old.read_text())
    assert data["mixed_precision"] == "no" and data["num_processes"] == 1 and "fp16" not in data


def test_config_update_refuses_a_missing_or_bad_file_without_writing(dirs, capsys, tmp_path):
    config_dir, hf = dirs
    code, out, err = run(capsys, "config", "update")
    assert code == 2 and out == ""
    assert err.strip() == (f"fabric-lite config update: error: no config file to update: none at "
                           f"{config_dir / 'default_config.yaml'}, nor Accelerate's at "
                           f"{hf / 'accelerate' / 'default_config.yaml'}; write one with `fabric-lite config`.")
    missing = tmp_path / "nope.yaml"
    code, _, err = run(capsys, "config", "update", "--config_file", missing)
    assert code == 2 and f"config file {missing} does not exist" in err and "`fabric-lite config" in err
    assert not missing.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("nproc_per_node: 0\n")
    code, _, err = run(capsys, "config", "update", "--config_file", bad)
    assert code == 2 and "nproc_per_node=0 must be >= 1" in err and len(err.strip().splitlines()) == 1
    assert bad.read_text() == "nproc_per_node: 0\n"


# -- estimate-memory -------------------------------------------------------------------------------

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 256)
            self.down = nn.Linear(256, 64)

    class Net(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(500, 64)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(64)
            self.register_buffer("table", torch.zeros(32, 64, dtype=torch.float16))

    def build():
        return Net()

    def half():
        return Net().half()

    def not_a_model():
        return 3
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "est_models_under_test.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "est_models_under_test"
    sys.modules.pop("est_models_under_test", None)


def test_estimate_memory_of_a_factory_matches_the_real_model(dirs, factory, capsys):
    model = build_empty_model(f"{factory}:build")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated for the weights
    real = sys.modules[factory].build()
    total = 4 * (sum(p.numel() for p in real.parameters()) + real.table.numel())  # counted as float32
    block = 4 * sum(p.numel() for p in real.blocks[0].parameters())  # a no-split module is one layer
    assert block > 4 * real.embed.weight.numel()
    rows = memory_rows(model)
    assert rows == [("float32", block, total, 4 * total), ("float16", block / 2, total / 2, 2 * total),
                    ("int8", block / 4, total / 4, None), ("int4", block / 8, total / 8, None)]
    assert memory_rows(build_empty_model(f"{factory}:half")) == rows  # a half model is counted in float32 too
    code, out, err = run(capsys, "estimate-memory", f"{factory}:build", "--dtypes", "float32", "int4")
    assert code == 0, err
    lines = out.splitlines()
    assert f"Memory Usage for loading `{factory}:build`" in lines[1]
    assert [c.strip() for c in lines[3].strip("│").split("│")] == ["dtype", "Largest Layer", "Total Size",
                                                                  "Training using Adam"]
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in lines[5:7]]
    assert cells == [["float32", format_bytes(block), format_bytes(total), format_bytes(4 * total)],
                     ["int4", format_bytes(block / 8), format_bytes(total / 8), "N/A"]]
    assert len({len(line) for line in lines}) == 1  # a closed box
    assert format_bytes(1536) == "1.5 KB" and format_bytes(413.18 * 1024 ** 2 * 4) == "1.61 GB"


def test_estimate_memory_says_what_is_missing(dirs, factory, capsys, tmp_path):
    _, hf = dirs
    code, _, err = run(capsys, "estimate-memory", "someone/not-cached-model")
    assert code == 2 and "not in the Hugging Face cache" in err and "the Hub is offline" in err
    code, _, err = run(capsys, "estimate-memory", f"{factory}:not_a_model")
    assert code == 2 and "not_a_model() returned a int, not a torch.nn.Module" in err
    code, _, err = run(capsys, "estimate-memory", f"{factory}:missing")
    assert code == 2 and "has no 'missing'" in err
    # a Hub id whose config.json is in the cache is found there, offline; transformers builds it
    snapshot = hf / "hub" / "models--someone--tiny-bert" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 100, "hidden_size": 32,
                                                      "num_hidden_layers": 2, "num_attention_heads": 2,
                                                      "intermediate_size": 64}))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    try:
        import transformers  # noqa: F401
    except ImportError:
        code, _, err = run(capsys, "estimate-memory", "someone/tiny-bert")
        assert code == 2 and err.strip().endswith("needs transformers: pip install transformers")
        return
    model = build_empty_model("someone/tiny-bert")
    assert type(model).__name__ == "BertModel" and all(p.is_meta for p in model.parameters())


def test_estimate_memory_builds_a_timm_model_when_timm_is_installed(dirs, capsys):
    timm = pytest.importorskip("timm")
    model = build_empty_model("timm/resnet18.a1_in1k", library_name="timm")
    real = timm.create_model("resnet18", pretrained=False)
    size = sum(t.numel() * 4 for t in [*real.parameters(), *real.buffers()] if t.is_floating_point()) + \
        sum(t.numel() * t.element_size() for t in real.buffers() if not t.is_floating_point())
    assert memory_rows(model, ["float32"])[0][2] == size


# -- tpu-config ------------------------------------------------------------------------------------

def expected_gcloud(name, zone, remote, alpha=False):
    return ["gcloud", *(["alpha"] if alpha else []), "compute", "tpus", "tpu-vm", "ssh", name, "--zone", zone,
            "--command", remote, "--worker", "all"]


def test_tpu_config_debug_prints_the_command_from_flags_and_config(dirs, capsys, tmp_path):
    import shlex

    code, out, err = run(capsys, "tpu-config", "--tpu_name", "pod", "--tpu_zone", "us-central2-b", "--command",
                         "echo one", "--command", "echo", "two", "--install_accelerate", "--debug")
    assert code == 0, err
    assert out.strip() == "Running " + shlex.join(expected_gcloud(
        "pod", "us-central2-b", "cd /usr/share; pip install -U fabric-lite; echo one; echo two"))
    # the defaults from an Accelerate config file; a command file's comments and blank lines are left out
    commands = tmp_path / "setup.sh"
    commands.write_text("# set up\npip install -r requirements.txt\n\nexport A=1\n")
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump({"distributed_type": "XLA", "tpu_name": "cfg-pod", "tpu_zone": "europe-west4-a",
                                      "commands": ["echo from-config"]}))
    code, out, _ = run(capsys, "tpu-config", "--config_file", config, "--use_alpha", "--debug")
    assert code == 0
    assert out.strip() == "Running " + shlex.join(expected_gcloud("cfg-pod", "europe-west4-a",
                                                                  "cd /usr/share; echo from-config", alpha=True))
    code, out, _ = run(capsys, "tpu-config", "--config_file", config, "--tpu_name", "other", "--command_file",
                       commands, "--install_fabric_lite", "--fabric_lite_version", "0.1.0", "--debug")
    assert out.strip() == "Running " + shlex.join(expected_gcloud(
        "other", "europe-west4-a",
        "cd /usr/share; pip install fabric-lite==0.1.0; pip install -r requirements.txt; export A=1"))
    code, _, err = run(capsys, "tpu-config", "--tpu_name", "pod", "--tpu_zone", "z", "--debug")
    assert code == 2 and "nothing to run on the TPU workers: pass --command" in err


def test_tpu_config_runs_gcloud_on_every_worker(dirs, capsys, tmp_path, monkeypatch):
    bin_dir, record = tmp_path / "bin", tmp_path / "argv.json"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv))\n"
                      f"sys.exit(int(__import__('os').environ.get('FAKE_GCLOUD_STATUS', '0')))\n")
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    args = ["tpu-config", "--tpu_name", "pod", "--tpu_zone", "us-east1-d", "--command", "python -V"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    argv = json.loads(record.read_text())
    assert argv[1:] == expected_gcloud("pod", "us-east1-d", "cd /usr/share; python -V")[1:]
    assert "the commands ran on every worker" in out
    monkeypatch.setenv("FAKE_GCLOUD_STATUS", "3")
    code, _, err = run(capsys, *args)
    assert code == 3 and "gcloud exited with status 3" in err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and "gcloud (the Google Cloud CLI) is not on PATH" in err
