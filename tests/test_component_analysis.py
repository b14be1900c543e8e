"""Components describe their own analysis (issue 26, item 3): the study code, the report
and the pipeline scripts name no algorithm; a test-only plugin's per-round metric becomes
a study column and a figure, and its setup phase runs in the pipeline's setup stage,
without a change to either."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conformance_plugins import AGGREGATOR, GROUPER, LOSS_TRANSFORM, conformance_registry
from test_tracking import load_stage, prepare_project, tiny_params

import fedplug.plugins
from fedplug.errors import ConfigError, DataError
from fedplug.experiment import run_experiment
from fedplug.study import (
    draw_figures,
    expand_study,
    parse_study,
    run_record,
    summarise,
    summary_table,
)

REPO = Path(__file__).resolve().parents[1]


ALGORITHM_NAMES = re.compile(r"cpd|sample_weight|feddisk|fedgsp", re.IGNORECASE)
"""What the analysis layer must not name: FedGSP's CPD and FedDisk's sample weights
belong to the components' declarations."""


def analysis_layer_files() -> list[Path]:
    return [*sorted((REPO / "fedplug" / "study").glob("*.py")), REPO / "fedplug" / "report.py",
            *sorted((REPO / "pipelines").glob("*.py"))]


def test_the_analysis_layer_names_no_algorithm() -> None:
    files = analysis_layer_files()
    assert len(files) > 10 and all(path.is_file() for path in files)  # the layer is where we look

    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in files for number, line in enumerate(path.read_text().splitlines(), 1)
            if ALGORITHM_NAMES.search(line)]

    assert hits == []


STUDY_BASE: dict[str, Any] = {
    "study": {"target_accuracy": 0.5},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 300, "num_test": 100, "num_features": 8, "num_classes": 3},
        "partition": {"name": "iid"},
        "num_clients": 5,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {"model": {"name": "logreg"}, "client_fraction": 1.0, "rounds": 3, "batch_size": 16,
              "optimizer": {"name": "sgd", "lr": 0.3}, "engine": "sequential", "device": "cpu"},
}


def pairs_study() -> dict[str, Any]:
    """FedAvg beside the test plugin's grouper, with the plugin's column and box plot."""
    return {
        "name": "pairs",
        "base": copy.deepcopy(STUDY_BASE),
        "algorithms": {"fedavg": {}, "pairs": {"grouper": {"name": GROUPER, "chain_length": 2}},
                       "momentum": {"aggregator": {"name": AGGREGATOR}}},
        "columns": ["chain_count", "conformance_damping"],
        "plots": [{"kind": "chain_count_box"}],
    }


def test_a_plugins_round_metric_becomes_a_study_column_and_a_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the plugin, nothing declares the column or the figure.
    with pytest.raises(ConfigError, match=r"columns: 'chain_count' is neither a study column nor one a component declares"):
        parse_study(pairs_study())
    # With it installed (the environment's registry), the study code is the same.
    monkeypatch.setattr(fedplug.plugins, "default_registry", conformance_registry)
    spec = parse_study(pairs_study())
    runs = expand_study(spec, conformance_registry())
    records, histories = [], {}
    for run in runs:
        result, _ = run_experiment(run.config, tmp_path / run.run_id, registry=conformance_registry())
        records.append(run_record(run, result.summary(), 0.5))
        histories[run.algorithm] = result.summary()["history"]

    by_algorithm = {record["algorithm"]: record for record in records}
    # 5 clients, every one sampled, chains of 2: 3 chains in every round (2 + 2 + 1).
    assert by_algorithm["pairs"]["chain_counts"] == [3.0, 3.0, 3.0]
    assert by_algorithm["pairs"]["chain_count"] == 3.0  # the mean over rounds it declares
    assert by_algorithm["fedavg"]["chain_count"] is None and "chain_counts" not in by_algorithm["fedavg"]
    # An aggregator's round metric reaches the record too; its declared reduction is the last round's.
    momentum = by_algorithm["momentum"]
    damping = [round_["conformance_damping"] for round_ in histories["momentum"]]
    assert len(damping) == 3 and all(value > 1.0 for value in damping)  # 1 + a mean update norm
    assert momentum["conformance_damping"] == pytest.approx(damping[-1], abs=1e-6)
    assert by_algorithm["pairs"]["conformance_damping"] is None
    rows = summarise(records)
    table = summary_table(rows, [], 0.5, columns=spec.columns)
    header, _, *lines = table.splitlines()
    assert header.endswith("| chains per round | final server damping |")  # the titles the plugins declare
    assert lines[1].endswith("| 3.0000 | - |") and lines[0].endswith("| - | - |")
    names = draw_figures(spec, records, tmp_path / "figures", prefix="pairs-")
    assert names == ["pairs-chain_count_box.png"] and (tmp_path / "figures" / names[0]).stat().st_size > 5000
    with pytest.raises(DataError, match="no run has per-round 'chain_counts' values"):
        draw_figures(spec, [by_algorithm["fedavg"]], tmp_path / "figures")


def test_the_setup_stage_runs_a_plugins_setup_phase_and_training_uses_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = tiny_params(rounds=1, tracking={"enabled": False})
    params["algorithms"] = {"fedavg": {}, "mean": {"loss_transform": {"name": LOSS_TRANSFORM}}}
    prepare_project(tmp_path, params)
    monkeypatch.setattr(fedplug.plugins, "default_registry", conformance_registry)

    assert load_stage("setup_phase").main([]) == 0

    setup = tmp_path / "data" / "setup"
    assert json.loads((setup / "fedavg" / "info.json").read_text()) == {"algorithm": "fedavg", "setup": []}
    (entry,) = json.loads((setup / "mean" / "info.json").read_text())["setup"]
    # Two steps; up: each of the 3 clients sends the sum of its 6 float32 features (24 bytes);
    # down: the 6-float mean to each of them.
    assert {key: entry[key] for key in ("slot", "component", "setup_rounds", "setup_bytes_up", "setup_bytes_down")} == {
        "slot": "loss_transform", "component": LOSS_TRANSFORM, "setup_rounds": 2,
        "setup_bytes_up": 3 * 24, "setup_bytes_down": 3 * 24}
    kept = setup / "mean" / entry["file"]
    assert kept.is_file() and entry["file"].startswith("conformance_mean-")
    written = kept.stat().st_mtime_ns
    assert load_stage("setup_phase").main([]) == 0  # params unchanged: the file is kept
    assert kept.stat().st_mtime_ns == written

    load_stage("train").main(["--algorithm", "mean", "--seed", "0"])
    metrics = json.loads((tmp_path / "reports/runs/mean/seed-0/metrics.json").read_text())
    config = yaml.safe_load((tmp_path / "reports/runs/mean/seed-0/config.yaml").read_text())
    assert config["train"]["loss_transform"]["cache_dir"] == "data/setup/mean"
    assert metrics["setup_rounds"] == 2  # the phase's cost, read back from the file

    kept.unlink()
    with pytest.raises(DataError, match=r"conformance_mean_weighted setup file .* is missing.*dvc repro setup"):
        load_stage("train").main(["--algorithm", "mean", "--seed", "0"])
