"""Real scheduler launches without torchrun: ranks read from OpenMPI's variables (skipped without mpirun)."""

import json
import shutil
import sys

import pytest

from conftest import WORKERS, free_port, run_command


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed "
                    "(apt-get install openmpi-bin)")
def test_mpirun_two_processes_without_a_launcher(tmp_path):
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = run_command(["mpirun", "-np", "2", "--oversubscribe", sys.executable, str(WORKERS / "cluster_gather.py"),
                        "--out", str(tmp_path)], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["world"] == 2 and res["local_rank"] == rank
        assert res["gathered"] == [0, 1]
        assert res["source"] == "OpenMPI (mpirun)"
