"""The numbers a verdict on docs/results.md quotes come from the records
(fedplug/study/quotes.py): each placeholder against hand-computed values, the renderer
filling them, and the check that no verdict types a result by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from test_results_page import FINAL, tiny_layout, tiny_records, write_jsonl

from fedplug.errors import ConfigError
from fedplug.study.quotes import fill_quotes, hand_typed_numbers, record_value, spec_numbers

STUDIES = Path(__file__).resolve().parents[1] / "pipelines" / "studies"


def tiny_studies() -> dict[str, Any]:
    return {"tiny": (tiny_records(), "final_accuracy")}


@pytest.mark.parametrize("placeholder, text", [
    # FedProx's finals 0.85, 0.82 (draw 0) and 0.80 (draw 1); FedAvg's 0.80, 0.82, 0.78, 0.84.
    ("{{mean fedprox@0.1}}", "0.823"),
    ("{{mean fedprox@0.1 best_accuracy:4}}", "0.8333"),
    ("{{range fedprox@0.1}}", "0.800 to 0.835"),
    ("{{mean fedavg@0.1 accuracy.2:2}}", "0.70"),
    # Per draw: 0.025 and 0.02 (see test_results_page.test_mean_std_and_paired_wins_by_hand).
    ("{{diff fedprox vs fedavg@0.1:4}}", "+0.0225 [-0.0093, +0.0543] over 2 partitions, won 2 of 2"),
    ("{{pairs fedprox vs fedavg@0.1}}", "2 of 3"),
    ("{{pairs fedavg vs fedprox@0.1}}", "0 of 3"),
    # 0.823333 / 0.81 - 1 = +1.6%.
    ("{{change fedprox vs fedavg@0.1}}", "+2%"),
    ("{{paper -41%}}", "-41%"),
    ("{{mean tiny: fedprox@0.1}}", "0.823"),
])
def test_each_placeholder_by_hand(placeholder: str, text: str) -> None:
    assert fill_quotes(f"a {placeholder} b", tiny_studies(), "tiny.md", "tiny") == f"a {text} b"


@pytest.mark.parametrize("placeholder, message", [
    ("{{mean fedsgd@0.1}}", "no runs of 'fedsgd' in cell '0.1'"),
    ("{{mean fedprox@0.5}}", "no runs of 'fedprox' in cell '0.5'"),
    ("{{mean fedprox@0.1 time_to_target_model}}", "no run of 'fedprox' in cell '0.1' has 'time_to_target_model'"),
    ("{{diff fedprox@0.1}}", r"does not read as \{\{diff \[STUDY: \]A vs B@CELL"),
    ("{{mean fedprox vs fedavg@0.1}}", r"does not read as \{\{mean \[STUDY: \]ALG@CELL"),
    ("{{mean other: fedprox@0.1}}", r"no study 'other' \(known: tiny\)"),
])
def test_a_placeholder_that_cannot_be_filled_is_named(placeholder: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"tiny\.md: .*" + message):
        fill_quotes(placeholder, tiny_studies(), "tiny.md", "tiny")


def test_outside_a_study_a_placeholder_names_its_study() -> None:
    with pytest.raises(ConfigError, match=r"_intro\.md: \{\{mean fedprox@0\.1\}\}: name the study"):
        fill_quotes("{{mean fedprox@0.1}}", tiny_studies(), "_intro.md")


def test_derived_fields_by_hand() -> None:
    record = {"compute_seconds_to_target": 0.005, "rounds_to_target": 3, "communication_seconds_model": 7.5,
              "rounds": 15, "accuracy": [0.5, None],
              "weights": {"edges": [0.0, 1.0, 2.0], "counts": [3, 1], "median": [0.2, 0.4]}}
    # 0.005 + 7.5 * 3 / 15; bin centres 0.5 and 1.5 weighted 3:1; the clients' medians' mean.
    assert record_value(record, "time_to_target_model") == pytest.approx(1.505)
    assert record_value(record, "weights.histogram_mean") == pytest.approx(0.75)
    assert record_value(record, "weights.median") == pytest.approx(0.3)
    assert record_value(record, "weights.median.min") == 0.2 and record_value(record, "weights.median.max") == 0.4
    assert record_value(record, "weights.median.sum") is None and record_value(record, "weights.q95") is None
    assert record_value(record, "accuracy.1") == 0.5
    assert record_value(record, "accuracy.2") is None and record_value(record, "accuracy.3") is None
    assert record_value(dict(record, rounds_to_target=None), "time_to_target_model") is None


def test_the_renderer_fills_the_verdicts_and_the_intro(tmp_path: Path) -> None:
    renderer, layout = tiny_layout(tmp_path)
    write_jsonl(layout.results / "tiny.jsonl", tiny_records())
    (layout.verdicts / "tiny.md").write_text("{{results}}\n\n**Verdict.** FedProx {{diff fedprox vs fedavg@0.1:4}}.\n")
    (layout.verdicts / "_intro.md").write_text("# Tiny page\n\nFedProx ends at {{mean tiny: fedprox@0.1}}.\n\n{{status_table}}\n")

    page = renderer.render_page(layout)

    assert "**Verdict.** FedProx +0.0225 [-0.0093, +0.0543] over 2 partitions, won 2 of 2." in page
    assert "FedProx ends at 0.823." in page
    assert FINAL["fedprox"][(1, 0)] == 0.80  # the records the hand computations above read


def test_hand_typed_numbers_are_found_in_verdict_prose_only() -> None:
    fragment = (
        "## X\n\nSetting: alpha 0.1, lr 0.05, 0.77 in the setting is not a verdict.\n\n"
        "**Verdict.** FedShift gains +0.011 (6 of 9 pairs) at alpha 0.1, {{diff a vs b@0.1}}, `0.5` "
        "[figure](img/x0.3.png) <!-- 0.7 --> reaching 85% in 4.5 rounds of 12.\n\n"
        "**The paper's setting** lr 0.01 gives 0.9.\n"
    )

    found = hand_typed_numbers(fragment, settings=["0.1", "85%"])

    assert found == ["+0.011", "6 of 9", "4.5"]
    assert hand_typed_numbers("| a | 0.25 and 3% |", []) == ["0.25", "3%"]  # no verdict heading: all of it


def test_spec_numbers_are_the_settings_not_the_description() -> None:
    document = {"description": "measured 0.77", "grid": {"alpha": {"0.1": {"x": 0.05}}},
                "base": {"train": {"rounds": 20, "lr": 0.5}}, "labels": {"a": "FedProx (mu 0.01)"}}

    numbers = spec_numbers(document)

    assert {"0.1", "0.05", "5%", "20", "0.5", "50%", "0.01"} <= set(numbers)
    assert "0.77" not in numbers


def committed_fragments() -> dict[str, tuple[str, list[str]]]:
    """Each verdict fragment's text and the numbers its study's spec sets (the intro: every
    spec's)."""
    specs = {path.stem: spec_numbers(yaml.safe_load(path.read_text()))
             for path in STUDIES.glob("*.yaml") if path.stem != "dvc"}
    every = [number for numbers in specs.values() for number in numbers]
    return {path.stem: (path.read_text(), specs.get(path.stem, every)) for path in (STUDIES / "verdicts").glob("*.md")}


def test_no_verdict_types_a_result_by_hand() -> None:
    fragments = committed_fragments()
    assert {"_intro", "fedshift", "fedgsp", "iwds", "fedavgm", "feddisk", "faults", "fedgsp_growth",
            "fedgsp_long", "fedshift_tuned", "iwds_tuned", "fedgsp_tuned", "feddisk_tuned",
            "iwds_decay", "fedshift_partial", "fedshift_paper"} <= set(fragments)
    for name, (text, settings) in fragments.items():
        found = hand_typed_numbers(text, settings)
        assert not found, (
            f"pipelines/studies/verdicts/{name}.md types {len(found)} result numbers by hand: {found}; "
            "write them as placeholders (fedplug/study/quotes.py)"
        )
