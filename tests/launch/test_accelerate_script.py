"""A script and its launch command written for Hugging Face Accelerate run with `accelerate` replaced by
`fabric-lite` / `fabric_lite`: the launch flags, the config file Accelerate's `accelerate config` writes,
and the script's own arguments (which look like launcher flags) all as they were."""

import json
import sys

import pytest

from conftest import WORKERS, free_port, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_process_ip: null
main_process_port: {port}
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.mark.parametrize("how", ["config-file", "flags"])
def test_an_accelerate_script_runs_with_its_launch_command(tmp_path, how):
    project = tmp_path / "project"
    if how == "config-file":
        config = tmp_path / "default_config.yaml"
        config.write_text(ACCELERATE_CONFIG.format(port=free_port()))
        launch = ["--config_file", str(config)]
    else:
        # (on a GPU machine Accelerate users add --multi_gpu; here: --cpu)
        launch = ["--cpu", "--num_processes=2", "--num_machines", "1", "--main_process_port", str(free_port())]
    # the script's own flags (--cpu, --mixed_precision, --num_epochs) are also launcher flags: they are the script's
    cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", *launch, str(WORKERS / "accelerate_style.py"),
           "--cpu", "--mixed_precision", "no", "--project_dir", str(project), "--num_epochs", "2"]
    proc = run_command(cmd, timeout=240, env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((project / "result.json").read_text())
    assert result["world"] == 2 and sorted(result["ranks"]) == [0, 1] and result["type"] == "MULTI_CPU"
    assert result["total"] == 32  # gather_for_metrics counted the evaluation set once
    assert result["args"]["num_epochs"] == 2 and result["args"]["cpu"] is True
    assert proc.stdout.count("epoch 1: accuracy") == 1  # accelerator.print: the main process only
    assert sorted(p.name for p in (project / "checkpoints").iterdir() if p.is_dir()) == ["checkpoint_0", "checkpoint_1"]
    assert (project / "final" / "model.safetensors").exists()
    assert list((project / "accelerate_style").glob("events.out.tfevents.*")) or \
        list(project.rglob("events.out.tfevents.*")), "no TensorBoard events written"
    if how == "config-file":
        assert f"using Accelerate config file {config}" in proc.stderr
