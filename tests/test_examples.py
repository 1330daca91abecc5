"""Every example in examples/ runs as its docstring says and prints what it promises, so none can rot.

Each runs as a subprocess with a timeout (conftest's `run_command`), in a temporary working directory (the
examples write under relative paths such as runs/...), with the smallest arguments that still show the point.
The notebook is executed top to bottom with nbclient. Examples whose engine is missing here are skipped
(DeepSpeed, Ray, torch_xla); the XLA example's own test is tests/xla/test_xla_example.py (`make test-xla`).
`test_every_example_has_a_test` fails when a file is added to examples/ without a test named after it.
"""

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, free_port, run_command

EXAMPLES = ROOT / "examples"
# Where the examples' tests live: `test_<example name>...` functions in these files.
TEST_FILES = (Path(__file__), ROOT / "tests" / "xla" / "test_xla_example.py")


def run_example(cwd, name, *args, launch=None, timeout=120):
    """Run examples/`name` from `cwd` (plainly, or under `fabric-lite launch` with the flags in `launch`);
    assert it exited 0 and return its stdout."""
    script = str(EXAMPLES / name)
    if launch is None:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "fabric_lite.cli", "launch", *launch, "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), script, *args]
    proc = run_command(cmd, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n" \
                                 f"STDERR:\n{proc.stderr[-6000:]}"
    return proc.stdout


def floats_after(label, text):
    return [float(v) for v in re.findall(rf"{re.escape(label)}\s*([0-9.]+)", text)]


def event_files(directory):
    return sorted(Path(directory).rglob("events.out.tfevents.*"))


# -- one process ------------------------------------------------------------------------------------------

def test_dict_batches(tmp_path):
    out = run_example(tmp_path, "dict_batches.py", "--epochs", "3")
    assert len(floats_after("last batch loss", out)) == 3
    accuracy = floats_after("eval accuracy", out)
    assert len(accuracy) == 1 and accuracy[0] >= 0.9, out
    assert "over 250 samples" in out  # gather_for_metrics counted every evaluation sample once


def test_accumulation_precision(tmp_path):
    out = run_example(tmp_path, "accumulation_precision.py", "--epochs", "2")
    assert "accumulated weights equal the 4x batch's within 1e-5: True" in out, out
    difference = re.search(r"max \|weight difference\| accumulated vs 4x batch: (\S+)", out)
    assert difference is not None and float(difference.group(1)) <= 1e-5, out
    fp32 = [float(v) for v in re.findall(r"^fp32, batch .*:\s+loss ([0-9.]+)$", out, re.M)]
    assert len(fp32) == 2 and abs(fp32[0] - fp32[1]) < 1e-4, out
    bf16 = re.search(r"^bf16 mixed precision, batch 8 x 4 accumulated: loss ([0-9.]+)", out, re.M)
    assert bf16 is not None and abs(float(bf16.group(1)) - fp32[0]) < 0.1, out  # near fp32, not equal


def test_migration_digits(tmp_path):
    out = run_example(tmp_path, "migration_digits.py", "--epochs", "1", "--project-dir", "runs/digits")
    assert re.search(r"epoch 0: loss [0-9.]+  valid accuracy [0-9.]+ \(297 samples\)", out), out
    assert event_files(tmp_path / "runs" / "digits"), "no TensorBoard event file under runs/digits"


def test_trainer_digits(tmp_path):
    out = run_example(tmp_path, "trainer_digits.py", "--epochs", "1", "--root", "runs/trainer_digits")
    assert re.search(r"val/acc [0-9.]+ after \d+ steps; best checkpoint: ", out), out
    logs = tmp_path / "runs" / "trainer_digits" / "logs"
    assert event_files(logs), "no TensorBoard event file under runs/trainer_digits/logs"


# -- processes: killed and resumed, two nodes, a notebook -------------------------------------------------

@pytest.mark.slow
def test_resume_after_kill(tmp_path):
    out = run_example(tmp_path, "resume_after_kill.py", timeout=180)
    assert "driver: the worker reported step 55: SIGKILL" in out, out
    # from the newest checkpoint (one every 10 steps; the worker may have gone on a little before the kill landed),
    # in the middle of the second epoch (40 steps each)
    resumed_at = int(re.search(r"worker: training from step (\d+) \(epoch 1\)", out).group(1))
    assert resumed_at % 10 == 0 and 50 <= resumed_at < 80, out
    assert "resumed run equals the uninterrupted run: True" in out, out


@pytest.mark.slow
def test_two_nodes(tmp_path):
    out = run_example(tmp_path, "two_nodes.py", timeout=180)
    assert "rank 0 of world size 2 on node 0" in out, out
    assert "rank 1 of world size 2 on node 1" in out, out
    assert "both ranks end with the same weights: True" in out, out


@pytest.mark.slow
def test_notebook_launcher(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for name, value in {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}.items():
        monkeypatch.setenv(name, value)  # the kernel inherits this environment: gloo on CPUs, one thread each
    for name in ("JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        (tmp_path / "jupyter" / name.lower()).mkdir(parents=True)   # nothing read from or left in $HOME
        monkeypatch.setenv(name, str(tmp_path / "jupyter" / name.lower()))
    notebook = nbformat.read(EXAMPLES / "notebook_launcher.ipynb", as_version=4)
    # The kernel "python3" must be this interpreter's (ipykernel installed here), not one found elsewhere.
    notebook.cells.insert(0, nbformat.v4.new_code_cell("import sys; print('kernel prefix', sys.prefix)"))
    client = nbclient.NotebookClient(notebook, timeout=150, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell's traceback, if any cell fails
    out = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                  for output in cell.get("outputs", []) if output.get("output_type") == "stream")
    assert f"kernel prefix {sys.prefix}" in out, out
    assert "rank 0 of world size 2" in out, out
    assert "both ranks end with the same weights: True" in out, out
    losses = [float(v) for v in re.search(r"mean loss per epoch: (.*)", out).group(1).split(", ")]
    assert len(losses) == 4 and losses[-1] < losses[0], out


# -- strategies with engines of their own -----------------------------------------------------------------

def _has_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_fsdp2(), reason="needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)")
def test_fsdp2_example(tmp_path):
    out = run_example(tmp_path, "fsdp2_example.py", "--epochs", "2", launch=["--nproc-per-node", "2", "--cpu"],
                      timeout=180)
    held = [tuple(map(int, m)) for m in re.findall(r"rank \d/2: holds (\d+) of the model's (\d+)", out)]
    assert len(held) == 2 and all(2 * part == whole for part, whole in held), out  # each keeps half
    losses = floats_after("mean loss", out)
    assert len(losses) == 2 and losses[-1] < losses[0], out
    assert (tmp_path / "runs/fsdp2/checkpoint/manifest.json").exists()
    shards = sorted(p.name for p in (tmp_path / "runs/fsdp2/checkpoint").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file of shards per process
    assert (tmp_path / "runs/fsdp2/model/model.safetensors").exists()


@pytest.mark.slow
def test_deepspeed_example(tmp_path):
    pytest.importorskip("deepspeed", reason="needs DeepSpeed: pip install 'fabric-lite[deepspeed]'")
    # (the first DeepSpeed run on a machine compiles a C++ extension: up to 2 minutes on 2 cores)
    out = run_example(tmp_path, "deepspeed_example.py", "--epochs", "2", launch=["--nproc-per-node", "2", "--cpu"],
                      timeout=300)
    assert "ZeRO stage 2 on 2 process(es), device cpu" in out, out
    losses = floats_after("mean loss", out)
    assert len(losses) == 2 and losses[-1] < losses[0], out
    assert (tmp_path / "runs/deepspeed/checkpoint/manifest.json").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_ray_example(tmp_path):
    pytest.importorskip("ray.tune", reason="needs Ray: pip install 'fabric-lite[ray]'")
    out = run_example(tmp_path, "ray_example.py", "tune", "--epochs", "1", timeout=240)
    assert len(re.findall(r"^lr=\S+\s+epochs run: 1\s+val_loss=[0-9.]+$", out, re.M)) == 4, out
    assert re.search(r"^best: lr=\S+, checkpoint ", out, re.M), out


@pytest.mark.parametrize("example, hidden_module, install_hint", [
    ("deepspeed_example.py", "deepspeed", "pip install 'fabric-lite[deepspeed]'"),
    ("fsdp2_example.py", "torch.distributed.fsdp", "torch >= 2.6"),
    ("xla_example.py", None, "make venv-xla"),
])
def test_examples_name_what_to_install_when_their_engine_is_missing(tmp_path, example, hidden_module, install_hint):
    if hidden_module is None:  # torch_xla: missing from this environment unless it is the XLA one
        if importlib.util.find_spec("torch_xla") is not None:
            pytest.skip("torch_xla is installed here: tests/xla/test_xla_example.py runs the example")
        prelude = ""
    else:  # a None entry in sys.modules makes the module unimportable (and find_spec answer None)
        prelude = f"sys.modules[{hidden_module!r}] = None; "
    code = (f"import runpy, sys; {prelude}sys.argv = [{example!r}]; "
            f"runpy.run_path({str(EXAMPLES / example)!r}, run_name='__main__')")
    proc = run_command([sys.executable, "-c", code], timeout=60, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{example} needs" in proc.stderr and install_hint in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# -- no example without a test ----------------------------------------------------------------------------

def test_every_example_has_a_test():
    examples = sorted(p.stem for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb"))
    assert examples, "no examples found"
    tests = {node.name for path in TEST_FILES if path.exists() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    untested = [name for name in examples if not any(t == f"test_{name}" or t.startswith(f"test_{name}_")
                                                     for t in tests)]
    assert not untested, (f"examples without a test named test_<example> in {', '.join(p.name for p in TEST_FILES)}: "
                          f"{untested}")
