"""The benchmark table's statistics (fedplug/study/table_statistics.py, issue 40): each
checked against numbers worked out by hand (the arithmetic is in the test) and against an
independent implementation (statsmodels for Holm, scipy for the t-test, ranks and
Friedman, the published Nemenyi table)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedplug.study.statistics import plateaued
from fedplug.study.table_statistics import (
    average_ranks,
    cell_comparison,
    comparison_family,
    draw_ranks,
    family_ranks,
    holm_adjust,
    nemenyi_critical_difference,
    table_comparisons,
    window_plateau,
)

# --- Holm ---------------------------------------------------------------------------


def test_holm_adjust_matches_hand_computed_step_down():
    # Sorted: 0.005 (4th), 0.01 (1st), 0.03 (3rd), 0.04 (2nd); m = 4.
    # 4 * 0.005 = 0.02; 3 * 0.01 = 0.03; 2 * 0.03 = 0.06; 1 * 0.04 = 0.04 -> max(0.06, 0.04) = 0.06.
    adjusted = holm_adjust([0.01, 0.04, 0.03, 0.005])

    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_holm_adjust_caps_at_one_and_stays_monotone():
    # 2 * 0.6 = 1.2 -> 1; 1 * 0.7 = 0.7 -> max(1, 0.7) = 1.
    assert holm_adjust([0.7, 0.6]) == [1.0, 1.0]
    # 2 * 0.3 = 0.6; 1 * 0.5 = 0.5 -> max(0.6, 0.5) = 0.6 (not 0.5: monotone).
    assert holm_adjust([0.3, 0.5]) == pytest.approx([0.6, 0.6])


def test_holm_adjust_leaves_missing_p_values_out_of_the_family():
    # m = 2 (None and NaN are not tests): 2 * 0.01 = 0.02; 1 * 0.02 = 0.02.
    adjusted = holm_adjust([0.02, None, math.nan, 0.01])

    assert adjusted[0] == pytest.approx(0.02) and adjusted[3] == pytest.approx(0.02)
    assert math.isnan(adjusted[1]) and math.isnan(adjusted[2])
    assert holm_adjust([]) == []


def test_holm_adjust_rejects_a_p_value_outside_zero_one():
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        holm_adjust([0.2, 1.5])


def test_holm_adjust_agrees_with_statsmodels():
    multitest = pytest.importorskip("statsmodels.stats.multitest", reason="statsmodels comes with fedplug[test]")
    rng = np.random.default_rng(40)
    for size in (1, 2, 5, 34, 78):
        # Rounded to 2 decimals so that ties occur; some large p-values so that the cap at 1 bites.
        p_values = np.round(rng.uniform(0, 1, size) ** 3, 2)
        reject, reference, _, _ = multitest.multipletests(p_values, alpha=0.05, method="holm")

        adjusted = holm_adjust(list(p_values))

        np.testing.assert_allclose(adjusted, reference, rtol=0, atol=1e-12)
        assert [p <= 0.05 for p in adjusted] == list(reject)


# --- one comparison per cell ----------------------------------------------------------

# Draw differences (method - reference, mean over the two seeds):
#   draw 0: (0.92 - 0.90 = 0.02, 0.94 - 0.90 = 0.04) -> 0.03;  draw 1: 0.01;  draw 2: 0.05;  draw 3: -0.01.
REFERENCE = {(0, 0): 0.90, (0, 1): 0.90, (1, 0): 0.80, (1, 1): 0.82, (2, 0): 0.70, (2, 1): 0.70, (3, 0): 0.85, (3, 1): 0.85}
METHOD = {(0, 0): 0.92, (0, 1): 0.94, (1, 0): 0.81, (1, 1): 0.83, (2, 0): 0.75, (2, 1): 0.75, (3, 0): 0.84, (3, 1): 0.84}


def test_cell_comparison_matches_hand_computed_t_interval_and_test():
    # mean = (0.03 + 0.01 + 0.05 - 0.01) / 4 = 0.02; deviations 0.01, -0.01, 0.03, -0.03;
    # s = sqrt((1 + 1 + 9 + 9) e-4 / 3) = 0.0258199; se = s / 2 = 0.0129099; t = 0.02 / se = 1.549193.
    # t(0.975, 3) = 3.182446 -> half width 3.182446 * 0.0129099 = 0.0410849.
    comparison = cell_comparison(METHOD, REFERENCE)

    assert comparison["difference"] == pytest.approx(0.02)
    assert comparison["low"] == pytest.approx(0.02 - 0.0410849, abs=1e-6)
    assert comparison["high"] == pytest.approx(0.02 + 0.0410849, abs=1e-6)
    assert comparison["draw_differences"] == pytest.approx([0.03, 0.01, 0.05, -0.01])
    assert (comparison["won"], comparison["tied"], comparison["lost"], comparison["partitions"]) == (3, 0, 1, 4)
    assert comparison["p_value"] == pytest.approx(2 * stats.t.sf(1.549193, 3), rel=1e-5)
    # The interval holds 0 exactly when p >= 0.05 (the test is dual to the interval).
    assert comparison["p_value"] > 0.05 and comparison["low"] < 0 < comparison["high"]


def test_cell_comparison_p_value_is_scipys_paired_t_test_on_draw_means():
    draws = range(4)
    method_means = [np.mean([METHOD[(draw, seed)] for seed in (0, 1)]) for draw in draws]
    reference_means = [np.mean([REFERENCE[(draw, seed)] for seed in (0, 1)]) for draw in draws]

    comparison = cell_comparison(METHOD, REFERENCE)

    assert comparison["p_value"] == pytest.approx(stats.ttest_rel(method_means, reference_means).pvalue, rel=1e-9)


def test_cell_comparison_has_no_p_value_without_two_draws_or_without_spread():
    one_draw = cell_comparison({(0, 0): 0.9, (0, 1): 0.8}, {(0, 0): 0.7, (0, 1): 0.7})
    same_difference = cell_comparison({(0, 0): 0.75, (1, 0): 0.5}, {(0, 0): 0.5, (1, 0): 0.25})

    assert one_draw["p_value"] is None and one_draw["low"] is None
    assert same_difference["p_value"] is None and same_difference["difference"] == 0.25


# --- the table's family of comparisons --------------------------------------------------


def test_comparison_family_adjusts_over_the_tested_comparisons_only():
    differences = [0.03, 0.01, 0.05, -0.01]  # mean 0.02, se 0.0129099 (as above)
    comparisons = {
        ("lda", "fedprox"): {"p_value": 0.01, "draw_differences": differences},
        ("lda", "iwds"): {"p_value": 0.04, "draw_differences": differences},
        ("iid", "iwds"): {"p_value": None, "draw_differences": [0.01]},
        ("iid", "fedprox"): {"p_value": 0.03, "draw_differences": differences},
    }
    # m = 3: 3 * 0.01 = 0.03; 2 * 0.03 = 0.06; 1 * 0.04 = 0.04 -> 0.06.
    family = comparison_family(comparisons, alpha=0.05)

    assert [family[key]["p_holm"] for key in comparisons] == pytest.approx([0.03, 0.06, None, 0.06])
    assert [family[key]["significant"] for key in comparisons] == [True, False, False, False]
    assert {entry["family_size"] for entry in family.values()} == {3}
    # Bonferroni at 1 - 0.05 / 3: t(1 - 0.05 / 6, 3) * se.
    half = stats.t.ppf(1 - 0.05 / 6, 3) * 0.0258199 / 2
    assert family[("lda", "fedprox")]["low_simultaneous"] == pytest.approx(0.02 - half, abs=1e-6)
    assert family[("lda", "fedprox")]["high_simultaneous"] == pytest.approx(0.02 + half, abs=1e-6)
    assert family[("iid", "iwds")]["low_simultaneous"] is None
    assert "p_holm" not in comparisons[("lda", "fedprox")]  # the input is left as it was


def test_comparison_family_interval_excluding_zero_implies_significant_after_holm():
    rng = np.random.default_rng(7)
    comparisons = {}
    for index in range(30):
        differences = rng.normal(0.01 * (index % 5), 0.01, size=10)
        method = {(draw, 0): 0.5 + float(difference) for draw, difference in enumerate(differences)}
        reference = {(draw, 0): 0.5 for draw in range(10)}
        comparisons[("cell", f"method{index}")] = cell_comparison(method, reference)

    family = comparison_family(comparisons)

    for entry in family.values():
        excludes_zero = entry["low_simultaneous"] > 0 or entry["high_simultaneous"] < 0
        assert excludes_zero == (entry["p_value"] * 30 <= 0.05)  # Bonferroni, dual to the t-test
        assert not excludes_zero or entry["significant"]
    assert any(entry["significant"] for entry in family.values())
    assert not all(entry["significant"] for entry in family.values())


def test_table_comparisons_compares_every_method_with_the_reference_in_every_cell():
    records = [
        {"cell": {"partition": partition}, "algorithm": algorithm, "draw": draw, "seed": seed,
         "final_accuracy": values[(draw, seed)]}
        for partition in ("iid", "lda")
        for algorithm, values in (("fedavg", REFERENCE), ("fedprox", METHOD), ("iwds", REFERENCE))
        for draw, seed in values
    ]

    family = table_comparisons(records)

    assert list(family) == [("iid", "fedprox"), ("iid", "iwds"), ("lda", "fedprox"), ("lda", "iwds")]
    assert family[("lda", "fedprox")]["difference"] == pytest.approx(0.02)
    assert family[("iid", "iwds")]["p_value"] is None  # identical to the reference: nothing to test
    assert family[("lda", "fedprox")]["family_size"] == 2
    # m = 2, both p equal: 2 * p.
    assert family[("lda", "fedprox")]["p_holm"] == pytest.approx(2 * cell_comparison(METHOD, REFERENCE)["p_value"])


# --- ranks, Friedman and Nemenyi --------------------------------------------------------

# Accuracy by draw; ranks (1 = best, ties averaged):
#   draw 0: A 0.9, B 0.8, C 0.7 -> 1, 2, 3        draw 1: A 0.9, B 0.9, C 0.8 -> 1.5, 1.5, 3
#   draw 2: A 0.8, B 0.9, C 0.7 -> 2, 1, 3        draw 3: A 0.9, B 0.7, C 0.8 -> 1, 3, 2
SCORES = {
    "A": {0: 0.9, 1: 0.9, 2: 0.8, 3: 0.9},
    "B": {0: 0.8, 1: 0.9, 2: 0.9, 3: 0.7},
    "C": {0: 0.7, 1: 0.8, 2: 0.7, 3: 0.8},
}


def test_average_ranks_match_hand_computed_ranks_and_friedman():
    # A: (1 + 1.5 + 2 + 1) / 4 = 1.375; B: (2 + 1.5 + 1 + 3) / 4 = 1.875; C: (3 + 3 + 3 + 2) / 4 = 2.75.
    # Friedman: 12 N / (k (k + 1)) * (sum R^2 - k (k + 1)^2 / 4) = 4 * (1.890625 + 3.515625 + 7.5625 - 12) = 3.875;
    # tie correction 1 - sum(t^3 - t) / (N k (k^2 - 1)) = 1 - 6 / 96 = 0.9375 -> 3.875 / 0.9375 = 4.1333;
    # p = chi2(2).sf(4.1333) = exp(-4.1333 / 2) = 0.12663.
    result = average_ranks(SCORES, resamples=2000)

    assert [result["ranks"][method]["rank"] for method in "ABC"] == pytest.approx([1.375, 1.875, 2.75])
    assert result["friedman_statistic"] == pytest.approx(3.875 / 0.9375)
    assert result["friedman_p"] == pytest.approx(math.exp(-3.875 / 0.9375 / 2))
    scipy_friedman = stats.friedmanchisquare(*(list(SCORES[method].values()) for method in "ABC"))
    assert result["friedman_p"] == pytest.approx(scipy_friedman.pvalue)
    # CD = 2.343 * sqrt(3 * 4 / (6 * 4)) = 2.343 * 0.70711 = 1.6568 (Demsar's table: q_0.05 = 2.343 for k = 3).
    assert result["critical_difference"] == pytest.approx(1.6568, abs=5e-4)
    assert result["draws"] == [0, 1, 2, 3] and result["dropped_draws"] == []


def test_draw_ranks_agree_with_scipy_rankdata_per_draw():
    scores = np.round(np.random.default_rng(3).uniform(size=(10, 6)), 1)  # rounded: ties

    ranks = draw_ranks(scores)
    lower_better = draw_ranks(scores, higher_is_better=False)

    for row, scores_of_draw in enumerate(scores):
        np.testing.assert_array_equal(ranks[row], stats.rankdata(-scores_of_draw))
        np.testing.assert_array_equal(lower_better[row], stats.rankdata(scores_of_draw))
    assert draw_ranks(np.array([[0.9, 0.8, 0.7]])).tolist() == [[1.0, 2.0, 3.0]]


def test_average_ranks_bootstrap_is_a_seeded_percentile_interval_over_draws():
    result = average_ranks(SCORES, resamples=500, seed=11)
    again = average_ranks(SCORES, resamples=500, seed=11)

    # The same resampling written out: 500 resamples of the 4 draws' rank rows, percentiles 2.5 and 97.5.
    ranks = np.array([[1, 2, 3], [1.5, 1.5, 3], [2, 1, 3], [1, 3, 2]])
    picks = np.random.default_rng(11).integers(0, 4, size=(500, 4))
    means = np.array([[ranks[pick, column].mean() for column in range(3)] for pick in picks])
    for column, method in enumerate("ABC"):
        entry = result["ranks"][method]
        assert entry["low"] == pytest.approx(np.percentile(means[:, column], 2.5))
        assert entry["high"] == pytest.approx(np.percentile(means[:, column], 97.5))
        assert entry["low"] <= entry["rank"] <= entry["high"]
    assert result == again
    # C is last on 3 of 4 draws and second on one: its resampled means lie in [2, 3].
    assert 2 <= result["ranks"]["C"]["low"] < result["ranks"]["C"]["high"] <= 3


def test_average_ranks_keep_only_draws_every_method_has():
    scores = {method: dict(values) for method, values in SCORES.items()}
    scores["B"][4] = 0.95
    scores["A"][4] = None
    scores["C"][4] = 0.9

    result = average_ranks(scores, resamples=100)

    assert result["draws"] == [0, 1, 2, 3] and result["dropped_draws"] == [4]
    assert result["ranks"]["A"]["rank"] == pytest.approx(1.375)


def test_average_ranks_without_a_complete_draw_or_with_only_ties_report_nothing_to_test():
    empty = average_ranks({"A": {0: 0.9}, "B": {1: 0.8}}, resamples=10)
    tied = average_ranks({"A": {0: 0.5, 1: 0.6}, "B": {0: 0.5, 1: 0.6}, "C": {0: 0.5, 1: 0.6}}, resamples=10)

    assert empty["ranks"]["A"]["rank"] is None and empty["critical_difference"] is None
    assert tied["ranks"]["A"]["rank"] == 2.0 and tied["friedman_p"] is None


def test_nemenyi_critical_difference_matches_the_published_table():
    # Demsar (2006), table 5a, q_0.05: k = 2..10, to 3 decimals (2.343 for 2.3437: some are cut, not rounded).
    published = {2: 1.960, 3: 2.343, 4: 2.569, 5: 2.728, 6: 2.850, 7: 2.949, 8: 3.031, 9: 3.102, 10: 3.164}
    for methods, q in published.items():
        assert nemenyi_critical_difference(methods, 1) / math.sqrt(methods * (methods + 1) / 6) == pytest.approx(
            q, abs=1e-3)
    # k = 4, N = 10: 2.569 * sqrt(4 * 5 / 60) = 2.569 * 0.577350 = 1.48321.
    assert nemenyi_critical_difference(4, 10) == pytest.approx(1.48321, abs=5e-4)
    with pytest.raises(ValueError, match="at least 2 methods"):
        nemenyi_critical_difference(1, 10)


def test_family_ranks_rank_each_cell_on_draw_means_over_seeds():
    records = [
        {"cell": {"partition": "lda"}, "algorithm": method, "draw": draw, "seed": seed,
         "final_accuracy": value + (0.01 if seed else -0.01)}  # the seeds average back to value
        for method, by_draw in SCORES.items() for draw, value in by_draw.items() for seed in (0, 1)
    ]

    families = family_ranks(records, resamples=100)

    assert list(families) == ["lda"]
    assert [families["lda"]["ranks"][method]["rank"] for method in "ABC"] == pytest.approx([1.375, 1.875, 2.75])


# --- the plateau rule on window means -----------------------------------------------------


def test_window_plateau_calls_rising_the_curve_the_best_of_window_rule_called_flat():
    # The window before: nine rounds at 0.85 and one at 0.90 -> mean 0.855, best 0.90.
    # The last window: nine rounds at 0.871 and one at 0.9015 -> mean (7.839 + 0.9015) / 10 = 0.87405, best 0.9015.
    # Best-of-window: 0.9015 - 0.90 = 0.0015 < 0.002 -> "plateaued"; window means: 0.87405 - 0.855 = 0.019 > 0.005.
    curve = [0.5] * 5 + [0.85] * 9 + [0.90] + [0.871] * 9 + [0.9015]

    assert plateaued(curve) is True
    assert window_plateau(curve) == "rising"


def test_window_plateau_flat_and_falling_from_hand_computed_means():
    before = [0.89, 0.91] * 5  # mean 0.90
    assert window_plateau(before + [0.903] * 10) == "flat"  # 0.903 - 0.90 = 0.003 <= 0.005
    assert window_plateau(before + [0.89] * 10) == "falling"  # 0.89 - 0.90 = -0.01 < -0.005
    assert window_plateau(before + [0.91] * 10) == "rising"  # +0.01
    # Exactly the tolerance is flat (binary fractions, so no rounding): 0.75 - 0.5 = 0.25.
    assert window_plateau([0.5, 0.5, 0.75, 0.75], window=2, tolerance=0.25) == "flat"
    assert window_plateau([0.5, 0.5, 0.75, 0.875], window=2, tolerance=0.25) == "rising"


def test_window_plateau_skips_missing_rounds_and_needs_two_windows():
    # None rounds are left out: before = mean(0.8 x 5) = 0.8, last = mean(0.9 x 5) = 0.9 -> rising.
    assert window_plateau([0.8, None] * 5 + [None, 0.9] * 5) == "rising"
    assert window_plateau([0.8] * 19) == "too short"
    assert window_plateau([0.8] * 10 + [None] * 10) == "too short"
    assert window_plateau([0.8] * 30) == "flat"  # only the last 20 rounds count
