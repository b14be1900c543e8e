"""docs/results.md is generated from the committed study results (as docs/performance.md is
from benchmarks/results/), and the statistics behind its tables are right."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.errors import ConfigError, DataError
from fedplug.study.records import load_records
from fedplug.study.statistics import mean_std, paired_comparison, partition_comparison, plateaued, summarise
from fedplug.study.tables import partition_text, summary_table

ROOT = Path(__file__).resolve().parents[1]


def load_renderer() -> Any:
    path = ROOT / "pipelines" / "studies" / "render_results.py"
    module_spec = importlib.util.spec_from_file_location("render_results", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["render_results"] = module  # its dataclass resolves annotations through sys.modules
    module_spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_generator_renders_from_the_committed_results() -> None:
    renderer = load_renderer()

    rendered = renderer.render_page()

    assert (ROOT / "docs" / "results.md").read_text() == rendered, (
        "docs/results.md differs from the committed results and verdict fragments: "
        "run `python pipelines/studies/render_results.py`")


# A tiny hand-written results file: one cell, FedAvg in 4 runs (2 draws x 2 seeds), FedProx
# in 3 of them. Final accuracies:
#            (0,0)  (0,1)  (1,0)  (1,1)
#   fedavg   0.80   0.82   0.78   0.84    mean 0.81, sample std sqrt(0.002 / 3) = 0.025820
#   fedprox  0.85   0.82   0.80     -     mean 0.823333, sample std sqrt(0.00126667 / 2) = 0.025166
# FedProx - FedAvg per pair: +0.05 (win), 0 (tie), +0.02 (win): 2/1/0 of 3, mean +0.023333,
# sample std 0.025166.
FINAL = {
    "fedavg": {(0, 0): 0.80, (0, 1): 0.82, (1, 0): 0.78, (1, 1): 0.84},
    "fedprox": {(0, 0): 0.85, (0, 1): 0.82, (1, 0): 0.80},
}
REACHED = {("fedavg", 0, 0): 3, ("fedavg", 1, 1): 5, ("fedprox", 0, 0): 2, ("fedprox", 0, 1): 2, ("fedprox", 1, 0): 4}


def tiny_records() -> list[dict[str, Any]]:
    records = []
    for algorithm, values in FINAL.items():
        for (draw, seed), final in values.items():
            records.append({
                "run": f"0.1__{algorithm}__d{draw}s{seed}", "cell": {"alpha": "0.1"}, "algorithm": algorithm,
                "draw": draw, "seed": seed, "headline": True, "dataset": "synthetic", "rounds": 3,
                "final_accuracy": final, "last3_accuracy": final - 0.01, "best_accuracy": final + 0.01,
                "target": 0.8, "rounds_to_target": REACHED.get((algorithm, draw, seed)), "setup_rounds": 0,
                "bytes_to_target": 1000 if (algorithm, draw, seed) in REACHED else None, "total_bytes": 3000,
                "compute_seconds_model": 2.0, "train_seconds": 60.0, "accuracy": [0.5, 0.7, final],
                "commit": "abcdef1234567890", "dirty": False, "fedplug": "0.1.0", "config_hash": "x", "overrides": [],
            })
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_mean_std_and_paired_wins_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "tiny.jsonl"
    write_jsonl(path, tiny_records())

    rows = summarise(load_records(path), "final_accuracy", baseline="fedavg")

    fedavg, fedprox = rows
    assert (fedavg["runs"], fedavg["draws"], fedavg["seeds"], fedavg["reached"]) == (4, 2, 2, 2)
    assert fedavg["final_accuracy"] == pytest.approx(0.81)
    assert fedavg["final_accuracy_std"] == pytest.approx((0.002 / 3) ** 0.5)
    assert fedavg["rounds_to_target"] == pytest.approx(4.0)  # runs that reached it: 3 and 5
    assert fedavg["paired"] is None
    assert fedprox["final_accuracy"] == pytest.approx(0.823333, abs=1e-6)
    assert fedprox["final_accuracy_std"] == pytest.approx(0.025166, abs=1e-6)
    assert fedprox["best_accuracy"] == pytest.approx(0.833333, abs=1e-6)
    paired = fedprox["paired"]
    assert (paired["pairs"], paired["wins"], paired["ties"], paired["losses"]) == (3, 2, 1, 0)
    assert paired["difference"] == pytest.approx(0.023333, abs=1e-6)
    assert paired["difference_std"] == pytest.approx(0.025166, abs=1e-6)

    table = summary_table(rows, ["alpha"], 0.8, labels={"fedprox": "FedProx (mu 0.01)"}, baseline="fedavg")
    assert "| 0.1 | fedavg | 4 (2×2) | 0.8100 ± 0.0258 | 0.8200 ± 0.0258 | too short | 4 (2/4 reached) | 1.0 kB | (baseline) |  |" in table
    assert "| 0.1 | FedProx (mu 0.01) | 3 (2 draws, 2 seeds) | 0.8233 ± 0.0252 |" in table
    # Per draw, FedProx - FedAvg: draw 0 mean(0.05, 0) = 0.025, draw 1 0.02; over the 2
    # draws mean 0.0225, s = 0.005 / sqrt(2), t(0.975, 1) = 12.7062: half-width 0.03177.
    partitions = fedprox["partitions"]
    assert (partitions["partitions"], partitions["pairs"], partitions["won"]) == (2, 3, 2)
    assert partitions["difference"] == pytest.approx(0.0225)
    assert (partitions["low"], partitions["high"]) == pytest.approx((0.0225 - 0.0317655, 0.0225 + 0.0317655), abs=1e-6)
    assert "| +0.0225 [-0.0093, +0.0543] over 2 partitions, won 2 of 2 | 2/1/0 of 3 |" in table
    assert "vs fedavg: mean difference [95% interval] over partitions, partitions won" in table

    # The last-3-rounds headline is a different column, same machinery.
    last3 = summarise(load_records(path), "last3_accuracy", baseline="fedavg")
    assert last3[0]["last3_accuracy"] == pytest.approx(0.80) and last3[1]["paired"]["wins"] == 2


def test_the_clients_own_accuracy_can_be_the_headline_with_the_global_one_beside_it() -> None:
    """FedDisk's metric: ``headline_metric: final_client_accuracy`` compares the clients'
    own test accuracy draw by draw; ``columns: [final_accuracy]`` shows the global one."""
    from fedplug.study.spec import parse_study

    records = tiny_records()
    for record in records:  # the clients' accuracy ranks the other way round
        record["final_client_accuracy"] = 1.4 - record["final_accuracy"]
    rows = summarise(records, "final_client_accuracy", baseline="fedavg")

    # FedProx - FedAvg per draw: draw 0 mean(-0.05, 0) = -0.025, draw 1 -0.02.
    assert rows[1]["partitions"]["difference"] == pytest.approx(-0.0225)
    assert rows[1]["partitions"]["won"] == 0 and rows[1]["paired"]["losses"] == 2
    table = summary_table(rows, ["alpha"], 0.8, baseline="fedavg", columns=["final_accuracy"])
    header = table.splitlines()[0]
    # The best-over-rounds column is the global test set's, and says so beside this headline.
    assert "| best global acc (over rounds) |" in header and "best global" not in summary_table(
        summarise(records, "final_accuracy", baseline="fedavg"), ["alpha"], 0.8).splitlines()[0]
    assert "final client acc (mean ± std)" in header and header.endswith("| final acc | vs fedavg: mean difference "
                                                                          "[95% interval] over partitions, partitions won "
                                                                          "| runs won/tied/lost (same draw and seed) |")
    assert "| 0.1 | fedavg | 4 (2×2) | 0.5900 ± 0.0258 |" in table and "| 0.8100 ± 0.0258 |" in table
    spec = {"name": "s", "base": {}, "algorithms": {"a": {}}, "headline_metric": "final_client_accuracy",
            "columns": ["final_accuracy"]}
    assert parse_study(spec).headline_metric == "final_client_accuracy"


def test_plateau_rule_by_hand() -> None:
    # Best of the last 10 rounds against the best before them, tolerance 0.002.
    rising = [0.5, 0.6] + [0.6 + 0.001 * k for k in range(1, 11)]  # last 10 best 0.610: +0.010
    flat = [0.5, 0.7] + [0.7015] * 10  # +0.0015
    dipped = [0.5, 0.9] + [0.8] * 10  # the last rounds are worse: flat, not rising

    assert plateaued(rising) is False
    assert plateaued(flat) is True and plateaued(dipped) is True
    assert plateaued(flat, tolerance=0.001) is False
    assert plateaued([0.5] * 10) is None and plateaued([None] * 2 + [0.5] * 10) is None
    rows = summarise([
        {"run": f"c__a__d0s{seed}", "cell": {"x": "c"}, "algorithm": "a", "draw": 0, "seed": seed, "accuracy": curve}
        for seed, curve in enumerate([rising, flat, [0.5] * 3])
    ])
    assert (rows[0]["plateaued"], rows[0]["plateau_known"]) == (1, 2)


def test_partition_comparison_by_hand() -> None:
    # Three draws; draw 0 has two seeds. Differences: draw 0 mean(0.1, 0.1) = 0.1,
    # draw 1 -0.1, draw 2 0.3 (a seed-1 run of draw 2 without its reference is left out).
    method = {(0, 0): 0.5, (0, 1): 0.7, (1, 0): 0.6, (2, 0): 0.9, (2, 1): 0.95}
    reference = {(0, 0): 0.4, (0, 1): 0.6, (1, 0): 0.7, (2, 0): 0.6, (2, 1): None}

    result = partition_comparison(method, reference)

    # Mean 0.1; sample std of (0.1, -0.1, 0.3) = 0.2; t(0.975, 2) = 4.302653 (the t table);
    # half-width 4.302653 * 0.2 / sqrt(3) = 0.496828.
    assert (result["partitions"], result["pairs"], result["won"], result["tied"], result["lost"]) == (3, 4, 2, 0, 1)
    assert result["difference"] == pytest.approx(0.1)
    assert result["low"] == pytest.approx(0.1 - 0.496828, abs=1e-6)
    assert result["high"] == pytest.approx(0.1 + 0.496828, abs=1e-6)
    assert partition_text(result) == "+0.1000 [-0.3968, +0.5968] over 3 partitions, won 2 of 3"
    # A 90% interval is narrower (t(0.95, 2) = 2.919986) and says its level.
    narrow = partition_comparison(method, reference, confidence=0.90)
    assert narrow["high"] == pytest.approx(0.1 + 2.919986 * 0.2 / 3 ** 0.5, abs=1e-6)
    assert partition_text(narrow, digits=2) == "+0.10 [90% -0.24, +0.44] over 3 partitions, won 2 of 3"
    # One draw: no interval; none: nothing to say.
    single = partition_comparison({(0, 0): 0.5}, {(0, 0): 0.5})
    assert (single["partitions"], single["tied"], single["low"]) == (1, 1, None)
    assert partition_text(single) == "+0.0000 (no interval) over 1 partition, won 0 of 1"
    assert partition_text(partition_comparison({(0, 0): 0.5}, {})) == "no paired runs"


def test_statistics_edge_cases() -> None:
    assert mean_std([]) == (None, None) and mean_std([None, 0.5]) == (0.5, None)
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    result = paired_comparison({(0, 0): 0.5, (0, 1): 0.4, (1, 1): None}, {(0, 0): 0.6, (1, 1): 0.3})
    assert (result["pairs"], result["wins"], result["ties"], result["losses"]) == (1, 0, 0, 1)
    assert result["difference"] == pytest.approx(-0.1) and result["difference_std"] is None


def test_a_broken_results_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(tiny_records()[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"x\.jsonl:2: not JSON"):
        load_records(path)
    path.write_text(json.dumps({"run": "a"}) + "\n")
    with pytest.raises(DataError, match=r"x\.jsonl:1: a study record needs cell, algorithm, draw, seed"):
        load_records(path)


def tiny_layout(tmp_path: Path) -> Any:
    renderer = load_renderer()
    studies = tmp_path / "pipelines" / "studies"
    studies.mkdir(parents=True)
    spec = {
        "name": "tiny", "description": "A tiny study.",
        "base": {"study": {"target_accuracy": 0.8}, "data": {"seed": 0}, "train": {"rounds": 3}},
        "grid": {"alpha": {"0.1": {"data.partition.alpha": 0.1}}},
        "algorithms": {"fedavg": {}, "fedprox": {}}, "labels": {"fedprox": "FedProx (mu 0.01)"},
        "baseline": "fedavg", "draws": [0, 1], "seeds": [0, 1], "plots": [{"kind": "curves"}],
    }
    (studies / "tiny.yaml").write_text(yaml.safe_dump(spec))
    (studies / "verdicts").mkdir()
    (studies / "verdicts" / "_intro.md").write_text("# Tiny page\n\nIntro.\n\n{{status_table}}\n")
    (studies / "verdicts" / "tiny.md").write_text("## Tiny\n\n{{plan}}\n\n{{results}}\n\n**Verdict.** Prose.\n")
    return renderer, renderer.Layout(tmp_path)


def test_a_study_without_results_shows_no_numbers(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)

    page = renderer.render_page(layout)

    assert page.startswith("# Tiny page\n\n<!-- Generated by pipelines/studies/render_results.py")
    assert "**Results: not yet re-run on the landed code.** `pipelines/studies/results/tiny.jsonl` holds no runs yet." in page
    assert "| tiny | 0 / 8 | - | - | no | - | not yet re-run | - |" in page
    assert "2 partition draws (data.seed [0, 1]) × 2 training seeds (train.seed [0, 1])" in page
    assert "±" not in page and "**Verdict.** Prose." in page
    assert "; 3 rounds; target 80%" in page


def test_the_status_and_cost_lines_give_the_wall_time_of_the_runs_clocks(tmp_path: Path) -> None:
    """Two runs at once for 10 minutes, then one alone for 5 (and 5 runs without a clock):
    15 minutes of wall time, at most 2 at once, against 7 x 60 s of summed training time."""
    renderer, layout = tiny_layout(tmp_path)
    records = tiny_records()
    for record, (start, end) in zip(records, [("10:00", "10:10"), ("10:00", "10:10"), ("10:20", "10:25")]):
        record.update(started_at=f"2026-11-26T{start}:00+00:00", finished_at=f"2026-11-26T{end}:00+00:00", host_cores=2)
    write_jsonl(layout.results / "tiny.jsonl", records)

    page = renderer.render_page(layout)

    assert "| 15 min, 2 cores (4 runs not recorded) | commit `abcdef1`" in page
    cost = renderer.cost_line(renderer.load_spec(layout, "tiny"), records)
    assert ("Wall time of the runs 15 min on a machine of 2 cores, at most 2 runs at once (from the 3 runs' start "
            "and end times; 4 runs trained before the runner kept them are not counted).") in cost


def test_the_plan_counts_the_runs_whose_algorithm_or_cell_sets_other_rounds(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.root / "pipelines" / "studies" / "tiny.yaml").read_text())
    spec["grid"]["alpha"]["0.1-long"] = {"data.partition.alpha": 0.1, "train.rounds": 30}
    spec["algorithms"]["fedprox"] = {"rounds": 5}
    (layout.root / "pipelines" / "studies" / "tiny.yaml").write_text(yaml.safe_dump(spec))

    page = renderer.render_page(layout)

    # 16 runs: the cell's rounds win over the algorithm's (fedavg and fedprox in 0.1-long:
    # 30, 8 runs); fedavg in 0.1: the base's 3 (4 runs, first in plan order); fedprox in
    # 0.1: 5 (4 runs).
    assert "; 30 rounds (3 in 4 runs, 5 in 4 runs); target 80%" in page


def test_the_plan_names_an_algorithms_own_pairs(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.root / "pipelines" / "studies" / "tiny.yaml").read_text())
    spec.update(headline={"algorithms": ["fedavg"]}, other_pairs=[[0, 0], [1, 1]], pairs={"fedprox": [[1, 0]]})
    (layout.root / "pipelines" / "studies" / "tiny.yaml").write_text(yaml.safe_dump(spec))

    page = renderer.render_page(layout)

    # fedavg: 2 draws x 2 seeds; fedprox: its one pair, so 5 runs in all.
    assert ("1 grid cell × 2 algorithms, 5 runs; headline (every cell, algorithms fedavg): 2 partition draws "
            "(data.seed [0, 1]) × 2 training seeds (train.seed [0, 1]); the other 1 runs: (draw, seed) pairs "
            "[[0, 0], [1, 1]]; FedProx (mu 0.01): (draw, seed) pairs [[1, 0]]") in page


def test_the_plan_and_status_tell_headline_pairs_as_blocks_of_draws(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.root / "pipelines" / "studies" / "tiny.yaml").read_text())
    spec.update(draws=[0, 1, 2], headline={"algorithms": ["fedavg"], "pairs": [[0, 0], [0, 1], [1, 0], [2, 0]]},
                other_pairs=[[0, 0], [1, 1]])
    (layout.root / "pipelines" / "studies" / "tiny.yaml").write_text(yaml.safe_dump(spec))
    # fedavg's draw 2 (seed 0), a fourth headline run beside the tiny records' draws 0 and 1.
    records = tiny_records()
    write_jsonl(layout.results / "tiny.jsonl", [*records, dict(records[0], run="0.1__fedavg__d2s0", draw=2, seed=0)])

    page = renderer.render_page(layout)

    # fedavg: the 4 headline pairs; fedprox: other_pairs, so 6 runs in all. Draw 0 has
    # seeds 0 and 1 in the records, draws 1 and 2 seed 0 (the tiny records' fedavg d1s1 is
    # not planned any more, so not counted).
    assert ("1 grid cell × 2 algorithms, 6 runs; headline (every cell, algorithms fedavg): 3 partition draws: "
            "data.seed [0] × train.seed [0, 1], data.seed [1, 2] × train.seed [0]; the other 2 runs") in page
    assert "| tiny | 5 / 6 | 3 | 3 draws x 1-2 seeds;" in page


def test_a_study_with_results_cites_its_file_and_commit(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    write_jsonl(layout.results / "tiny.jsonl", tiny_records())

    page = renderer.render_page(layout)

    assert ("**Results** (source: [`pipelines/studies/results/tiny.jsonl`](../pipelines/studies/results/tiny.jsonl), "
            "7 of 8 planned runs, commit `abcdef1` (fedplug 0.1.0); summed training time 7 min") in page
    assert "**Incomplete: 1 planned runs are missing**" in page
    # 3 rounds are too short to tell a plateau; no tune: section; no clock in these records.
    assert "| tiny | 7 / 8 | 3 | 2 draws x 2 seeds; 0 of 7 plateaued | no | not recorded | commit `abcdef1` (fedplug 0.1.0) |" in page
    assert "| 0.1 | FedProx (mu 0.01) | 3 (2 draws, 2 seeds) | 0.8233 ± 0.0252 |" in page
    # Figures: linked once drawn, announced before.
    assert "1 figures not drawn yet" in page and "](img/studies/tiny-curves_0.1.png)" not in page
    layout.figures.mkdir(parents=True)
    (layout.figures / "tiny-curves_0.1.png").write_bytes(b"png")
    assert "](img/studies/tiny-curves_0.1.png)" in renderer.render_page(layout)
    assert renderer.render_page(layout) == renderer.render_page(layout)  # no timestamp

    dirty = [dict(record, dirty=True) for record in tiny_records()]
    dirty[0]["commit"] = "1234567aaaa"
    write_jsonl(layout.results / "tiny.jsonl", dirty)
    assert ("commits `1234567` with uncommitted changes (1 runs), `abcdef1` with uncommitted changes (6 runs)"
            in renderer.render_page(layout))


def test_an_unknown_placeholder_is_named(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    (layout.verdicts / "tiny.md").write_text("{{table}}\n")

    with pytest.raises(ConfigError, match=r"tiny\.md: unknown placeholder \{\{table\}\}; known: \{\{plan\}\}, \{\{results\}\}, \{\{cost\}\}"):
        renderer.render_page(layout)


def test_a_verdict_can_ask_for_a_paired_comparison_the_table_does_not_show(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    write_jsonl(layout.results / "tiny.jsonl", tiny_records())
    (layout.verdicts / "tiny.md").write_text("{{results}}\n\n{{paired fedavg vs fedprox}}\n")

    page = renderer.render_page(layout)

    # FedAvg - FedProx on the 3 shared (draw, seed) pairs: -0.05, 0, -0.02 (see FINAL).
    assert "**fedavg against FedProx (mu 0.01)** (final acc; per partition draw, the mean over its seeds" in page
    assert "| alpha | mean difference [95% interval] over partitions, partitions won | runs won/tied/lost |" in page
    assert "| 0.1 | -0.0225 [-0.0543, +0.0093] over 2 partitions, won 0 of 2 | 0/1/2 of 3 |" in page


def test_a_paired_comparison_against_one_fixed_cell(tmp_path: Path) -> None:
    # Two cells; FedAvg in cell 0.5 is FedAvg in cell 0.1 plus 0.01, except (1, 1): -0.02.
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.studies / "tiny.yaml").read_text())
    spec["grid"]["alpha"]["0.5"] = {"data.partition.alpha": 0.5}
    (layout.studies / "tiny.yaml").write_text(yaml.safe_dump(spec))
    records = tiny_records()
    shifted = {(0, 0): 0.01, (0, 1): 0.01, (1, 0): 0.01, (1, 1): -0.02}
    for record in [r for r in records if r["algorithm"] == "fedavg"]:
        moved = dict(record, cell={"alpha": "0.5"}, run=record["run"].replace("0.1__", "0.5__"))
        moved["final_accuracy"] = record["final_accuracy"] + shifted[(record["draw"], record["seed"])]
        records.append(moved)
    write_jsonl(layout.results / "tiny.jsonl", records)
    (layout.verdicts / "tiny.md").write_text("{{paired fedavg vs fedavg@0.1}}\n")

    page = renderer.render_page(layout)

    assert "**fedavg against fedavg in cell 0.1**" in page
    assert "| 0.1 | +0.0000 [+0.0000, +0.0000] over 2 partitions, won 0 of 2 | 0/4/0 of 4 |" in page
    # +0.01 three times and -0.02 once: draw 0 mean 0.01, draw 1 (0.01 - 0.02) / 2 = -0.005;
    # over the draws mean 0.0025, s = 0.015 / sqrt(2), half-width 12.7062 * 0.0075 = 0.0953.
    assert "| 0.5 | +0.0025 [-0.0928, +0.0978] over 2 partitions, won 1 of 2 | 3/0/1 of 4 |" in page

    (layout.verdicts / "tiny.md").write_text("{{paired fedavg vs fedavg@0.3}}\n")
    with pytest.raises(ConfigError, match=r"'0\.3' is not one of the cells of pipelines/studies/tiny\.yaml \(0\.1, 0\.5\)"):
        renderer.render_page(layout)


def test_the_cost_line_sums_the_measured_time_per_model(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.studies / "tiny.yaml").read_text())
    spec["base"]["train"]["model"] = {"name": "mlp"}
    spec["algorithms"]["fedprox"] = {"model": {"name": "cnn_mnist"}}
    (layout.studies / "tiny.yaml").write_text(yaml.safe_dump(spec))
    (layout.verdicts / "tiny.md").write_text("**Cost.** {{cost}}\n")
    assert "**Cost.** 8 runs planned; none committed yet" in renderer.render_page(layout)

    write_jsonl(layout.results / "tiny.jsonl", tiny_records())  # 60 s a run: 4 FedAvg, 3 FedProx

    assert ("**Cost.** 7 of 8 runs committed; measured training time summed over them 7 min "
            "(mlp: 4 runs, 4 min; cnn_mnist: 3 runs, 3 min), on the machine") in renderer.render_page(layout)

    # Two runs computed a setup phase (3 and 9 min), one loaded its own from a cache (0.02 s):
    # 12 min more.
    records = tiny_records()
    records[0]["setup_seconds"], records[4]["setup_seconds"], records[5]["setup_seconds"] = 180.0, 540.0, 0.02
    write_jsonl(layout.results / "tiny.jsonl", records)

    assert ("(mlp: 4 runs, 4 min; cnn_mnist: 3 runs, 3 min); setup phases 12 min more, in 2 runs (3.0 to "
            "9.0 min each); 1 run took under 1 s for theirs (a cached result), on the machine") in renderer.render_page(layout)


def test_a_paired_comparison_of_an_unknown_algorithm_is_named(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    (layout.verdicts / "tiny.md").write_text("{{paired fedavg vs fedprx}}\n")
    with pytest.raises(ConfigError, match=r"tiny\.md: \{\{paired fedavg vs fedprx\}\}: 'fedprx' is not one of the "
                                          r"algorithms of pipelines/studies/tiny\.yaml \(fedavg, fedprox\)"):
        renderer.render_page(layout)

    (layout.verdicts / "tiny.md").write_text("{{paired fedavg}}\n")
    with pytest.raises(ConfigError, match=r"unknown placeholder \{\{paired fedavg\}\}; known: \{\{plan\}\}, "
                                          r"\{\{results\}\}, \{\{cost\}\}, \{\{paired A vs B\}\}, \{\{paired A vs B@CELL\}\}"):
        renderer.render_page(layout)


def test_figures_are_drawn_from_the_committed_records(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    write_jsonl(layout.results / "tiny.jsonl", tiny_records())

    written = renderer.draw_all_figures(layout)

    assert [path.name for path in written] == ["tiny-curves_0.1.png"] and written[0].stat().st_size > 5000
    shutil.rmtree(layout.figures)


def test_restricted_cells_and_variant_baselines_reach_the_page(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    spec = yaml.safe_load((layout.studies / "tiny.yaml").read_text())
    spec["grid"]["alpha"]["1"] = {"data.partition.alpha": 1.0}
    spec["algorithms"].update({"fedavg-cnn": {}, "fedprox-cnn": {}})
    spec["cells"] = {"fedavg-cnn": ["0.1"], "fedprox-cnn": ["0.1"]}
    spec["baselines"] = {"fedprox-cnn": "fedavg-cnn"}
    (layout.studies / "tiny.yaml").write_text(yaml.safe_dump(spec))
    cnn = [dict(record, run=record["run"].replace(f"__{record['algorithm']}__", f"__{record['algorithm']}-cnn__"),
                algorithm=record["algorithm"] + "-cnn") for record in tiny_records()]
    write_jsonl(layout.results / "tiny.jsonl", tiny_records() + cnn)

    page = renderer.render_page(layout)

    # 2 cells x 2 algorithms x 4 runs + the CNN pair's 4 runs each in cell 0.1 only.
    assert "2 grid cells × 4 algorithms, 24 runs" in page and "| tiny | 14 / 24 |" in page
    assert "only in some cells: fedavg-cnn in 0.1, fedprox-cnn in 0.1" in page
    assert "paired against fedavg; except fedprox-cnn against fedavg-cnn" in page
    # fedprox-cnn's finals equal fedprox's and fedavg-cnn's fedavg's: the same paired wins, named.
    assert "| 0.1 | fedprox-cnn | 3 (2 draws, 2 seeds) | 0.8233 ± 0.0252 |" in page
    assert "| +0.0225 [-0.0093, +0.0543] over 2 partitions, won 2 of 2 vs fedavg-cnn | 2/1/0 of 3 |" in page
    assert "vs baseline (fedavg unless named): mean difference [95% interval] over partitions" in page


# ------------------------------------------------ record fields are data, not Markdown (issue 29)

INJECTION = "<img src=x onerror=alert(1)> | injected | [click](javascript:alert(1))"


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("fedplug", INJECTION, "fedplug version '<img src=x onerror=alert(1)> | injected | [click](javascrip... "
                               "is not a PEP 440 version (such as 0.1.0)"),
        ("commit", "abc`def`1234", "commit 'abc`def`1234' is not a git commit (7 to 40 lowercase hex digits)"),
        ("commit", "abcdef1\n| forged | row |", "is not a git commit"),
        ("cell", {"alpha": "<b>0.1</b>"}, "its cell is not the cell of run 0.1__fedavg__d0s0 in the spec"),
        ("algorithm", "[click](javascript:alert(1))", "its algorithm is not the algorithm of run"),
        ("train_seconds", "<img src=x>", "train_seconds '<img src=x>' is not a number"),
        ("dirty", "yes", "dirty 'yes' is not true or false"),
    ],
)
def test_a_record_field_the_page_cannot_show_safely_stops_the_renderer_in_one_line(
    tmp_path: Path, field: str, value: Any, problem: str
) -> None:
    renderer, layout = tiny_layout(tmp_path)
    records = tiny_records()
    records[0][field] = value
    write_jsonl(layout.results / "tiny.jsonl", records)

    with pytest.raises(DataError) as error:
        renderer.render_page(layout)

    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("pipelines/studies/results/tiny.jsonl: run '0.1__fedavg__d0s0': ")
    assert problem in message
    assert message.endswith("; restore the file from git or re-run the study")


def test_valid_commits_and_versions_pass_the_check(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    records = tiny_records()
    for record, (commit, version) in zip(records, [
        ("abcdef1", "0.1.0"), ("a" * 40, "1.0.0rc1"), ("0123456789", "2!1.0.post2.dev3+g1a2b.dirty"),
        (None, None), ("abcdef1", "v0.2"), ("abcdef1", "0.1.0"), ("abcdef1", "0.1.0"),
    ]):
        record.update(commit=commit, fedplug=version)
    write_jsonl(layout.results / "tiny.jsonl", records)

    page = renderer.render_page(layout)

    assert r"(fedplug 0.1.0, 1.0.0rc1, 2\!1.0.post2.dev3\+g1a2b.dirty, v0.2)" in page and "`unknown` (1 runs)" in page


def test_every_record_field_that_reaches_the_page_is_escaped(tmp_path: Path) -> None:
    # Overrides are free text by design (the runner's --set arguments): shown, never rendered.
    renderer, layout = tiny_layout(tmp_path)
    records = tiny_records()
    override = "train.x=`a` | " + INJECTION + "\n| forged | row |"
    for record in records:
        record["overrides"] = [override]
    write_jsonl(layout.results / "tiny.jsonl", records)

    page = renderer.render_page(layout)

    results_line = next(line for line in page.splitlines() if line.startswith("**Results**"))
    assert results_line.endswith(
        " Run with ``--set train.x=`a` | " + INJECTION + " | forged | row |``. **Incomplete: 1 planned runs are "
        "missing** (resume with `python pipelines/studies/run_study.py pipelines/studies/tiny.yaml`); the table "
        "shows the runs that finished.")
    assert "\n| forged | row |" not in page


def test_markdown_text_and_code_span_escape_what_markdown_would_render() -> None:
    renderer = load_renderer()

    assert renderer.markdown_text(INJECTION + "\n`x`") == (
        r"&lt;img src=x onerror=alert\(1\)&gt; \| injected \| \[click\]\(javascript\:alert\(1\)\) \`x\`")
    assert renderer.markdown_text("0.1.0") == "0.1.0"
    assert renderer.code_span("a``b") == "```a``b```"
    assert renderer.code_span("`x|y`", in_table=True) == r"`` `x\|y` ``"
