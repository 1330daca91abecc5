# Two entry points for a fresh machine: `make example` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: example test venv bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/trainer_overhead.py

clean:
	rm -rf $(VENV) runs build *.egg-info
