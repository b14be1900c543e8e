"""Study grids: spec expansion, resumability, summaries, and a tiny study end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.errors import ConfigError
from fedplug.study import (
    FinishedRun,
    cell_id,
    expand_study,
    grid_cells,
    heatmap_matrix,
    parse_study,
    pending_runs,
    run_row,
    summary_markdown,
    summary_rows,
)

ROOT = Path(__file__).resolve().parents[1]

BASE: dict[str, Any] = {
    "study": {"target_accuracy": 0.5},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 300, "num_test": 100, "num_features": 8, "num_classes": 3},
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 5},
        "num_clients": 4,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [8]},
        "client_fraction": 1.0,
        "rounds": 2,
        "local_epochs": 1,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.3},
        "engine": "sequential",
        "device": "cpu",
    },
}


def spec_dict(**changes: Any) -> dict[str, Any]:
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(BASE),
        "grid": {
            "alpha": {
                "0.1": {"data.partition": {"name": "dirichlet_class", "alpha": 0.1, "min_size": 5}},
                "1": {"data.partition.alpha": 1.0},
            },
            "momentum": {"0.5": {"train.aggregator.momentum": 0.5}},
        },
        "algorithms": {
            "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.9}},
            "fedprox": {"loss_transform": {"name": "fedprox", "mu": 0.1}, "aggregator": {"name": "fedavgm"}},
        },
        "seeds": [3, 4],
    }
    spec.update(changes)
    return spec


# ------------------------------------------------------------------------ expansion


def test_grid_cells_are_the_cartesian_product_in_file_order() -> None:
    grid = {"a": {"x": {}, "y": {}}, "b": {"1": {}, "2": {}, "3": {}}}

    cells = grid_cells(grid)

    assert cells == [{"a": a, "b": b} for a in ("x", "y") for b in ("1", "2", "3")]
    assert cell_id(cells[4]) == "y_2"
    assert grid_cells({}) == [{}] and cell_id({}) == "base"


def test_expansion_gives_grid_times_algorithms_times_seeds_validated_runs() -> None:
    spec = parse_study(spec_dict())

    runs = expand_study(spec)

    # 2 alphas x 1 momentum x 2 algorithms x 2 seeds
    assert len(runs) == 8
    assert [run.run_id for run in runs[:4]] == [
        "0.1_0.5__fedavgm__s3", "0.1_0.5__fedavgm__s4", "0.1_0.5__fedprox__s3", "0.1_0.5__fedprox__s4",
    ]
    assert len({run.run_id for run in runs}) == 8
    first, last = runs[0], runs[-1]
    assert first.config.data.partition.alpha == 0.1
    assert last.config.data.partition.alpha == 1.0
    assert last.config.data.partition.min_size == 5  # the dotted override kept the other fields
    # The grid applies after the algorithm: it tunes the algorithm's own parameter.
    assert first.config.train.aggregator.momentum == 0.5
    assert last.config.train.loss_transform.name == "fedprox" and last.config.train.loss_transform.mu == 0.1
    assert [run.config.train.seed for run in runs[:2]] == [3, 4]
    assert first.config.study.name == "tiny" and first.config.study.seeds == [3]
    assert first.cell == {"alpha": "0.1", "momentum": "0.5"}


def test_command_line_overrides_apply_to_the_base_before_the_grid() -> None:
    spec = parse_study(spec_dict())

    runs = expand_study(spec, overrides=["data.num_clients=3", "train.rounds=1"])

    assert {run.config.data.num_clients for run in runs} == {3}
    assert {run.config.train.rounds for run in runs} == {1}


def test_a_run_that_does_not_validate_is_named() -> None:
    spec = parse_study(spec_dict(algorithms={"bad": {"aggregator": {"name": "fedavgm"}, "optimizer": {"lr": -1.0}}}))

    with pytest.raises(ConfigError, match=r"(?s)run 0\.1_0\.5__bad__s3.*optimizer.lr"):
        expand_study(spec)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algorithms": {"fed avg": {}}}, "label 'fed avg'"),
        ({"grid": {"alpha": {}}}, "grid.alpha: give at least one"),
        ({"plots": [{"kind": "vs_axis"}]}, "needs `axis:`"),
        ({"plots": [{"kind": "heatmap", "rows": "alpha", "columns": "nope"}]}, "'nope' is not a grid axis"),
        ({"seed": [1]}, "seed: unknown key"),
        ({"base": {**BASE, "algorithms": {"x": {}}}}, "base.algorithms"),
    ],
)
def test_bad_specs_say_what_to_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_study(spec_dict(**changes))


def test_pending_runs_skip_runs_with_metrics(tmp_path: Path) -> None:
    runs = expand_study(parse_study(spec_dict()))
    (tmp_path / runs[1].run_id).mkdir()
    (tmp_path / runs[1].run_id / "metrics.json").write_text("{}")
    (tmp_path / runs[2].run_id).mkdir()  # started, no metrics yet: still pending
    (tmp_path / runs[2].run_id / "checkpoint.pt").write_text("")

    pending = pending_runs(runs, tmp_path)

    assert [run.run_id for run in pending] == [run.run_id for run in runs if run is not runs[1]]


# ------------------------------------------------------------------------ summaries


def history(accuracies: list[float], cpd: list[float | None] | None = None) -> list[dict[str, Any]]:
    cpd = cpd or [None] * len(accuracies)
    return [
        {"round": index + 1, "accuracy": accuracy, "loss": 1.0 - accuracy, "cumulative_bytes": 100 * (index + 1),
         "cpd_median": cpd[index], "client_accuracy_mean": accuracy / 2}
        for index, accuracy in enumerate(accuracies)
    ]


def test_run_row_counts_setup_rounds_and_bytes_to_target() -> None:
    summary = {"history": history([0.3, 0.6, 0.55], cpd=[0.4, 0.1, 0.2]), "setup_rounds": 5,
               "total_bytes": 900, "total_seconds": 2.5}

    row = run_row(summary, target=0.5)

    assert row["final_accuracy"] == 0.55 and row["best_accuracy"] == 0.6
    assert row["final_loss"] == pytest.approx(0.45)
    assert row["final_client_accuracy"] == pytest.approx(0.275)
    assert row["rounds_to_target"] == 2 and row["effective_rounds_to_target"] == 7
    assert row["bytes_to_target"] == 200 and row["total_bytes"] == 900
    assert row["cpd_median"] == pytest.approx(0.2)  # median of 0.4, 0.1, 0.2
    assert run_row(summary, target=0.9)["rounds_to_target"] is None


def test_summary_rows_average_seeds() -> None:
    runs = expand_study(parse_study(spec_dict()))
    finished = [
        FinishedRun(runs[0], {"history": history([0.2, 0.6]), "total_bytes": 200}),
        FinishedRun(runs[1], {"history": history([0.3, 0.4]), "total_bytes": 400}),
    ]

    rows = summary_rows(finished, target=0.5)

    assert len(rows) == 1
    row = rows[0]
    assert (row["alpha"], row["momentum"], row["algorithm"], row["seeds"], row["reached"]) == ("0.1", "0.5", "fedavgm", 2, 1)
    assert row["final_accuracy"] == pytest.approx(0.5)
    assert row["final_accuracy_std"] == pytest.approx(0.1)
    assert row["rounds_to_target"] == 2  # only the seed that reached it
    assert row["total_bytes"] == 300
    table = summary_markdown(rows, ["alpha", "momentum"], 0.5)
    assert "| 0.1 | 0.5 | fedavgm | 2 | 0.5000 ± 0.1000 |" in table
    assert "2 (1/2 seeds)" in table


def test_heatmap_matrix_places_means_and_nan_for_missing() -> None:
    rows = [
        {"a": "x", "b": "1", "m": 1.0}, {"a": "x", "b": "1", "m": 3.0},
        {"a": "y", "b": "2", "m": 5.0}, {"a": "y", "b": "1", "m": None},
    ]

    matrix = heatmap_matrix(rows, "a", "b", "m", ["x", "y"], ["1", "2"])

    assert matrix[0, 0] == 2.0 and matrix[1, 1] == 5.0
    assert math.isnan(matrix[0, 1]) and math.isnan(matrix[1, 0])


# ------------------------------------------------------------------------ end to end


def load_runner() -> Any:
    path = ROOT / "pipelines" / "studies" / "run_study.py"
    module_spec = importlib.util.spec_from_file_location("run_study", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_tiny_study_end_to_end_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(BASE),
        "grid": {"alpha": {"0.5": {"data.partition.alpha": 0.5}}},
        "algorithms": {"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}},
        "seeds": [0],
        "plots": [{"kind": "curves"}, {"kind": "bars", "metric": "final_accuracy"},
                  {"kind": "vs_axis", "axis": "alpha", "metric": "final_accuracy"}],
    }
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    runner = load_runner()

    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(out)]) == 0

    run_ids = ["0.5__fedavg__s0", "0.5__fedavgm__s0"]
    for run_id in run_ids:
        metrics = json.loads((out / run_id / "metrics.json").read_text())
        assert metrics["rounds"] == 2 and len(metrics["history"]) == 2
        assert not (out / run_id / "checkpoint.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [row["algorithm"] for row in summary] == ["fedavg", "fedavgm"]
    first = json.loads((out / run_ids[0] / "metrics.json").read_text())
    assert summary[0]["final_accuracy"] == first["final_accuracy"]
    report = (out / "summary.md").read_text()
    assert "| 0.5 | fedavgm | 1 |" in report
    for name in ("curves_0.5.png", "final_accuracy_bars.png", "final_accuracy_vs_alpha.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in report

    # Resume: finished runs are skipped, untouched.
    stamps = {run_id: (out / run_id / "metrics.json").stat().st_mtime_ns for run_id in run_ids}
    capsys.readouterr()
    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(out)]) == 0
    assert "2 runs, 2 done, 0 to train" in capsys.readouterr().out
    assert {run_id: (out / run_id / "metrics.json").stat().st_mtime_ns for run_id in run_ids} == stamps


@pytest.mark.parametrize("name", ["fedshift", "iwds", "fedavgm", "fedgsp", "fedgsp_growth", "feddisk"])
def test_shipped_study_specs_expand(name: str) -> None:
    from fedplug.config import read_yaml

    spec = parse_study(read_yaml(ROOT / "pipelines" / "studies" / f"{name}.yaml"), name)

    runs = expand_study(spec)

    expected = len(grid_cells(spec.grid)) * len(spec.algorithms) * len(spec.seeds)
    assert len(runs) == expected and {run.config.study.name for run in runs} == {name}


def test_a_study_is_one_parent_run_with_a_child_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(BASE),
        "grid": {"alpha": {"0.5": {"data.partition.alpha": 0.5}}},
        "algorithms": {"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}},
        "seeds": [0],
        "plots": [{"kind": "bars", "metric": "final_accuracy"}],
    }
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    runner = load_runner()

    # Interrupted after the first run (--only), then resumed: one parent for both.
    assert runner.main([str(spec_path), "--out", str(out), "--only", "fedavg__"]) == 0
    assert runner.main([str(spec_path), "--out", str(out)]) == 0

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("study-tiny")
    runs = client.search_runs([experiment.experiment_id])
    parents = [run for run in runs if "fedplug.parent" in run.data.tags]
    children = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    assert len(parents) == 1 and len(children) == 2 and len(runs) == 3
    parent = parents[0]
    assert parent.data.tags["fedplug.parent"] == f"study:{out.resolve()}"
    assert parent.data.tags["mlflow.runName"] == "out" and parent.info.status == "FINISHED"
    assert {run.data.tags["mlflow.parentRunId"] for run in children} == {parent.info.run_id}
    assert sorted(run.info.run_name for run in children) == ["0.5__fedavg__s0", "0.5__fedavgm__s0"]
    for child in children:
        metrics = json.loads((out / child.info.run_name / "metrics.json").read_text())
        assert child.data.metrics["final_accuracy"] == pytest.approx(metrics["final_accuracy"])
        assert child.data.tags["study.alpha"] == "0.5" and child.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "accuracy")]
        assert sorted(steps) == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert parent.data.metrics["0.5/fedavgm.final_accuracy"] == pytest.approx(summary[1]["final_accuracy"])
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "summary.json", "figures"} <= artifacts
    # The store's artifacts lie beside it, not in the current folder.
    assert parent.info.artifact_uri.startswith((store / "mlruns").as_uri())
    assert (store / "mlruns" / parent.info.run_id / "artifacts" / "summary.md").is_file()
