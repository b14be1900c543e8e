"""The statistics a study's verdict rests on: mean and sample std over runs, the paired
comparison with a baseline (same draw and seed), and the same comparison with the
partition draw as the unit (:func:`partition_comparison`: a mean difference over draws
with its 95% t interval, and partitions won), per grid cell x algorithm."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from scipy import stats

from fedplug.analysis import Analysis, registered_analysis
from fedplug.study.spec import cell_id

SUMMARY_COLUMNS = (
    "final_accuracy", "last3_accuracy", "best_accuracy", "final_client_accuracy", "final_loss", "rounds_to_target",
    "effective_rounds_to_target", "bytes_to_target", "setup_rounds", "total_bytes", "compute_seconds_model",
    "compute_seconds_to_target", "communication_seconds_model", "train_seconds",
)
"""The numeric columns of :func:`summarise` every study has (mean over runs, and
``<column>_std``); :func:`summary_columns` adds those the components declare."""


def summary_columns(analysis: Analysis | None = None) -> tuple[str, ...]:
    """:data:`SUMMARY_COLUMNS` and the columns ``analysis`` declares (default: the
    registered components', :func:`~fedplug.analysis.registered_analysis`)."""
    analysis = registered_analysis() if analysis is None else analysis
    return (*SUMMARY_COLUMNS[:-1], *(column.name for column in analysis.columns), SUMMARY_COLUMNS[-1])


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator) of the values that
    are not None; (None, None) without values, std None with one."""
    present = [float(value) for value in values if value is not None]
    if not present:
        return None, None
    return float(np.mean(present)), (float(np.std(present, ddof=1)) if len(present) > 1 else None)


def paired_differences(values: dict[tuple[int, int], float | None],
                       reference: dict[tuple[int, int], float | None]) -> dict[tuple[int, int], float]:
    """method - reference for each (draw, seed) both have a value for, in ``values``' order."""
    return {key: float(value) - float(reference[key])  # type: ignore[arg-type]
            for key, value in values.items() if value is not None and reference.get(key) is not None}


def draw_means(values: dict[tuple[int, int], float]) -> list[float]:
    """The mean over each partition draw's seeds of ``values`` (keyed (draw, seed)), by draw."""
    by_draw: dict[int, list[float]] = {}
    for (draw, _), value in values.items():
        by_draw.setdefault(draw, []).append(value)
    return [float(np.mean(by_draw[draw])) for draw in sorted(by_draw)]


def paired_comparison(values: dict[tuple[int, int], float | None],
                      reference: dict[tuple[int, int], float | None]) -> dict[str, Any]:
    """A method against a reference on the runs both have (same draw, same seed): how
    many pairs the method wins (strictly higher), ties and loses, and the mean and sample
    std of the paired difference method - reference (None without pairs)."""
    differences = list(paired_differences(values, reference).values())
    mean, std = mean_std(differences)
    return {
        "pairs": len(differences),
        "wins": sum(difference > 0 for difference in differences),
        "ties": sum(difference == 0 for difference in differences),
        "losses": sum(difference < 0 for difference in differences),
        "difference": mean,
        "difference_std": std,
    }


PLATEAU_WINDOW = 10
PLATEAU_TOLERANCE = 0.002
"""The plateau rule (issue #23): a run has plateaued when the best accuracy of its last
:data:`PLATEAU_WINDOW` rounds is less than :data:`PLATEAU_TOLERANCE` above the best before
them."""


def plateaued(accuracy: Sequence[float | None], window: int = PLATEAU_WINDOW,
              tolerance: float = PLATEAU_TOLERANCE) -> bool | None:
    """Whether a run's accuracy curve has flattened: ``max(last window rounds) -
    max(earlier rounds) < tolerance``. None when the run has ``window`` rounds or fewer
    (too short to tell) or no accuracy in one of the two parts."""
    if len(accuracy) <= window:
        return None
    earlier = [value for value in accuracy[:-window] if value is not None]
    last = [value for value in accuracy[-window:] if value is not None]
    if not earlier or not last:
        return None
    return max(last) - max(earlier) < tolerance


def partition_comparison(values: dict[tuple[int, int], float | None],
                         reference: dict[tuple[int, int], float | None],
                         confidence: float = 0.95) -> dict[str, Any]:
    """A method against a reference with the partition draw, not the run, as the unit.

    Runs of one draw share their clients' data, so their differences are not independent
    replications (between draws the difference varies far more than between seeds). For
    each draw with pairs (same draw and seed, both values present), the draw's difference
    is the mean over its seeds of method - reference; then, over the n draws:

    - ``difference``: the mean of the draws' differences;
    - ``low``, ``high``: the ``confidence`` t interval of that mean,
      ``mean -/+ t((1 + confidence) / 2, n - 1) * s / sqrt(n)`` with ``s`` the sample std
      of the draws' differences (None with fewer than 2 draws);
    - ``won``, ``tied``, ``lost``: draws whose difference is > 0, == 0, < 0;
    - ``partitions`` (n), ``pairs`` (runs paired), ``confidence``.
    """
    paired = paired_differences(values, reference)
    differences = draw_means(paired)
    mean, std = mean_std(differences)
    low = high = None
    if std is not None:
        half = float(stats.t.ppf((1 + confidence) / 2, len(differences) - 1)) * std / np.sqrt(len(differences))
        low, high = mean - half, mean + half  # type: ignore[operator]
    return {
        "partitions": len(differences),
        "pairs": len(paired),
        "won": sum(difference > 0 for difference in differences),
        "tied": sum(difference == 0 for difference in differences),
        "lost": sum(difference < 0 for difference in differences),
        "difference": mean,
        "low": low,
        "high": high,
        "confidence": confidence,
    }


def summarise(records: Sequence[dict[str, Any]], metric: str = "final_accuracy",
              baseline: str | None = None, baselines: dict[str, str] | None = None,
              analysis: Analysis | None = None) -> list[dict[str, Any]]:
    """One row per grid cell x algorithm (in record order): the cell's axis labels,
    ``cell`` (its id), ``algorithm``, ``runs``, ``draws`` and ``seeds`` (distinct counts),
    ``reached`` (runs that reached the target), ``plateaued`` and ``plateau_known`` (runs
    whose curve has flattened by :func:`plateaued`, and runs long enough to tell), each of :func:`summary_columns` (of
    ``analysis``) as the mean
    over the runs with a value (the target columns: the runs that reached it) plus
    ``<column>_std`` (sample std), ``metric`` (the headline metric's name),
    ``reference`` (the algorithm it is compared with: its ``baselines`` entry, else
    ``baseline``; None on the baseline's own row) and, against the reference in the same
    cell, ``paired`` = :func:`paired_comparison` and ``partitions`` =
    :func:`partition_comparison` of ``metric``."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((cell_id(record["cell"]), record["algorithm"]), []).append(record)
    columns = summary_columns(analysis)
    rows = []
    for (cell, algorithm), members in groups.items():
        row: dict[str, Any] = dict(members[0]["cell"])
        row["cell"] = cell
        row["algorithm"] = algorithm
        row["runs"] = len(members)
        row["draws"] = len({member["draw"] for member in members})
        row["seeds"] = len({member["seed"] for member in members})
        row["reached"] = sum(member.get("rounds_to_target") is not None for member in members)
        flattened = [plateaued(member.get("accuracy") or []) for member in members]
        row["plateau_known"] = sum(value is not None for value in flattened)
        row["plateaued"] = sum(value is True for value in flattened)
        for column in columns:
            row[column], row[f"{column}_std"] = mean_std(member.get(column) for member in members)
        row["metric"] = metric
        row["paired"] = row["partitions"] = None
        reference = (baselines or {}).get(algorithm, baseline)
        row["reference"] = reference if reference != algorithm else None
        if row["reference"] is not None and (cell, reference) in groups:
            method_values = {(member["draw"], member["seed"]): member.get(metric) for member in members}
            reference_values = {(member["draw"], member["seed"]): member.get(metric) for member in groups[(cell, reference)]}
            row["paired"] = paired_comparison(method_values, reference_values)
            row["partitions"] = partition_comparison(method_values, reference_values)
        rows.append(row)
    return rows

