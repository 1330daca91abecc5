# Two entry points for a fresh machine: `make example` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: example test lint venv bench clean venv-xla test-xla system-tools docs docs-serve

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

example: $(STAMP)
	$(BIN)/python examples/migration_digits.py --project-dir runs/digits
	$(BIN)/python examples/trainer_digits.py --root runs/trainer_digits
	@echo "TensorBoard logs: runs/digits and runs/trainer_digits/logs  (view: $(BIN)/tensorboard --logdir runs)"

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -ra

# The layers contract and the type checker (pyproject.toml: [tool.importlinter], [tool.mypy]); `make test` runs it
# first. PYTHONPATH: they check this checkout's fabric_lite/, also where the environment was installed from another.
lint: $(STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/lint-imports --no-logo
	PYTHONPATH=$(CURDIR) $(BIN)/mypy fabric_lite

# The documentation site (mkdocs.yml, docs/): built strictly, so a broken link or an API page that
# does not render is an error. docs-serve rebuilds on every change, on http://127.0.0.1:8000.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve -a 127.0.0.1:8000

# Tests that use real system programs: SLURM, MUNGE and OpenMPI (tests/launch/test_slurm.py, test_cluster.py)
# and headless Chromium (tests/docs/test_docs.py): as root on Debian this installs them from Debian's
# packages; elsewhere it says what will skip.
system-tools:
	bash .ci/system-tools.sh

# torch_xla runs only on the torch of its own version (2.9): its tests run in an environment of their own,
# on XLA's CPU device (PJRT_DEVICE=CPU). About 4 GB to download the first time.
XLA_VENV ?= .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed

$(XLA_STAMP): requirements-xla.txt pyproject.toml
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install --quiet --upgrade pip
	$(XLA_VENV)/bin/pip install --quiet -r requirements-xla.txt
	$(XLA_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(XLA_STAMP)

venv-xla: $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q -ra tests/xla tests/strategies/test_conformance.py -k xla

# peers.py compares with Hugging Face Accelerate and Lightning where they are installed (it names the
# missing ones): PEERS_PYTHON=/path/to/other/venv/bin/python points it at an environment that has them.
PEERS_PYTHON ?= $(BIN)/python

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/trainer_overhead.py
	$(BIN)/python -m torch.distributed.run --nproc-per-node 2 benchmarks/trainer_overhead.py --ddp
	$(BIN)/python benchmarks/memory.py
	$(PEERS_PYTHON) benchmarks/peers.py
	$(BIN)/python benchmarks/deepspeed_memory.py
	$(BIN)/python benchmarks/fsdp_memory.py

clean:
	rm -rf $(VENV) $(XLA_VENV) runs build site *.egg-info
