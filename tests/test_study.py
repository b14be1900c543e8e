"""Study grids: spec expansion (draws x seeds, headline cells), run-folder reuse that never
mixes settings, run records, and a tiny study end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.algorithms.feddisk.config import WEIGHT_ANALYSIS
from fedplug.errors import ConfigError, DataError
from fedplug.study.expansion import expand_study, planned_runs
from fedplug.study.figures import draw_figures
from fedplug.study.plots import heatmap_matrix, pooled_histogram, spread_scale
from fedplug.study.records import load_records, run_record, run_row, setup_record
from fedplug.study.run_folders import comparable_config, config_hash, pending_runs, run_folder_state
from fedplug.study.spec import cell_id, grid_cells, parse_study
from fedplug.study.statistics import summarise
from fedplug.study.tables import summary_table
from fedplug.study.tuning import with_values

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

    # 2 alphas x 1 momentum x 2 algorithms x 2 seeds, one draw (the base's data.seed 0)
    assert len(runs) == 8
    assert [run.run_id for run in runs[:4]] == [
        "0.1_0.5__fedavgm__d0s3", "0.1_0.5__fedavgm__d0s4", "0.1_0.5__fedprox__d0s3", "0.1_0.5__fedprox__d0s4",
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
    assert {run.config.data.seed for run in runs} == {0} and {run.draw for run in runs} == {0}
    assert first.config.study.name == "tiny" and first.config.study.seeds == [3]
    assert first.cell == {"alpha": "0.1", "momentum": "0.5"} and all(run.headline for run in runs)


def test_headline_cells_get_every_draw_and_seed_the_others_the_diagonal() -> None:
    spec = parse_study(spec_dict(draws=[7, 8], headline={"cells": ["0.1_0.5"]}, other_pairs="diagonal"))

    runs = expand_study(spec)

    headline = [run for run in runs if run.cell_id == "0.1_0.5"]
    other = [run for run in runs if run.cell_id == "1_0.5"]
    # 2 draws x 2 algorithms x 2 seeds in the headline cell; (7, 3) and (8, 4) elsewhere.
    assert len(headline) == 8 and all(run.headline for run in headline)
    assert sorted((run.algorithm, run.draw, run.seed) for run in other) == [
        ("fedavgm", 7, 3), ("fedavgm", 8, 4), ("fedprox", 7, 3), ("fedprox", 8, 4)]
    assert not any(run.headline for run in other)
    # Cells outermost, then draws (runs sharing a federation are neighbours), algorithms, seeds.
    assert [run.run_id for run in headline[:5]] == [
        "0.1_0.5__fedavgm__d7s3", "0.1_0.5__fedavgm__d7s4", "0.1_0.5__fedprox__d7s3", "0.1_0.5__fedprox__d7s4",
        "0.1_0.5__fedavgm__d8s3"]
    assert all(run.config.data.seed == run.draw and run.config.train.seed == run.seed for run in runs)


def test_headline_algorithms_and_explicit_pairs() -> None:
    spec = parse_study(spec_dict(draws=[0, 1], headline={"algorithms": ["fedprox"]}, other_pairs=[[1, 4]]))

    runs = planned_runs(spec)

    assert {(run.algorithm, run.draw, run.seed) for run in runs if run.algorithm == "fedavgm"} == {("fedavgm", 1, 4)}
    assert len([run for run in runs if run.algorithm == "fedprox"]) == 2 * 2 * 2  # 2 cells x 2 draws x 2 seeds


def test_an_algorithms_own_pairs_replace_other_pairs_for_it_alone() -> None:
    spec = parse_study(spec_dict(draws=[0, 1, 2], headline={"cells": ["0.1_0.5"], "algorithms": ["fedprox"]},
                                 other_pairs=[[0, 3], [1, 4], [2, 3]], pairs={"fedavgm": [[2, 4]]}))

    runs = planned_runs(spec)

    # fedavgm (never headline): only (2, 4), in both cells; fedprox outside the headline
    # cell: other_pairs; in it, every draw x seed.
    assert sorted((run.cell_id, run.draw, run.seed) for run in runs if run.algorithm == "fedavgm") == [
        ("0.1_0.5", 2, 4), ("1_0.5", 2, 4)]
    assert sorted((run.draw, run.seed) for run in runs if run.algorithm == "fedprox" and run.cell_id == "1_0.5") == [
        (0, 3), (1, 4), (2, 3)]
    assert len([run for run in runs if run.algorithm == "fedprox" and run.cell_id == "0.1_0.5"]) == 3 * 2


def test_headline_pairs_add_draws_with_one_seed_beside_draws_with_every_seed() -> None:
    spec = parse_study(spec_dict(draws=[0, 1, 2], seeds=[3, 4],
                                 headline={"algorithms": ["fedprox"], "pairs": [[0, 3], [0, 4], [1, 3], [2, 3]]},
                                 other_pairs=[[0, 3], [1, 4]]))

    runs = planned_runs(spec)

    # fedprox (headline): the headline's 4 pairs in each of the 2 cells, flagged headline;
    # fedavgm: other_pairs, untouched by headline.pairs.
    fedprox = [run for run in runs if run.algorithm == "fedprox"]
    assert sorted((run.cell_id, run.draw, run.seed) for run in fedprox) == [
        (cell, draw, seed) for cell in ("0.1_0.5", "1_0.5") for draw, seed in [(0, 3), (0, 4), (1, 3), (2, 3)]]
    assert all(run.headline for run in fedprox)
    assert sorted((run.draw, run.seed) for run in runs if run.algorithm == "fedavgm") == [(0, 3), (0, 3), (1, 4), (1, 4)]


def test_command_line_overrides_apply_to_the_base_before_the_grid() -> None:
    spec = parse_study(spec_dict())

    runs = expand_study(spec, overrides=["data.num_clients=3", "train.rounds=1"])

    assert {run.config.data.num_clients for run in runs} == {3}
    assert {run.config.train.rounds for run in runs} == {1}


def test_a_run_that_does_not_validate_is_named() -> None:
    spec = parse_study(spec_dict(algorithms={"bad": {"aggregator": {"name": "fedavgm"}, "optimizer": {"lr": -1.0}}}))

    with pytest.raises(ConfigError, match=r"(?s)run 0\.1_0\.5__bad__d0s3.*optimizer.lr"):
        expand_study(spec)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algorithms": {"fed avg": {}}}, "label 'fed avg'"),
        ({"grid": {"alpha": {}}}, "grid.alpha: give at least one"),
        ({"plots": [{"kind": "vs_axis"}]}, "needs `axis:`"),
        ({"plots": [{"kind": "bars", "log_y": True}]}, "log_y is for `dots` plots only, not 'bars'"),
        ({"plots": [{"kind": "heatmap", "rows": "alpha", "columns": "nope"}]}, "'nope' is not a grid axis"),
        ({"seed": [1]}, "seed: unknown key"),
        ({"base": {**BASE, "algorithms": {"x": {}}}}, "base.algorithms"),
        ({"baseline": "fedavg"}, "baseline 'fedavg' is not one of the algorithms"),
        ({"labels": {"fedav": "FedAvg"}}, "labels: 'fedav' is not one of the algorithms"),
        ({"headline": {"cells": ["0.2_0.5"]}}, r"headline.cells: '0.2_0.5' is not a grid cell; cells: 0.1_0.5, 1_0.5"),
        ({"headline": {"algorithms": ["x"]}}, "headline.algorithms: 'x'"),
        ({"other_pairs": "all"}, "other_pairs applies to the runs outside `headline:`"),
        ({"headline": {}, "draws": [0]}, "diagonal pairs draws and seeds one to one, but there are 1 draws and 2 seeds"),
        ({"headline": {}, "draws": [0, 1], "other_pairs": [[2, 3]]}, r"\[2, 3\] is not a \[draw, seed\] pair"),
        ({"pairs": {"fedprox": [[0, 3]]}}, "pairs applies to the runs outside `headline:`"),
        ({"headline": {"algorithms": ["fedprox"]}, "draws": [0, 1], "pairs": {"fedprox": [[0, 3]]}},
         "pairs.fedprox: a headline algorithm runs the headline's pairs"),
        ({"headline": {"pairs": [[7, 3]]}, "draws": [0, 1]}, r"headline.pairs: \[7, 3\] is not a \[draw, seed\] pair"),
        ({"headline": {"pairs": [[0, 3], [0, 3]]}, "draws": [0, 1]}, r"headline.pairs: \[\[0, 3\], \[0, 3\]\] repeats a pair"),
        ({"headline": {"algorithms": ["fedprox"]}, "draws": [0, 1], "pairs": {"x": [[0, 3]]}},
         r"pairs: 'x' is not one of the algorithms"),
        ({"headline": {"algorithms": ["fedprox"]}, "draws": [0, 1], "pairs": {"fedavgm": [[0, 3], [0, 3]]}},
         r"pairs.fedavgm: \[\[0, 3\], \[0, 3\]\] repeats a pair"),
        ({"headline": {"algorithms": ["fedprox"]}, "draws": [0, 1], "pairs": {"fedavgm": [[5, 3]]}},
         r"pairs.fedavgm: \[5, 3\] is not a \[draw, seed\] pair"),
        ({"seeds": [1, 1]}, r"seeds: \[1, 1\] repeats a value"),
        ({"draws": []}, "draws: List should have at least 1 item"),
        ({"headline_metric": "best_accuracy"}, "headline_metric"),
        ({"grid": {"s": {"1": {"train.seed": 1}}}}, "grid.s.1: sets train.seed"),
        ({"draws": [0], "grid": {"s": {"1": {"data": {"seed": 1}}}}}, "grid.s.1: sets data.seed"),
        ({"cells": {"fedavgm": ["0.2_0.5"]}}, r"cells.fedavgm: '0.2_0.5' is not a grid cell; cells: 0.1_0.5, 1_0.5"),
        ({"cells": {"fedavg": ["1_0.5"]}}, r"cells: 'fedavg' is not one of the algorithms \(fedavgm, fedprox\)"),
        ({"cells": {"fedavgm": []}}, "cells.fedavgm: give at least one grid cell"),
        ({"cells": {"fedavgm": ["1_0.5", "1_0.5"]}}, "repeats a cell"),
        ({"baselines": {"fedprox": "fedavg"}}, "baselines.fedprox: 'fedavg' is not one of the algorithms"),
        ({"baselines": {"x": "fedprox"}}, "baselines: 'x' is not one of the algorithms"),
        ({"baselines": {"fedprox": "fedprox"}}, "baselines.fedprox: an algorithm cannot be its own baseline"),
        ({"baselines": {"fedprox": "fedavgm"}, "cells": {"fedavgm": ["1_0.5"]}},
         "baselines.fedprox: 'fedavgm' does not run in cell '0.1_0.5', where 'fedprox' runs"),
    ],
)
def test_bad_specs_say_what_to_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_study(spec_dict(**changes))


@pytest.mark.parametrize("name", ["..", ".", "...", "../x", "a/b", "a\\b", "/tmp", "x" * 101, ""])
def test_a_study_name_must_be_a_plain_name(name: str) -> None:
    # The name is a folder under reports/studies/ and a file under results/: `..` would
    # write the study into reports/ (issue 29).
    with pytest.raises(ConfigError) as error:
        parse_study(spec_dict(name=name), "tiny.yaml")

    assert str(error.value).startswith("tiny.yaml: invalid study:\nname: ")
    if set(name) == {"."}:
        assert str(error.value).endswith(
            f"name: {name!r} is not a plain name; use letters, digits, '-', '_' and '.', not only dots"
        )


@pytest.mark.parametrize("name", ["fedshift", "fedgsp_femnist", "v1.2", ".hidden-ok", "a..b"])
def test_plain_study_names_pass(name: str) -> None:
    assert parse_study(spec_dict(name=name)).name == name


def test_an_algorithm_restricted_to_cells_runs_only_there() -> None:
    spec = parse_study(spec_dict(cells={"fedprox": ["1_0.5"]}))

    runs = expand_study(spec)

    assert [run.run_id for run in runs] == [
        "0.1_0.5__fedavgm__d0s3", "0.1_0.5__fedavgm__d0s4",
        "1_0.5__fedavgm__d0s3", "1_0.5__fedavgm__d0s4", "1_0.5__fedprox__d0s3", "1_0.5__fedprox__d0s4",
    ]
    # A restricted algorithm keeps the headline rule inside its cells.
    headline = parse_study(spec_dict(cells={"fedprox": ["1_0.5"]}, draws=[0, 1], seeds=[3, 4],
                                     headline={"cells": ["1_0.5"]}))
    fedprox = [run for run in planned_runs(headline) if run.algorithm == "fedprox"]
    assert [(run.cell_id, run.draw, run.seed, run.headline) for run in fedprox] == [
        ("1_0.5", 0, 3, True), ("1_0.5", 0, 4, True), ("1_0.5", 1, 3, True), ("1_0.5", 1, 4, True)]


def test_per_algorithm_baselines_pair_a_variant_with_its_own_reference() -> None:
    def record(algorithm: str, seed: int, final: float) -> dict[str, Any]:
        return {"run": f"c__{algorithm}__d0s{seed}", "cell": {"a": "c"}, "algorithm": algorithm, "draw": 0, "seed": seed,
                "final_accuracy": final, "rounds_to_target": None}

    finals = {"fedavg": [0.5, 0.5], "fedprox": [0.9, 0.9], "fedavg-cnn": [0.8, 0.7], "fedprox-cnn": [0.75, 0.75]}
    records = [record(algorithm, seed, value) for algorithm, values in finals.items() for seed, value in enumerate(values)]

    rows = {row["algorithm"]: row for row in summarise(records, "final_accuracy", "fedavg", {"fedprox-cnn": "fedavg-cnn"})}

    # fedprox-cnn against fedavg-cnn: 0.75 - 0.8 (loss), 0.75 - 0.7 (win); against fedavg it would win both.
    paired = rows["fedprox-cnn"]["paired"]
    assert rows["fedprox-cnn"]["reference"] == "fedavg-cnn"
    assert (paired["pairs"], paired["wins"], paired["losses"]) == (2, 1, 1) and paired["difference"] == pytest.approx(0.0)
    assert rows["fedprox"]["reference"] == "fedavg" and rows["fedprox"]["paired"]["wins"] == 2
    assert rows["fedavg"]["reference"] is None and rows["fedavg"]["paired"] is None
    table = summary_table(list(rows.values()), ["a"], 0.95, labels={"fedavg-cnn": "FedAvg (CNN)"}, baseline="fedavg",
                          baselines={"fedprox-cnn": "fedavg-cnn"})
    assert "vs baseline (fedavg unless named): mean difference [95% interval] over partitions" in table
    # One draw: one partition, no interval; fedprox-cnn's draw ties (-0.05 and +0.05).
    assert "| +0.0000 (no interval) over 1 partition, won 0 of 1 vs FedAvg (CNN) | 1/0/1 of 2 |" in table
    assert "| +0.4000 (no interval) over 1 partition, won 1 of 1 | 2/0/0 of 2 |" in table
    assert "| (baseline) |  |" in table


def test_overrides_may_not_set_the_seeds_the_study_sets() -> None:
    with pytest.raises(ConfigError, match="sets train.seed from its `seeds:`"):
        expand_study(parse_study(spec_dict()), overrides=["train.seed=5"])
    with pytest.raises(ConfigError, match="sets data.seed from its `draws:`"):
        expand_study(parse_study(spec_dict(draws=[0])), overrides=["data.seed=5"])
    # Without draws, --set data.seed picks the (single) draw.
    runs = expand_study(parse_study(spec_dict()), overrides=["data.seed=5"])
    assert {(run.draw, run.config.data.seed) for run in runs} == {(5, 5)} and runs[0].run_id.endswith("__d5s3")


# ------------------------------------------------------------- run folders and reuse


def write_run_folder(folder: Path, config: dict[str, Any], *, metrics: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if metrics:
        (folder / "metrics.json").write_text("{}")


def test_run_folder_state_reuses_only_runs_of_the_same_resolved_config(tmp_path: Path) -> None:
    run = expand_study(parse_study(spec_dict()))[0]
    config = run.config.model_dump(mode="json")

    assert run_folder_state(run, tmp_path / "none").status == "new"
    write_run_folder(tmp_path / "same", config)
    assert run_folder_state(run, tmp_path / "same").status == "done"
    write_run_folder(tmp_path / "started", config, metrics=False)
    (tmp_path / "started" / "checkpoint.pt").write_text("")
    assert run_folder_state(run, tmp_path / "started").status == "partial"

    one_round = copy.deepcopy(config)
    one_round["train"]["rounds"] = 1
    write_run_folder(tmp_path / "rounds", one_round)
    state = run_folder_state(run, tmp_path / "rounds")
    assert state == ("mismatched", "it was trained with train.rounds=1 but the study asks 2")

    two = copy.deepcopy(one_round)
    two["data"]["partition"]["alpha"] = 0.3
    write_run_folder(tmp_path / "two", two)
    assert run_folder_state(run, tmp_path / "two").reason == (
        "it was trained with data.partition.alpha=0.3 but the study asks 0.1 (and 1 more differences)")

    new_field = copy.deepcopy(config)
    del new_field["train"]["optimizer"]["weight_decay"]  # a run from before a field existed
    write_run_folder(tmp_path / "old", new_field)
    assert run_folder_state(run, tmp_path / "old").reason == (
        "it was trained with train.optimizer.weight_decay (absent) but the study asks 0.0")

    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metrics.json").write_text("{}")
    assert run_folder_state(run, tmp_path / "bare").status == "mismatched"
    assert pending_runs([run], tmp_path / "x") == [run]


def test_fields_that_cannot_change_results_are_ignored() -> None:
    run = expand_study(parse_study(spec_dict()))[0]
    config = run.config.model_dump(mode="json")
    neutral = copy.deepcopy(config)
    neutral["tracking"]["uri"] = "http://127.0.0.1:1"
    neutral["study"]["target_accuracy"] = 0.99
    neutral["data"]["root"] = "/elsewhere"
    neutral["train"]["engine"] = "parallel"
    neutral["train"]["workers"] = 2
    changed = copy.deepcopy(config)
    changed["train"]["engine"] = "vectorized"  # not bit-identical to sequential

    assert comparable_config(neutral) == comparable_config(config)
    assert config_hash(neutral) == config_hash(config) and len(config_hash(config)) == 12
    assert config_hash(changed) != config_hash(config)
    assert "tracking" not in comparable_config(config) and "study" not in comparable_config(config)


# ------------------------------------------------------------------------ records


def history(accuracies: list[float], cpd: list[float | None] | None = None) -> list[dict[str, Any]]:
    cpd = cpd or [None] * len(accuracies)
    return [
        {"round": index + 1, "accuracy": accuracy, "loss": 1.0 - accuracy, "cumulative_bytes": 100 * (index + 1),
         "cpd_median": cpd[index], "client_accuracy_mean": accuracy / 2, "compute_seconds_model": 0.5 * (index + 1),
         "communication_seconds_model": 0.25}
        for index, accuracy in enumerate(accuracies)
    ]


def test_run_row_counts_setup_rounds_and_bytes_to_target() -> None:
    summary = {"history": history([0.3, 0.6, 0.55, 0.5], cpd=[0.4, 0.1, 0.2, 0.3]), "setup_rounds": 5,
               "total_bytes": 900, "total_seconds": 2.5}

    row = run_row(summary, target=0.5)

    assert row["final_accuracy"] == 0.5 and row["best_accuracy"] == 0.6
    assert row["last3_accuracy"] == pytest.approx((0.6 + 0.55 + 0.5) / 3)
    assert row["final_loss"] == pytest.approx(0.5)
    assert row["final_client_accuracy"] == pytest.approx(0.25)
    assert row["rounds_to_target"] == 2 and row["effective_rounds_to_target"] == 7
    assert row["bytes_to_target"] == 200 and row["total_bytes"] == 900
    assert row["cpd_median"] == pytest.approx(0.25)  # median of 0.4, 0.1, 0.2, 0.3
    assert row["compute_seconds_model"] == pytest.approx(0.5 + 1.0 + 1.5 + 2.0)
    assert row["communication_seconds_model"] == pytest.approx(1.0)
    # Time to accuracy: the cost model's compute seconds of rounds 1 and 2 (0.5 + 1.0), round 2
    # being the first at or above 0.5.
    assert row["compute_seconds_to_target"] == pytest.approx(1.5)
    assert run_row(summary, target=0.58)["compute_seconds_to_target"] == pytest.approx(1.5)
    assert run_row(summary, target=0.2)["compute_seconds_to_target"] == pytest.approx(0.5)
    never = run_row(summary, target=0.9)
    assert never["rounds_to_target"] is None and never["compute_seconds_to_target"] is None


def test_run_record_is_one_compact_line_with_provenance() -> None:
    run = expand_study(parse_study(spec_dict(draws=[2])))[1]
    metrics = {"history": history([0.2, 0.6, 0.4], cpd=[0.3, None, 0.1]), "total_bytes": 300, "total_seconds": 1.234}

    record = run_record(run, metrics, 0.5, info={"git_commit": "abc1234def", "packages": {"fedplug": "0.1.0"}},
                        provenance={"git_dirty": False}, overrides=["data.root=x"])

    assert (record["run"], record["draw"], record["seed"], record["algorithm"]) == ("0.1_0.5__fedavgm__d2s4", 2, 4, "fedavgm")
    assert record["cell"] == {"alpha": "0.1", "momentum": "0.5"} and record["headline"] is True
    assert record["accuracy"] == [0.2, 0.6, 0.4] and record["cpd"] == [0.3, None, 0.1]
    assert record["final_accuracy"] == 0.4 and record["best_accuracy"] == 0.6
    assert record["last3_accuracy"] == pytest.approx(0.4)
    assert record["rounds_to_target"] == 2 and record["bytes_to_target"] == 200 and record["total_bytes"] == 300
    assert record["compute_seconds_model"] == 3.0 and record["train_seconds"] == 1.23
    assert record["compute_seconds_to_target"] == 1.5 and record["compute_seconds"] == [0.5, 1.0, 1.5]
    assert "weights" not in record and "setup_seconds" not in record  # no setup phase
    assert run_record(run, dict(metrics, setup_seconds=512.345), 0.5)["setup_seconds"] == 512.35
    assert "setup_seconds" not in run_record(run, dict(metrics, setup_seconds=0.0004), 0.5)  # a no-op setup
    assert (record["commit"], record["dirty"], record["fedplug"]) == ("abc1234def", False, "0.1.0")
    assert record["config_hash"] == config_hash(run.config.model_dump(mode="json"))
    assert json.loads(json.dumps(record)) == record


def test_time_to_target_column_averages_the_runs_that_reached_it() -> None:
    records = [
        {"run": f"c__a__d0s{seed}", "cell": {"k": "c"}, "algorithm": "a", "draw": 0, "seed": seed,
         "final_accuracy": 0.5, "rounds_to_target": rounds, "compute_seconds_to_target": seconds}
        for seed, (rounds, seconds) in enumerate([(2, 1.5), (None, None), (3, 2.5)])
    ]

    row = summarise(records)[0]

    assert row["compute_seconds_to_target"] == pytest.approx(2.0)
    assert row["compute_seconds_to_target_std"] == pytest.approx(0.5 ** 0.5)
    table = summary_table([row], ["k"], 0.8, columns=["compute_seconds_to_target"])
    assert "cost-model compute s to target" in table and "| 2 ± 0.71 (2/3 reached) |" in table
    never = summarise([dict(record, rounds_to_target=None, compute_seconds_to_target=None) for record in records])
    assert "| not reached |" in summary_table(never, ["k"], 0.8, columns=["compute_seconds_to_target"])
    assert parse_study(spec_dict(columns=["compute_seconds_to_target"])).columns == ["compute_seconds_to_target"]


SETUP_REPORT = {
    "sample_weight.min": [0.5, 1.0], "sample_weight.q05": [0.55, 1.0], "sample_weight.q25": [0.8, 1.0],
    "sample_weight.median": [1.0, 1.0], "sample_weight.q75": [1.2, 1.0], "sample_weight.q95": [1.4123456, 1.0],
    "sample_weight.max": [1.5, 1.0], "sample_weight.mean": [0.9876543, 1.0], "sample_weight.std": [0.3, 0.0],
    "sample_weight.histogram": {"edges": [0.0, 1.0, 2.0], "counts": [2, 4]},
}


def test_the_weight_summary_record_keeps_the_histogram_and_per_client_spread() -> None:
    (weights,) = WEIGHT_ANALYSIS.setup_summaries
    compact = setup_record(SETUP_REPORT, weights)

    assert compact == {"edges": [0.0, 1.0, 2.0], "counts": [2, 4], "q05": [0.55, 1.0], "median": [1.0, 1.0],
                       "q95": [1.412, 1.0], "mean": [0.9877, 1.0], "std": [0.3, 0.0]}
    assert setup_record({}, weights) is None
    assert setup_record({"sample_weight.histogram": {"edges": [], "counts": []}}, weights) is None
    run = expand_study(parse_study(spec_dict()))[0]
    record = run_record(run, {"history": history([0.4, 0.6]), "setup_report": SETUP_REPORT}, 0.5)
    assert record["weights"] == compact and json.loads(json.dumps(record)) == record


def test_pooled_histogram_rebins_onto_common_edges() -> None:
    # Run A: 2 weights in [0, 1), 4 in [1, 2]; run B: 6 in [0, 2), 2 in [2, 4]. Common edges
    # 0..4 in 4 bins; B's bins are split evenly over the two common bins each covers.
    records = [{"weights": {"edges": [0.0, 1.0, 2.0], "counts": [2, 4]}},
               {"weights": {"edges": [0.0, 2.0, 4.0], "counts": [6, 2]}}, {"algorithm": "no weights"}]

    edges, counts = pooled_histogram(records, "weights", bins=4)

    assert list(edges) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert list(counts) == pytest.approx([(2 + 3) / 2, (4 + 3) / 2, 0.5, 0.5])  # samples per run
    # All weights equal (a zero-width histogram): every sample lands in the bin of its value.
    edges, counts = pooled_histogram([{"weights": {"edges": [1.0, 1.0], "counts": [5]}},
                                      {"weights": {"edges": [0.0, 2.0], "counts": [4]}}], "weights", bins=2)
    assert list(counts) == pytest.approx([(0 + 2) / 2, (5 + 2) / 2])  # 1.0 lies in [1, 2]
    with pytest.raises(DataError, match="no run has the setup summary 'weights'"):
        pooled_histogram([{"algorithm": "fedavg"}], "weights")


def test_weight_histogram_plot_is_drawn_per_cell_and_algorithm(tmp_path: Path) -> None:
    spec = parse_study(spec_dict(plots=[{"kind": "weight_histogram"}]))
    runs = expand_study(spec)
    records = [run_record(run, {"history": history([0.4, 0.6]), "setup_report": SETUP_REPORT}, 0.5) for run in runs]

    names = draw_figures(spec, records, tmp_path, prefix="tiny-")

    assert names == ["tiny-weight_histogram.png"] and (tmp_path / names[0]).stat().st_size > 5000
    with pytest.raises(DataError, match="no run has the setup summary 'weights'"):
        draw_figures(spec, [dict(record, weights=None) for record in records], tmp_path)


def test_spread_scale_goes_logarithmic_only_for_a_wide_spread() -> None:
    assert spread_scale([0.1, 0.5, 1.0]) == ("linear", None)  # a factor 10
    assert spread_scale([0.001, 0.5]) == ("log", None)  # a factor 500
    assert spread_scale([0.0, 0.001, 0.5]) == ("symlog", 0.001)  # log cannot show the 0
    assert spread_scale([0.0, 0.0]) == ("linear", None)


def test_cpd_box_and_log_dots_are_drawn(tmp_path: Path) -> None:
    spec = parse_study(spec_dict(plots=[{"kind": "cpd_box"},
                                        {"kind": "dots", "metric": "final_accuracy", "log_y": True}]))
    records = [dict(run_record(run, {"history": history([0.4, 0.6])}, 0.5), cpd=[0.0, 0.002, 0.6])
               for run in expand_study(spec)]

    names = draw_figures(spec, records, tmp_path, prefix="tiny-")

    assert names == ["tiny-cpd_box.png", "tiny-final_accuracy_dots.png"]
    assert all((tmp_path / name).stat().st_size > 5000 for name in names)


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


def tiny_spec_file(tmp_path: Path, **changes: Any) -> Path:
    spec = {
        "name": "tiny",
        "base": copy.deepcopy(BASE),
        "grid": {"alpha": {"0.5": {"data.partition.alpha": 0.5}}},
        "algorithms": {"fedavg": {}, "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.5}}},
        "seeds": [0],
        "plots": [],
    }
    spec.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_tiny_study_end_to_end_results_file_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tiny_spec_file(
        tmp_path, labels={"fedavgm": "FedAvgM (beta 0.5)"}, baseline="fedavg",
        plots=[{"kind": "curves"}, {"kind": "dots", "metric": "final_accuracy"},
               {"kind": "vs_axis", "axis": "alpha", "metric": "final_accuracy"}])
    out, results = tmp_path / "out", tmp_path / "results" / "tiny.jsonl"
    runner = load_runner()
    command = [str(spec_path), "--no-mlflow", "--out", str(out), "--results", str(results)]

    assert runner.main(command) == 0

    run_ids = ["0.5__fedavg__d0s0", "0.5__fedavgm__d0s0"]
    for run_id in run_ids:
        metrics = json.loads((out / run_id / "metrics.json").read_text())
        assert metrics["rounds"] == 2 and len(metrics["history"]) == 2
        assert not (out / run_id / "checkpoint.pt").exists()
    records = load_records(results)
    assert [record["run"] for record in records] == run_ids
    first = json.loads((out / run_ids[0] / "metrics.json").read_text())
    assert records[0]["final_accuracy"] == first["final_accuracy"]
    assert records[0]["accuracy"] == [round(item["accuracy"], 6) for item in first["history"]]
    assert records[0]["commit"] == json.loads((out / run_ids[0] / "run_info.json").read_text())["git_commit"]
    assert isinstance(records[0]["dirty"], (bool, type(None))) and records[0]["overrides"] == []
    summary = json.loads((out / "summary.json").read_text())
    assert [row["algorithm"] for row in summary] == ["fedavg", "fedavgm"]
    assert summary[0]["final_accuracy"] == first["final_accuracy"] and summary[0]["runs"] == 1
    report = (out / "summary.md").read_text()
    assert "| 0.5 | FedAvgM (beta 0.5) | 1 (1×1) |" in report and "(baseline)" in report
    for name in ("curves_0.5.png", "final_accuracy_dots.png", "final_accuracy_vs_alpha.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in report

    # Resume: finished runs are reused, untouched; the results file is written again, identical.
    stamps = {run_id: (out / run_id / "metrics.json").stat().st_mtime_ns for run_id in run_ids}
    text = results.read_text()
    capsys.readouterr()
    assert runner.main(command) == 0
    assert "2 runs, 2 done, 0 to train" in capsys.readouterr().out
    assert {run_id: (out / run_id / "metrics.json").stat().st_mtime_ns for run_id in run_ids} == stamps
    assert results.read_text() == text

    # Another machine: no run folders, only the committed results file; nothing trains.
    fresh = tmp_path / "fresh"
    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(fresh), "--results", str(results)]) == 0
    assert "2 runs, 2 done (2 from" in capsys.readouterr().out
    assert not (fresh / run_ids[0]).exists() and results.read_text() == text


def test_runs_of_other_settings_are_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #17: after `--set train.rounds=1`, the plain command must not count those runs as done."""
    from fedplug.errors import ConfigError as Error

    spec_path = tiny_spec_file(tmp_path)
    out = tmp_path / "out"
    runner = load_runner()
    plain = [str(spec_path), "--no-mlflow", "--out", str(out)]

    assert runner.main([*plain, "--set", "train.rounds=1"]) == 0
    assert json.loads((out / "0.5__fedavg__d0s0" / "metrics.json").read_text())["rounds"] == 1

    capsys.readouterr()
    with pytest.raises(Error) as stopped:
        runner.main(plain)
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(f"2 run folders in {out} hold other settings than the study, e.g. run 0.5__fedavg__d0s0: "
                              "it was trained with train.rounds=1 but the study asks 2;")
    assert message.endswith("pass --redo-mismatched to train them again")
    assert "2 runs, 0 done, 2 of other settings, 0 to train" in capsys.readouterr().out

    # The report leaves them out instead of describing 1-round runs as the study.
    assert runner.main([*plain, "--report-only"]) == 0
    captured = capsys.readouterr()
    assert "no finished runs" in captured.out and "2 run folders of other settings are left out" in captured.err

    assert runner.main([*plain, "--redo-mismatched"]) == 0
    assert "deleted" in capsys.readouterr().out
    for algorithm in ("fedavg", "fedavgm"):
        assert json.loads((out / f"0.5__{algorithm}__d0s0" / "metrics.json").read_text())["rounds"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert [row["runs"] for row in summary] == [1, 1]


def test_the_study_folder_is_refused_when_it_holds_other_files_or_another_study(tmp_path: Path) -> None:
    from fedplug.errors import ConfigError as Error

    # Prepare: a folder of the user's files, and the finished folder of study 'tiny'.
    runner = load_runner()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "summary.md").write_text("my own summary")
    (notes / "thesis.tex").write_text("mine")
    finished = tmp_path / "finished"
    tiny = tiny_spec_file(tmp_path, algorithms={"fedavg": {}})
    assert runner.main([str(tiny), "--no-mlflow", "--out", str(finished), "--no-results"]) == 0
    other = tmp_path / "other" / "spec.yaml"
    other.parent.mkdir()
    other.write_text(tiny.read_text().replace("name: tiny", "name: other"))
    before = sorted(path.relative_to(finished).as_posix() for path in finished.rglob("*"))
    # Execute / Assert: both are refused in one line before anything is trained or written.
    with pytest.raises(Error, match="is not empty and was not written by fedplug") as refused:
        runner.main([str(tiny), "--no-mlflow", "--out", str(notes), "--no-results"])
    assert "\n" not in str(refused.value)
    assert (notes / "summary.md").read_text() == "my own summary" and len(list(notes.iterdir())) == 2
    with pytest.raises(Error, match="belongs to a different config"):
        runner.main([str(other), "--no-mlflow", "--out", str(finished), "--no-results"])
    assert sorted(path.relative_to(finished).as_posix() for path in finished.rglob("*")) == before
    # The study's own folder is welcome again (the report is rewritten, nothing retrained).
    assert runner.main([str(tiny), "--no-mlflow", "--out", str(finished), "--no-results"]) == 0


def test_a_checkpoint_of_another_federation_stops_the_runner_in_one_line(tmp_path: Path) -> None:
    import torch

    from fedplug.errors import ConfigError as Error

    spec_path = tiny_spec_file(tmp_path, algorithms={"fedavg": {}})
    out = tmp_path / "out"
    runner = load_runner()
    run = expand_study(parse_study(yaml.safe_load(spec_path.read_text())))[0]
    folder = out / run.run_id
    write_run_folder(folder, run.config.model_dump(mode="json"), metrics=False)  # same config.yaml ...
    torch.save({"version": 1, "fingerprint": "0" * 16, "history": []}, folder / "checkpoint.pt")  # ... other federation

    with pytest.raises(Error) as stopped:
        runner.main([str(spec_path), "--no-mlflow", "--out", str(out), "--no-results"])
    message = str(stopped.value)
    assert "\n" not in message and message.startswith(f"run {run.run_id}: checkpoint ")
    assert message.endswith(f"delete {folder} or pass --redo-mismatched to train it again")

    assert runner.main([str(spec_path), "--no-mlflow", "--out", str(out), "--no-results", "--redo-mismatched"]) == 0
    assert json.loads((folder / "metrics.json").read_text())["rounds"] == 2


SHIPPED = ["fedshift", "fedshift_tuned", "fedshift_partial", "fedshift_paper", "iwds", "iwds_tuned",
           "iwds_decay", "fedavgm", "fedgsp", "fedgsp_growth", "fedgsp_long", "fedgsp_tuned", "feddisk",
           "feddisk_tuned"]


FIVE_DRAWS = {"feddisk", "feddisk_tuned"}
"""Studies whose headline issue #23 allows at 5 partition draws rather than 10: FedDisk's
(a draw's density models, about 20 min of training here)."""


@pytest.mark.parametrize("name", [*SHIPPED, "faults"])
def test_shipped_study_specs_expand_with_enough_runs(name: str) -> None:
    from fedplug.config import read_yaml

    spec = parse_study(read_yaml(ROOT / "pipelines" / "studies" / f"{name}.yaml"), name)

    runs = expand_study(spec)

    assert [run.run_id for run in runs] == [run.run_id for run in planned_runs(spec)]
    assert {run.config.study.name for run in runs} == {name}
    # Issue #23 (the partition draw is the unit): headline runs cover >= 10 draws (5 in
    # FIVE_DRAWS), every other cell x algorithm >= 5 draws (the ablation cells); labels and
    # baseline name real algorithms.
    groups: dict[tuple[str, str], list[Any]] = {}
    for run in runs:
        groups.setdefault((run.cell_id, run.algorithm), []).append(run)
    for (_, algorithm), members in groups.items():
        draws, seeds = len({run.draw for run in members}), len({run.seed for run in members})
        if members[0].headline:
            assert draws >= 10 or (name in FIVE_DRAWS and draws >= 5), (algorithm, draws)
            headline_pairs = spec.headline.pairs if spec.headline and spec.headline.pairs else None
            assert len(members) == (len(headline_pairs) if headline_pairs else draws * seeds)
        else:
            assert draws >= 5, (algorithm, draws)
    assert spec.baseline in spec.algorithms or len(spec.algorithms) == 1
    assert set(spec.labels) == set(spec.algorithms)
    # An algorithm restricted to some cells (`cells:`) runs in exactly those; every headline
    # cell still has every headline algorithm; a variant paired with its own baseline
    # (`baselines:`) has at least 3 paired runs in every cell it runs in.
    for algorithm, cells in spec.cells.items():
        assert {cell for cell, name in groups if name == algorithm} == set(cells)
    headline_cells = (spec.headline.cells if spec.headline and spec.headline.cells else
                      [cell_id(cell) for cell in grid_cells(spec.grid)])
    for algorithm in (spec.headline.algorithms if spec.headline and spec.headline.algorithms else spec.algorithms):
        for cell in headline_cells:
            assert (cell, algorithm) in groups, (cell, algorithm)
    for algorithm, reference in spec.baselines.items():
        for (cell, name), members in groups.items():
            if name == algorithm:
                theirs = {(run.draw, run.seed) for run in groups[(cell, reference)]}
                assert len({(run.draw, run.seed) for run in members} & theirs) >= 3


def test_config_hash_is_the_sha256_of_the_sorted_comparable_config() -> None:
    # Written by hand: the ignored fields dropped, engine parallel compared as sequential,
    # {"data":{"seed":3},"train":{"engine":"sequential","seed":1}} -> sha256 -> 12 hex digits.
    document = {"study": {"name": "x"}, "tracking": {"enabled": False}, "data": {"seed": 3, "root": "/data"},
                "train": {"seed": 1, "engine": "parallel", "workers": 4}}

    assert config_hash(document) == "bb1a54d8dbd5"


@pytest.mark.parametrize("name", [*SHIPPED, "faults"])
def test_committed_records_carry_the_config_hash_of_their_run(name: str) -> None:
    """The runner reuses a committed record only when its ``config_hash`` is the hash of its
    run's config, so every committed record's hash must be what the study's expansion
    (with the record's own ``--set`` overrides) gives today."""
    from fedplug.config import read_yaml

    spec = parse_study(read_yaml(ROOT / "pipelines" / "studies" / f"{name}.yaml"), name)
    records = load_records(ROOT / "pipelines" / "studies" / "results" / f"{name}.jsonl")
    assert records, f"pipelines/studies/results/{name}.jsonl has no records"
    by_overrides: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for record in records:
        by_overrides.setdefault(tuple(record["overrides"]), []).append(record)

    stale = []
    for overrides, members in by_overrides.items():
        runs = {run.run_id: run for run in expand_study(spec, overrides=overrides)}
        for record in members:
            run = runs.get(record["run"])
            # A tuned run trains with its search's choice, which the record keeps (`tuned`).
            config = with_values(run.config, record["tuned"], None) if run is not None and record.get("tuned") else \
                getattr(run, "config", None)
            if config is None or config_hash(config.model_dump(mode="json")) != record["config_hash"]:
                stale.append(record["run"])

    assert not stale, f"{len(stale)} of {len(records)} committed records no longer match their run's config, e.g. {stale[:3]}"


@pytest.mark.slow
def test_a_study_is_one_parent_run_with_a_child_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec_path = tiny_spec_file(tmp_path, plots=[{"kind": "dots", "metric": "final_accuracy"}])
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
    assert sorted(run.info.run_name for run in children) == ["0.5__fedavg__d0s0", "0.5__fedavgm__d0s0"]
    for child in children:
        metrics = json.loads((out / child.info.run_name / "metrics.json").read_text())
        assert child.data.metrics["final_accuracy"] == pytest.approx(metrics["final_accuracy"])
        assert child.data.tags["study.alpha"] == "0.5" and child.info.status == "FINISHED"
        assert child.data.tags["study.draw"] == "0"
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "accuracy")]
        assert sorted(steps) == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert parent.data.metrics["0.5/fedavgm.final_accuracy"] == pytest.approx(summary[1]["final_accuracy"])
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"summary.md", "summary.json", "figures"} <= artifacts
    # The store's artifacts lie beside it, not in the current folder.
    assert parent.info.artifact_uri.startswith((store / "mlruns").as_uri())
    assert (store / "mlruns" / parent.info.run_id / "artifacts" / "summary.md").is_file()
