"""A sixth algorithm as an external plugin (issue 26): FedExP in ``tests/external_plugin/``,
a pip-installable package that nothing in fedplug names.

First its maths, by hand (the package imported from its folder). Then installed as a user
installs it (``pip install --target``, offline) and used only through fedplug's commands, each
in a fresh interpreter that finds it through its entry point: ``fedplug list`` and
``fedplug check-plugin`` see it; ``fedplug run`` records its ``server_step`` every round;
Flower's in-process grid and a real FedML run over ``mpirun`` give the simulator's rounds;
a study shows its declared columns and box plot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError

from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig
from fedplug.components import ClientUpdate, RoundPlan
from fedplug.errors import TrainingError
from fedplug.plugins import AUTOLOAD_SWITCH

REPO = Path(__file__).resolve().parents[1]
PLUGIN_FOLDER = REPO / "tests" / "external_plugin"


def import_plugin_sources() -> ModuleType:
    """The plugin's package from its folder, without putting the folder on ``sys.path``
    (an ``.egg-info`` that an in-place ``pip install`` leaves there would make every
    process of the suite load the plugin)."""
    spec = importlib.util.spec_from_file_location("fedplug_fedexp", PLUGIN_FOLDER / "fedplug_fedexp" / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the config's annotations through it
    spec.loader.exec_module(module)
    return module


fedexp = import_plugin_sources()
FedExP, FedExPConfig, server_step = fedexp.FedExP, fedexp.FedExPConfig, fedexp.server_step

EXPERIMENT: dict[str, Any] = {
    "study": {"name": "fedexp", "target_accuracy": 0.5},
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 360, "num_test": 120, "num_features": 8, "num_classes": 3},
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
        "num_clients": 4,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [8]},
        "aggregator": {"name": "fedexp"},
        "client_fraction": 1.0,
        "rounds": 2,
        "local_epochs": 2,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.3},
        "seed": 0,
        "engine": "sequential",
        # FedML cannot replay a round; the same setting on every runtime.
        "failures": {"max_round_retries": 0},
        "device": "cpu",
    },
}
"""Four non-IID clients, all training every round, two rounds of two local epochs: enough
client drift for FedExP to extrapolate."""

SAME_ON_EVERY_RUNTIME = ("round", "participants", "failures", "bytes_up", "bytes_down", "cumulative_bytes")
"""Round-record fields two runtimes must agree on exactly; accuracy and loss within
:data:`TOLERANCE`, the server step as :func:`assert_same_rounds` says."""
TOLERANCE = 1e-5


# ------------------------------------------------------------------------ the maths


def update(client_id: int, vector: list[float], weight: float = 10.0) -> ClientUpdate:
    return ClientUpdate(client_id=client_id, vector=torch.tensor(vector), weight=weight, num_steps=1)


GLOBAL = [1.0, -1.0, 0.5]
# Client models w_i = w - Delta_i with Delta_1 = [-2, 0, 0], Delta_2 = [0, -2, 0], Delta_3 = [1, 1, 0].
DISAGREEING = [[3.0, -1.0, 0.5], [1.0, 1.0, 0.5], [0.0, -2.0, 0.5]]


def test_disagreeing_updates_extrapolate_by_the_papers_step() -> None:
    # Prepare: uniform weights (the paper's 1/M), epsilon 1/90 for round numbers.
    aggregator = FedExP(FedExPConfig(epsilon=1 / 90), num_clients=3)
    updates = [update(index, vector, weight=10.0 * (index + 1)) for index, vector in enumerate(DISAGREEING)]
    # Execute
    new_global = aggregator.aggregate(torch.tensor(GLOBAL), updates)
    # Assert: sum ||Delta_i||^2 = 4 + 4 + 2 = 10; mean Delta = [-1/3, -1/3, 0], squared norm 2/9;
    # eta = 10 / (2 * 3 * (2/9 + 1/90)) = 10 / (7/5) = 50/7; w + eta * [1/3, 1/3, 0].
    assert aggregator.round_metrics(RoundPlan(chains=[[0], [1], [2]]), None) == {
        "server_step": pytest.approx(50 / 7, rel=1e-12)
    }
    torch.testing.assert_close(new_global, torch.tensor([1 + 50 / 21, -1 + 50 / 21, 0.5]))


def test_samples_weighting_weighs_the_mean_and_the_norms_alike() -> None:
    # Prepare: weights 2, 1, 1 -> p = 1/2, 1/4, 1/4; epsilon 1/8.
    aggregator = FedExP(FedExPConfig(epsilon=0.125, weighting="samples"), num_clients=3)
    updates = [update(index, vector, weight) for index, (vector, weight) in enumerate(zip(DISAGREEING, [2, 1, 1]))]
    # Execute
    new_global = aggregator.aggregate(torch.tensor(GLOBAL), updates)
    # Assert: mean Delta = [-1, 0, 0] + [0, -1/2, 0] + [1/4, 1/4, 0] = [-3/4, -1/4, 0], squared norm 5/8;
    # sum p_i ||Delta_i||^2 = 2 + 1 + 1/2 = 7/2; eta = (7/2) / (2 (5/8 + 1/8)) = 7/3.
    assert aggregator.last_step == pytest.approx(7 / 3, rel=1e-12)
    torch.testing.assert_close(new_global, torch.tensor([1 + 7 / 4, -1 + 7 / 12, 0.5]))


def test_updates_that_agree_take_the_fedavg_step() -> None:
    # Prepare: every client moved the same way, so ||mean||^2 = mean ||Delta_i||^2 and the
    # ratio is below 1/2: the step clamps to 1.
    moved = [[2.0, 1.0, 0.5]] * 3
    updates = [update(index, vector, weight) for index, (vector, weight) in enumerate(zip(moved, [3, 1, 2]))]
    # Execute
    step_of_uniform = FedExP(FedExPConfig(), 3)
    uniform = step_of_uniform.aggregate(torch.tensor(GLOBAL), updates)
    by_samples = FedExP(FedExPConfig(weighting="samples"), 3).aggregate(torch.tensor(GLOBAL), updates)
    fedavg = FedAvg(FedAvgConfig(), 3).aggregate(torch.tensor(GLOBAL), updates)
    # Assert
    assert step_of_uniform.last_step == 1.0
    assert torch.equal(uniform, torch.tensor([2.0, 1.0, 0.5]))
    assert torch.equal(by_samples, fedavg)  # bit for bit


def test_the_step_is_the_papers_formula_and_never_below_one() -> None:
    # sum ||Delta_i||^2 / (2 M (||mean||^2 + eps)) with M = 2, norms 4 and 16, opposite directions.
    assert server_step(mean_squared_norm=(4 + 16) / 2, squared_norm_of_mean=1.0, epsilon=0.25) == 4.0
    assert server_step(mean_squared_norm=1.0, squared_norm_of_mean=1.0, epsilon=1e-3) == 1.0


def test_no_update_is_fedavgs_error_and_a_bad_epsilon_is_refused() -> None:
    with pytest.raises(TrainingError, match="no client update reached the 'fedexp' aggregator"):
        FedExP(FedExPConfig(), 3).aggregate(torch.tensor(GLOBAL), [])
    with pytest.raises(ValidationError, match="epsilon"):
        FedExPConfig(epsilon=0.0)
    assert FedExPConfig().epsilon == 1e-3 and FedExPConfig().weighting == "uniform"  # the paper's


# ------------------------------------------------------------------ installed by pip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed as ``pip install`` installs it, offline, into a folder of its own
    (built from a copy: setuptools writes build/ and egg-info beside the sources)."""
    work = tmp_path_factory.mktemp("fedexp-install")
    shutil.copytree(PLUGIN_FOLDER, work / "source", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(work / "site"), str(work / "source")],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return work / "site"


@pytest.fixture(scope="module")
def experiment_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fedexp-experiment") / "experiment.yaml"
    path.write_text(yaml.safe_dump(EXPERIMENT))
    return path


def run_python(site: Path, *arguments: str, python: str = sys.executable, timeout: float = 600) -> str:
    """``python arguments...`` in a fresh interpreter with the plugin's folder on its path,
    plugins autoloaded, one thread, in the install's folder (FedML writes ``logs/`` into
    the working folder); its stdout (a failure shows its output)."""
    # Another interpreter (FedML's venv) must not see this one's paths: their packages
    # (numpy 2 against FedML's numpy 1) would shadow its own.
    inherited = [os.environ.get("PYTHONPATH")] if python == sys.executable else []
    path = [str(site), *filter(None, inherited)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    env.pop(AUTOLOAD_SWITCH, None)
    if python != sys.executable:
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    completed = subprocess.run(
        [python, *arguments], capture_output=True, text=True, env=env, cwd=site.parent, timeout=timeout, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


@pytest.fixture(scope="module")
def simulated(site: Path, experiment_file: Path) -> list[dict[str, Any]]:
    """``fedplug run`` of :data:`EXPERIMENT`: the rounds of its metrics.json."""
    out = experiment_file.parent / "simulator"
    run_python(site, "-m", "fedplug.cli", "run", str(experiment_file), "--out", str(out), "--no-track", "--quiet")
    return json.loads((out / "metrics.json").read_text())["history"]


def assert_same_rounds(rounds: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert len(rounds) == len(reference) == EXPERIMENT["train"]["rounds"]
    for mine, theirs in zip(rounds, reference):
        assert [mine[key] for key in SAME_ON_EVERY_RUNTIME] == [theirs[key] for key in SAME_ON_EVERY_RUNTIME]
        assert [mine["accuracy"], mine["loss"]] == pytest.approx([theirs["accuracy"], theirs["loss"]], abs=TOLERANCE)
        assert mine["server_step"] == pytest.approx(theirs["server_step"], rel=1e-12)


def test_fedplug_lists_the_installed_plugin_and_check_plugin_passes(site: Path) -> None:
    listing = run_python(site, "-m", "fedplug.cli", "list", "aggregators")
    assert "  fedexp  [fedexp]" in listing and "epsilon = 0.001" in listing
    # The conformance checks fedplug's own components pass: docs, config, simulator,
    # determinism, resume, engines and Flower's grid against the simulator.
    checks = run_python(site, "-m", "fedplug.cli", "check-plugin", "fedplug-fedexp")
    lines = checks.splitlines()
    assert len(lines) == 8 and all(line.startswith("PASS") for line in lines), checks


def test_fedplug_run_records_the_server_step_of_every_round(simulated: list[dict[str, Any]]) -> None:
    steps = [round_["server_step"] for round_ in simulated]
    assert len(steps) == 2 and all(step >= 1.0 for step in steps)
    assert max(steps) > 1.0  # non-IID clients drift apart: FedExP extrapolates


def test_flowers_grid_gives_the_simulators_rounds(
    site: Path, experiment_file: Path, simulated: list[dict[str, Any]]
) -> None:
    out = experiment_file.parent / "flower"
    run_python(site, "-c", FLOWER_RUN, str(experiment_file), str(out))
    assert_same_rounds(json.loads((out / "metrics.json").read_text())["history"], simulated)


FLOWER_RUN = """
import sys
from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
from fedplug.config import load_experiment

config = load_experiment(sys.argv[1])
grid = LoopbackGrid(make_client_app(), config.data.num_clients)
run_on_grid(grid, config, out_dir=sys.argv[2], federated_evaluation=False, track=False)
"""
"""The experiment on Flower's in-process grid: a ServerApp's strategy and one ClientApp per
node, each building its components from the installed plugins."""


def fedml_python() -> str | None:
    """The interpreter of the FedML environment: this one if it has FedML, else the
    project's ``.venv-fedml`` (``make fedml-venv``), else None."""
    import importlib.util

    if importlib.util.find_spec("fedml") is not None:
        return sys.executable
    candidate = REPO / ".venv-fedml" / "bin" / "python"
    return str(candidate) if candidate.is_file() else None


@pytest.mark.slow
def test_fedml_over_mpi_gives_the_simulators_rounds(
    site: Path, experiment_file: Path, simulated: list[dict[str, Any]]
) -> None:
    python = fedml_python()
    if python is None or shutil.which("mpirun") is None:
        pytest.skip("FedML lives in .venv-fedml, with Open MPI: run `make fedml-venv`")
    out = experiment_file.parent / "fedml"
    # A real FedML run: one server rank and two worker ranks, each loading the plugin.
    run_python(site, "-W", "ignore", "-m", "fedplug.adapters.fedml", "run", str(experiment_file),
               "--out", str(out), python=python)
    assert_same_rounds(json.loads((out / "metrics.json").read_text())["history"], simulated)


def test_a_study_shows_the_plugins_columns_and_box_plot(site: Path, tmp_path: Path) -> None:
    # Prepare: FedAvg beside FedExP, with the columns and the figure FedExP's config declares.
    study = {
        "name": "fedexp-tiny",
        "base": {key: EXPERIMENT[key] for key in ("study", "data", "train")},
        "algorithms": {"fedavg": {"aggregator": {"name": "fedavg"}}, "fedexp": {}},
        "columns": ["server_step", "server_step_max"],
        "plots": [{"kind": "server_step_box"}],
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    out = tmp_path / "study"
    # Execute: the project's study runner, unchanged.
    run_python(site, str(REPO / "pipelines" / "studies" / "run_study.py"), str(tmp_path / "study.yaml"),
               "--out", str(out), "--no-mlflow", "--no-results")
    # Assert: FedExP's row carries its steps, FedAvg's none; the box plot is drawn.
    table = (out / "summary.md").read_text()
    assert "| median server step | largest server step |" in table
    rows = {row["algorithm"]: row for row in json.loads((out / "summary.json").read_text())}
    assert rows["fedexp"]["server_step_max"] >= rows["fedexp"]["server_step"] >= 1.0
    assert rows["fedexp"]["server_step_max"] > 1.0
    assert rows["fedavg"]["server_step"] is None
    (figure,) = out.glob("*server_step_box.png")
    assert figure.stat().st_size > 5000
