"""A finished run as one line of a study's committed results file
(``pipelines/studies/results/<study>.jsonl``): the numbers kept (:func:`run_record`), and
writing and reading those files."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedplug.analysis import Analysis, RoundMetricColumn, SetupSummary, registered_analysis
from fedplug.errors import DataError
from fedplug.run.results import first_round_reaching
from fedplug.safe_files import read_regular_bytes
from fedplug.study.expansion import StudyRun
from fedplug.study.provenance import CLOCK_KEYS
from fedplug.study.run_folders import config_hash

RESTORE = "restore the file from git or re-run the study"
"""What to do about a results file that cannot be read."""


def run_row(summary: dict[str, Any], target: float, analysis: Analysis | None = None) -> dict[str, float | None]:
    """The summary numbers of one run from its ``metrics.json`` dict.

    ``rounds_to_target`` is the first training round with accuracy >= ``target``;
    ``effective_rounds_to_target`` adds the setup rounds (a component's setup phase);
    ``bytes_to_target`` is the cumulative traffic at that round (setup included);
    ``final_client_accuracy`` is the last round's mean accuracy over the clients' own
    test splits; each column of ``analysis`` (default: the registered components',
    :func:`~fedplug.analysis.registered_analysis`) is its metric reduced over the rounds that
    report it (None when none does); ``last3_accuracy`` is the mean accuracy of the last 3 rounds
    (fewer when the run has fewer); ``compute_seconds_model`` and
    ``communication_seconds_model`` are the cost model's totals over the rounds;
    ``compute_seconds_to_target`` is the cost model's compute time summed over the rounds
    up to and including the one that reaches ``target`` (time to accuracy; None when none does);
    ``seconds`` and ``setup_seconds`` are the measured wall times of the rounds and of the
    setup phase.

    Raises:
        DataError: ``summary`` has no ``history`` list.
    """
    history = summary.get("history")
    if not isinstance(history, list):
        raise DataError("metrics.json has no 'history' list; delete the run folder and run the study again")
    setup = int(summary.get("setup_rounds") or 0)
    reached = first_round_reaching(history, target)
    to_target: float | None = None
    if reached is not None:
        to_target = 0.0
        for record in history:
            to_target += float(record.get("compute_seconds_model") or 0.0)
            if record is reached:
                break
    accuracies = [float(record["accuracy"]) for record in history if is_finite_number(record.get("accuracy"))]
    last3 = [float(record["accuracy"]) for record in history[-3:] if is_finite_number(record.get("accuracy"))]
    return {
        "final_accuracy": float(history[-1]["accuracy"]) if history and is_finite_number(history[-1].get("accuracy")) else None,
        "last3_accuracy": float(np.mean(last3)) if last3 else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_client_accuracy": (float(history[-1]["client_accuracy_mean"])
                                  if history and is_finite_number(history[-1].get("client_accuracy_mean")) else None),
        "final_loss": float(history[-1]["loss"]) if history and is_finite_number(history[-1].get("loss")) else None,
        "rounds_to_target": float(reached["round"]) if reached else None,
        "effective_rounds_to_target": float(reached["round"]) + setup if reached else None,
        "bytes_to_target": float(reached["cumulative_bytes"]) if reached else None,
        "setup_rounds": float(setup),
        "total_bytes": float(summary.get("total_bytes") or 0),
        "compute_seconds_model": float(sum(float(record.get("compute_seconds_model") or 0.0) for record in history)),
        "compute_seconds_to_target": to_target,
        "communication_seconds_model": float(sum(float(record.get("communication_seconds_model") or 0.0)
                                                 for record in history)),
        **{column.name: reduced_metric(history, column) for column in _analysis(analysis).columns},
        "seconds": float(summary.get("total_seconds") or 0.0),
        "setup_seconds": float(summary.get("setup_seconds") or 0.0),
    }


REDUCTIONS = {"median": np.median, "mean": np.mean, "min": np.min, "max": np.max, "last": lambda values: values[-1]}
"""How :class:`~fedplug.analysis.RoundMetricColumn` ``reduce`` turns the rounds' values into one."""


def reduced_metric(history: Sequence[dict[str, Any]], column: RoundMetricColumn) -> float | None:
    """``column``'s metric over the rounds of ``history`` that report a finite value,
    reduced as it declares; None when no round reports one."""
    values = [float(record[column.metric]) for record in history if is_finite_number(record.get(column.metric))]
    return float(REDUCTIONS[column.reduce](values)) if values else None


def _analysis(analysis: Analysis | None) -> Analysis:
    return registered_analysis() if analysis is None else analysis


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) and neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _rounded(value: Any, digits: int = 6) -> float | None:
    return round(float(value), digits) if is_finite_number(value) else None


def _significant(value: Any, digits: int = 6) -> float | None:
    """``value`` to ``digits`` significant digits (the cost model's times can be microseconds)."""
    return float(f"{float(value):.{digits}g}") if is_finite_number(value) else None


def run_record(run: StudyRun, metrics: dict[str, Any], target: float, *, info: dict[str, Any] | None = None,
               provenance: dict[str, Any] | None = None, overrides: Sequence[str] = (),
               analysis: Analysis | None = None) -> dict[str, Any]:
    """One line of a study's results file: what identifies the run, its numbers and
    where they came from.

    ``metrics`` is the run's ``metrics.json``, ``info`` its ``run_info.json`` (the git
    commit and package versions at training time), ``provenance`` the runner's
    ``provenance.json`` (the commit the runner's process started on, which the record's
    ``commit`` prefers, and whether the checkout had uncommitted changes; its
    :data:`~fedplug.study.provenance.CLOCK_KEYS` are copied). ``accuracy`` is the
    test accuracy of every round (6 decimals). ``analysis`` (default: the registered
    components', :func:`~fedplug.analysis.registered_analysis`) adds each declared column
    (6 decimals), each declared column's ``series`` of per-round values (only when some
    round reports the metric) and each declared setup summary (:func:`setup_record`; only
    when the run's setup report has it). ``compute_seconds`` is each round's cost-model
    compute time (4 significant digits; only when the model reports one), ``setup_seconds`` the measured wall time of the run's setup phase
    (only when it took 0.01 s or more: a run without a setup phase takes none, one that
    loads a cached setup about none),
    ``config`` is the run's resolved config (what trained) and ``config_hash`` its
    :func:`~fedplug.study.run_folders.config_hash`; ``commit``, ``dirty`` and ``fedplug``
    the code version (:mod:`fedplug.study.provenance`);
    ``tuned`` the values the study's ``tune:`` search chose for it (only for a
    :class:`~fedplug.study.tuning.TunedRun`).
    """
    analysis = _analysis(analysis)
    numbers = run_row(metrics, target, analysis)
    history = metrics["history"]
    record: dict[str, Any] = {
        "run": run.run_id,
        "cell": dict(run.cell),
        "algorithm": run.algorithm,
        "draw": run.draw,
        "seed": run.seed,
        "headline": run.headline,
        "dataset": run.config.data.dataset.name,
        "rounds": len(history),
        "final_accuracy": numbers["final_accuracy"],
        "last3_accuracy": _rounded(numbers["last3_accuracy"], 8),
        "best_accuracy": numbers["best_accuracy"],
        "final_loss": _rounded(numbers["final_loss"]),
        "final_client_accuracy": _rounded(numbers["final_client_accuracy"]),
        "target": target,
        "rounds_to_target": _integer(numbers["rounds_to_target"]),
        "setup_rounds": _integer(numbers["setup_rounds"]),
        "effective_rounds_to_target": _integer(numbers["effective_rounds_to_target"]),
        "bytes_to_target": _integer(numbers["bytes_to_target"]),
        "total_bytes": _integer(numbers["total_bytes"]),
        "compute_seconds_model": _significant(numbers["compute_seconds_model"]),
        "compute_seconds_to_target": _significant(numbers["compute_seconds_to_target"]),
        "communication_seconds_model": _significant(numbers["communication_seconds_model"]),
        "train_seconds": _rounded(numbers["seconds"], 2),
        **{column.name: _rounded(numbers[column.name]) for column in analysis.columns},
        "accuracy": [_rounded(record.get("accuracy")) for record in history],
    }
    setup_seconds = _rounded(numbers["setup_seconds"], 2)
    if setup_seconds:
        record["setup_seconds"] = setup_seconds
    for column in analysis.columns:
        if column.series is not None and any(is_finite_number(round_.get(column.metric)) for round_ in history):
            record[column.series] = [_rounded(round_.get(column.metric)) for round_ in history]
    if any(is_finite_number(record.get("compute_seconds_model")) and record["compute_seconds_model"] > 0 for record in history):
        record["compute_seconds"] = [_significant(record.get("compute_seconds_model"), 4) for record in history]
    for summary in analysis.setup_summaries:
        compact = setup_record(metrics.get("setup_report") or {}, summary)
        if compact is not None:
            record[summary.key] = compact
    info = info or {}
    record["commit"] = (provenance or {}).get("git_commit") or info.get("git_commit")
    record["dirty"] = (provenance or {}).get("git_dirty")
    for key in CLOCK_KEYS:
        if (provenance or {}).get(key) is not None:
            record[key] = provenance[key]  # type: ignore[index]
    record["fedplug"] = (info.get("packages") or {}).get("fedplug")
    config = run.config.model_dump(mode="json")
    record["config"] = config
    record["config_hash"] = config_hash(config)
    record["overrides"] = list(overrides)
    tuned = getattr(run, "tuned", None)
    if tuned:
        record["tuned"] = dict(tuned)
        record["tuning"] = dict(getattr(run, "tuning", None) or {})
    return record


def setup_record(setup_report: dict[str, Any], summary: SetupSummary) -> dict[str, Any] | None:
    """The compact form of the setup-report entries ``summary`` declares (metrics.json's
    ``setup_report``): the histogram ``{"edges", "counts"}`` and each per-client list,
    4 significant digits. None when the report has no such histogram with counts (no setup
    phase, or one that reports none)."""
    histogram = setup_report.get(summary.prefix + summary.histogram)
    if not isinstance(histogram, dict) or not histogram.get("counts"):
        return None
    compact: dict[str, Any] = {
        "edges": [_significant(edge, 4) for edge in histogram["edges"]],
        "counts": [int(count) for count in histogram["counts"]],
    }
    for stat in summary.per_client:
        values = setup_report.get(summary.prefix + stat)
        if isinstance(values, list):
            compact[stat] = [_significant(value, 4) for value in values]
    return compact


def dump_records(records: Iterable[dict[str, Any]]) -> str:
    """A results file's text: one compact JSON object per line."""
    return "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results file (empty when it does not exist). Records written
    before ``config`` was kept load (and are reused) without it.

    Raises:
        DataError: a line is not a JSON object with ``run``, ``cell``, ``algorithm``,
            ``draw``, ``seed`` (the message names the file and line); a FIFO, socket or
            device lies at ``path`` (refused in one line, not waited on).
    """
    path = Path(path)
    try:
        text = read_regular_bytes(path, what="study results file", advice=RESTORE, error=DataError).decode()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # as is_file() said: no results file yet
        return []
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not JSON ({error.msg}); {RESTORE}") from None
        missing = [key for key in ("run", "cell", "algorithm", "draw", "seed") if not isinstance(record, dict) or key not in record]
        if missing:
            raise DataError(f"{path}:{number}: a study record needs {', '.join(missing)}; {RESTORE}")
        records.append(record)
    return records

