"""docs/benchmark.md is generated from the benchmark's records (issue 40, item 5): on a
tiny synthetic benchmark with known differences the page calls the right method
significant after Holm, ranks it first, draws the heatmap, quotes its summary from its
tables, and ``render_benchmark.py --check`` notices one changed record."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedplug.errors import DataError
from fedplug.study.benchmark_heatmap import draw_heatmap, drawn_digest, heatmap_data, heatmap_digest
from fedplug.study.benchmark_numbers import benchmark_tables
from fedplug.study.benchmark_page import is_edge, load_trials, value_text
from fedplug.study.spec import ParamRange, parse_study

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("iid", "lda0.1")
DRAWS = list(range(10))
LR_GRID = [0.05, 0.1, 0.2, 0.5, 1.0]
SPEC = {
    "name": "benchmark",
    "description": "A tiny benchmark: 3 methods x 2 skew families x 10 draws.",
    "base": {"study": {"target_accuracy": 0.9}, "data": {"seed": 0}, "train": {"rounds": 30}},
    "grid": {"family": {"iid": {"data.partition": {"name": "iid"}},
                        "lda0.1": {"data.partition": {"name": "dirichlet_class", "alpha": 0.1}}}},
    "algorithms": {"fedavg": {}, "better": {}, "same": {}},
    "labels": {"fedavg": "FedAvg", "better": "Better", "same": "Same"},
    "baseline": "fedavg",
    "draws": DRAWS,
    "seeds": [0],
    "tune": {"sampler": "grid", "per_cell": True, "params": {"train.optimizer.lr": LR_GRID}},
}
CHOSEN_LR = {"fedavg": 0.2, "better": 1.0, "same": 0.2}
"""Better's choice sits at the top of the grid: the page marks it (edge)."""


def load_renderer() -> Any:
    path = ROOT / "pipelines" / "studies" / "render_benchmark.py"
    module_spec = importlib.util.spec_from_file_location("render_benchmark", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["render_benchmark"] = module
    module_spec.loader.exec_module(module)
    return module


def final_accuracies() -> dict[tuple[str, str, int], float]:
    """FedAvg 0.80 + 0.01 x draw (+0.05 in iid); Better = FedAvg + 0.05 + noise (sd 0.002);
    Same = FedAvg + noise whose mean over the 10 draws is exactly 0 (p = 1)."""
    rng = np.random.default_rng(7)
    values = {}
    for family in FAMILIES:
        same_noise = rng.normal(0, 0.002, len(DRAWS))
        same_noise -= same_noise.mean()
        for draw in DRAWS:
            fedavg = 0.80 + 0.01 * draw + (0.05 if family == "iid" else 0.0)
            values[(family, "fedavg", draw)] = fedavg
            values[(family, "better", draw)] = fedavg + 0.05 + float(rng.normal(0, 0.002))
            values[(family, "same", draw)] = fedavg + float(same_noise[draw])
    return values


def record(family: str, method: str, draw: int, final: float, rising: bool = False) -> dict[str, Any]:
    """One run's record; its curve flattens by round 10, or, ``rising``, still climbs 0.002 a round."""
    curve = [round(final - (0.002 * (29 - round_) if rising else 0.3 * 0.5 ** round_), 6) for round_ in range(30)]
    return {
        "run": f"{family}__{method}__d{draw}s0", "cell": {"family": family}, "algorithm": method, "draw": draw,
        "seed": 0, "headline": True, "dataset": "synthetic", "rounds": 30, "final_accuracy": round(final, 6),
        "best_accuracy": max(curve), "target": 0.9, "accuracy": curve, "commit": "abcdef1234567890", "dirty": False,
        "fedplug": "0.1.0", "overrides": [], "tuned": {"train.optimizer.lr": CHOSEN_LR.get(method, 0.2)},
        "tuning": {"value": 0.9, "trials": 5, "pruned": 0, "tuned_on": f"{family}__{method}__d100s0"},
    }


def trial_lines() -> list[dict[str, Any]]:
    """5 trials per method and family; the chosen rate scores best (0.91)."""
    return [{"study": "benchmark", "cell": {"family": family}, "algorithm": method, "trial": number,
             "values": {"train.optimizer.lr": lr}, "score": 0.91 if lr == CHOSEN_LR[method] else 0.85 + 0.01 * number,
             "state": "complete"}
            for family in FAMILIES for method in SPEC["algorithms"] for number, lr in enumerate(LR_GRID)]


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def benchmark_files(tmp_path: Path, drop: set[tuple[str, str, int]] = frozenset(),  # type: ignore[assignment]
                    spec: dict[str, Any] = SPEC, more: list[dict[str, Any]] = ()) -> list[str]:  # type: ignore[assignment]
    """The tiny benchmark's spec, records (and ``more``) and trials in ``tmp_path``; the
    renderer's options."""
    (tmp_path / "benchmark.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    write_jsonl(tmp_path / "results" / "benchmark.jsonl",
                [record(family, method, draw, final) for (family, method, draw), final in final_accuracies().items()
                 if (family, method, draw) not in drop] + list(more))
    write_jsonl(tmp_path / "results" / "benchmark.trials.jsonl", trial_lines())
    return ["--spec", str(tmp_path / "benchmark.yaml"), "--results", str(tmp_path / "results" / "benchmark.jsonl"),
            "--page", str(tmp_path / "docs" / "benchmark.md")]


def rendered(tmp_path: Path, **files: Any) -> str:
    options = benchmark_files(tmp_path, **files)
    assert load_renderer().main(options) == 0
    return (tmp_path / "docs" / "benchmark.md").read_text()


def table_row(page: str, family: str, method: str) -> list[str]:
    """The cells of ``method``'s row in ``family``'s comparison table."""
    section = page.split(f"### `{family}`")[1].split("###")[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {method} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_better_method_is_significant_after_holm_and_the_equal_one_is_not(tmp_path: Path) -> None:
    page = rendered(tmp_path)
    tables = benchmark_tables(parse_study(SPEC), [record(*key, final) for key, final in final_accuracies().items()])

    for family in FAMILIES:
        better, same = tables.comparisons[(family, "better")], tables.comparisons[(family, "same")]
        assert better["significant"] and better["p_holm"] <= 0.05
        assert better["difference"] == pytest.approx(0.05, abs=0.002)
        assert not same["significant"] and same["p_holm"] == pytest.approx(1.0)
        assert better["family_size"] == 4  # 2 methods x 2 families, one Holm family
        better_row, same_row = table_row(page, family, "Better"), table_row(page, family, "Same")
        # method | draws | mean (sd) | difference [95%] | simultaneous | p | Holm p | verdict | won | plateau
        assert better_row[7] == "beats" and better_row[8] == "10 of 10"
        assert better_row[6] == "< 0.0001" or float(better_row[6]) <= 0.05
        assert same_row[6] == "1.0000" and same_row[7] == "no"
        assert same_row[3].startswith("+0.0000 [")  # never "-0.0000"
        assert table_row(page, family, "FedAvg (reference)")[9] == "flat 10"


def test_the_ranks_put_the_better_method_first(tmp_path: Path) -> None:
    page = rendered(tmp_path)

    for family in FAMILIES:
        section = page.split(f"### `{family}`")[1].split("###")[0]
        assert "| 1 | Better | 1.00 [1.00, 1.00] |" in section
        assert re.search(r"Friedman's test: χ² = [0-9.]+, p = (< 0\.0001|0\.0\d+); Nemenyi's critical difference "
                         r"at α = 0\.05: 1\.05", section)  # 2.343 * sqrt(3 * 4 / (6 * 10)) = 1.048


def test_the_heatmap_is_written_and_check_passes_then_fails_after_one_record_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    renderer = load_renderer()
    options = benchmark_files(tmp_path)
    assert renderer.main(options) == 0
    heatmap = tmp_path / "docs" / "img" / "benchmark_heatmap.png"
    assert heatmap.read_bytes().startswith(b"\x89PNG")
    assert "![methods × families" in (tmp_path / "docs" / "benchmark.md").read_text()
    assert renderer.main([*options, "--check"]) == 0

    results = tmp_path / "results" / "benchmark.jsonl"
    lines = results.read_text().splitlines()
    changed = json.loads(lines[0])
    changed["final_accuracy"] += 0.01
    results.write_text("\n".join([json.dumps(changed), *lines[1:]]) + "\n")
    capsys.readouterr()

    assert renderer.main([*options, "--check"]) == 1
    message = capsys.readouterr().err
    assert message.count("\n") == 1, message
    assert "benchmark.md differs in" in message and "benchmark_heatmap.png was drawn from other data" in message


def test_check_compares_the_heatmap_by_its_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    renderer = load_renderer()
    options = benchmark_files(tmp_path)
    renderer.main(options)
    heatmap = tmp_path / "docs" / "img" / "benchmark_heatmap.png"
    first = heatmap.read_bytes()
    tables = benchmark_tables(parse_study(SPEC), [record(*key, final) for key, final in final_accuracies().items()])
    assert drawn_digest(heatmap) == heatmap_digest(heatmap_data(tables))

    renderer.main(options)  # the same data draws the same bytes (no timestamp, no Software chunk)
    assert heatmap.read_bytes() == first
    other = heatmap_data(tables)
    other["values"][0][0] += 0.01  # a figure drawn from other numbers, the page left as it is
    draw_heatmap(other, heatmap)
    capsys.readouterr()
    assert renderer.main([*options, "--check"]) == 1
    assert capsys.readouterr().err.startswith(f"{heatmap} was drawn from other data")


def test_what_to_use_when_quotes_the_numbers_of_the_tables(tmp_path: Path) -> None:
    page = rendered(tmp_path)
    summary = page.split("## What to use when")[1].split("## Families")[0]
    tables = page.split("## Families")[1]

    for family in FAMILIES:
        sentence = next(line for line in summary.splitlines() if line.startswith(f"- `{family}`:"))
        assert "**Better** (" in sentence and "beats FedAvg after correction" in sentence
        assert "Same" not in sentence and "ranked first: Better (average rank 1.00 [1.00, 1.00])" in sentence
        numbers = re.findall(r"[+-]?\d+\.\d+", sentence)
        assert len(numbers) >= 6
        for quoted in numbers:
            assert quoted in tables, f"{quoted} is quoted in the summary but in no table"
        assert ", ".join(table_row(page, family, "Better")[3:4]) in sentence


def test_an_incomplete_cell_is_shown_as_such_and_not_compared(tmp_path: Path) -> None:
    page = rendered(tmp_path, drop={("lda0.1", "better", draw) for draw in (7, 8, 9)})

    row = table_row(page, "lda0.1", "Better")
    assert row[1] == "7 of 10" and row[3] == "incomplete (7 of 10 draws)" and row[7] == "-"
    sentence = next(line for line in page.splitlines() if line.startswith("- `lda0.1`:"))
    assert "none beats FedAvg after correction" in sentence and "1 method incomplete, not compared" in sentence
    assert "Not ranked (incomplete): Better." in page
    assert "simultaneous interval (Bonferroni, m = 3)" in page  # 3 complete comparisons form the family


def test_the_searches_show_trials_best_score_and_edges(tmp_path: Path) -> None:
    page = rendered(tmp_path)
    searches = page.split("## Tuned values and searches")[1]

    assert "| `iid` | Better | 1 | 5 (5 / 0 / 0) | 0.9100 | `train.optimizer.lr` 1 (edge) | yes |" in searches
    assert "| `lda0.1` | FedAvg | 1 | 5 (5 / 0 / 0) | 0.9100 | `train.optimizer.lr` 0.2 | yes |" in searches
    assert "Trials per method within each family (each method's last search): equal." in searches


def test_a_search_rerun_on_a_widened_space_is_shown_after_the_first(tmp_path: Path) -> None:
    options = benchmark_files(tmp_path)
    widened = [{**trial, "fingerprint": "second", "values": {"train.optimizer.lr": 2.0 if trial["score"] == 0.91 else 0.5},
                "space": {"train.optimizer.lr": [0.5, 1.0, 2.0, 5.0, 10.0]}, "edge": {"train.optimizer.lr": False}}
               for trial in trial_lines() if trial["cell"] == {"family": "iid"} and trial["algorithm"] == "better"]
    write_jsonl(tmp_path / "results" / "benchmark.trials.jsonl",
                [{**trial, "fingerprint": "first"} for trial in trial_lines()] + widened)
    assert load_renderer().main(options) == 0
    searches = (tmp_path / "docs" / "benchmark.md").read_text().split("## Tuned values and searches")[1]

    assert "| `iid` | Better | 1 | 5 (5 / 0 / 0) | 0.9100 | `train.optimizer.lr` 1 (edge) | yes |" in searches
    assert "| `iid` | Better | 2 | 5 (5 / 0 / 0) | 0.9100 | `train.optimizer.lr` 2 | - |" in searches


def test_unequal_tuning_budgets_within_a_family_are_named(tmp_path: Path) -> None:
    options = benchmark_files(tmp_path)
    trials = [trial for trial in trial_lines()
              if not (trial["cell"] == {"family": "iid"} and trial["algorithm"] == "better" and trial["trial"] < 2)]
    write_jsonl(tmp_path / "results" / "benchmark.trials.jsonl", trials)
    assert load_renderer().main(options) == 0
    page = (tmp_path / "docs" / "benchmark.md").read_text()

    assert ("**Unequal trials per method within a family** (each method's last search): "
            "`iid`: FedAvg 5, Better 3, Same 5.") in page
    assert "| `iid` | Better | 1 | 3 (3 / 0 / 0) | 0.9100 | `train.optimizer.lr` 1 (edge) | yes |" in page


def test_a_method_planned_on_fewer_draws_is_compared_on_them_and_ranked_apart(tmp_path: Path) -> None:
    """"Fewer" (like FedDisk) runs draws 0-4 only, 0.03 above FedAvg, its curves still rising."""
    spec = {**SPEC, "algorithms": {**SPEC["algorithms"], "fewer": {}}, "labels": {**SPEC["labels"], "fewer": "Fewer"},
            "headline": {"algorithms": ["fedavg", "better", "same"]}, "other_pairs": [[0, 0]],
            "pairs": {"fewer": [[draw, 0] for draw in range(5)]}}
    accuracies = final_accuracies()
    fewer = [record(family, "fewer", draw, accuracies[(family, "fedavg", draw)] + 0.03 + 0.001 * (-1) ** draw,
                    rising=True) for family in FAMILIES for draw in range(5)]
    page = rendered(tmp_path, spec=spec, more=fewer)

    row = table_row(page, "iid", "Fewer")
    assert row[1] == "5" and row[8] == "5 of 5" and row[7] == "beats; fixed-budget (30 rounds)"
    assert row[9] == "rising 5" and "m = 6" in page
    assert "fixed-budget" not in table_row(page, "iid", "Better")[7]
    section = page.split("### `iid`")[1].split("###")[0]
    ranks = section.split("Average ranks (1 = best) over draws 0-9")[1]  # FedAvg, Better, Same on all 10
    first, second = ranks.split("Also ranked, with the methods planned on fewer draws")
    assert "Fewer" not in first and "| 1 | Better |" in first
    assert "average ranks (1 = best) over draws 0-4" in second and "| 2 | Fewer | 2.00 [2.00, 2.00] |" in second
    sentence = next(line for line in page.splitlines() if line.startswith("- `iid`:"))
    assert "**Fewer** (+0.0302 [" in sentence and "won 5 of 5 draws; fixed-budget (30 rounds))" in sentence
    assert "(fewer: Fewer 5)" in page


def test_before_any_record_the_page_lists_the_planned_cells(tmp_path: Path) -> None:
    options = benchmark_files(tmp_path)
    (tmp_path / "results" / "benchmark.jsonl").unlink()
    (tmp_path / "results" / "benchmark.trials.jsonl").unlink()
    assert load_renderer().main(options) == 0
    page = (tmp_path / "docs" / "benchmark.md").read_text()

    assert "**The benchmark has not run yet**" in page and "[the protocol page](benchmark_protocol.md)" in page
    assert "| family | FedAvg | Better | Same |" in page and "| `lda0.1` | 10 | 10 | 10 |" in page
    assert "2 families (`iid`, `lda0.1`) × 3 methods" in page
    assert not (tmp_path / "docs" / "img").exists()


def test_the_trials_file_is_read_tolerantly(tmp_path: Path) -> None:
    assert load_trials(tmp_path / "missing.trials.jsonl") == []
    path = tmp_path / "x.trials.jsonl"
    path.write_text('{"cell": "iid", "algorithm": "fedavg", "future_field": 1}\n\n[1]\n')
    with pytest.raises(DataError, match=r"x\.trials\.jsonl:3: a trial is a JSON object"):
        load_trials(path)


def test_edges_of_a_list_and_of_a_range() -> None:
    assert is_edge(1.0, LR_GRID) and is_edge(0.05, LR_GRID) and not is_edge(0.2, LR_GRID)
    assert is_edge(0.0012, ParamRange(low=0.001, high=1.0, log=True))  # log scale: 2.6% of the range from low
    assert not is_edge(0.03, ParamRange(low=0.001, high=1.0, log=True))
    assert is_edge(0.97, ParamRange(low=0.0, high=1.0)) and not is_edge(0.9, ParamRange(low=0.0, high=1.0))


def test_the_committed_benchmark_page_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    status = load_renderer().main(["--check"])

    assert status == 0, capsys.readouterr().err


def test_a_record_the_page_cannot_show_safely_stops_the_renderer(tmp_path: Path) -> None:
    options = benchmark_files(tmp_path)
    results = tmp_path / "results" / "benchmark.jsonl"
    lines = results.read_text().splitlines()
    write_jsonl(results, [{**json.loads(lines[0]), "fedplug": "<img src=x onerror=alert(1)>"}]
                + [json.loads(line) for line in lines[1:]])

    with pytest.raises(DataError, match=r"benchmark\.jsonl: run 'iid__fedavg__d0s0': fedplug version .* is not a PEP 440"):
        load_renderer().main(options)
    assert not (tmp_path / "docs" / "benchmark.md").exists()


def test_a_tuned_text_value_is_shown_as_code() -> None:
    assert value_text("a|b`c") == "``a\\|b`c``" and value_text(0.05) == "0.05" and value_text(True) == "`true`"
