"""The summary table of a study as markdown (:func:`summary_table`) and the readable
names of its columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedplug.analysis import Analysis, registered_analysis
from fedplug.study.spec import display_name


def _cell(value: Any, std: Any = None, digits: int = 4) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return f"{text} ± {std:.{digits}f}" if std is not None else text


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _rounds(row: dict[str, Any], key: str) -> str:
    if row[key] is None:
        return "not reached"
    text = f"{row[key]:.0f}" if float(row[key]).is_integer() else f"{row[key]:.1f}"
    return text if row["reached"] == row["runs"] else f"{text} ({row['reached']}/{row['runs']} reached)"


def _plateaued(row: dict[str, Any]) -> str:
    """``k/n`` runs plateaued (:func:`~fedplug.study.statistics.plateaued`), ``too short``
    when no run has enough rounds to tell."""
    known = row.get("plateau_known", 0)
    if not known:
        return "too short"
    return f"{row['plateaued']}/{known}" + (f" ({row['runs'] - known} too short)" if known < row["runs"] else "")


def _runs(row: dict[str, Any]) -> str:
    if row["runs"] == row["draws"] * row["seeds"]:
        return f"{row['runs']} ({row['draws']}×{row['seeds']})"
    return f"{row['runs']} ({row['draws']} draws, {row['seeds']} seeds)"


METRIC_NAMES = {
    "final_accuracy": "final acc",
    "last3_accuracy": "acc, mean of last 3 rounds",
    "best_accuracy": "best acc",
    "final_loss": "final loss",
    "final_client_accuracy": "final client acc",
    "rounds_to_target": "rounds to target",
    "compute_seconds_model": "cost-model compute s",
    "compute_seconds_to_target": "cost-model compute s to target",
    "communication_seconds_model": "cost-model communication s",
    "total_bytes": "total bytes",
    "train_seconds": "train s (measured)",
}
"""Readable names of :func:`~fedplug.study.statistics.summarise`'s own columns, for tables
and axes; a component's declared column brings its own (``title``)."""


def metric_name(metric: str, analysis: Analysis | None = None) -> str:
    """The readable name of column ``metric``: :data:`METRIC_NAMES`, else the title a
    component declares for it in ``analysis`` (default: the registered components'), else
    the name with spaces."""
    if metric in METRIC_NAMES:
        return METRIC_NAMES[metric]
    declared = (registered_analysis() if analysis is None else analysis).column(metric)
    return declared.title if declared is not None else metric.replace("_", " ")


def best_title(metric: str) -> str:
    """The best-over-rounds column's title beside headline ``metric``: it is the global
    test set's best, which a headline over the clients' own test splits has to say."""
    return "best global acc (over rounds)" if metric == "final_client_accuracy" else "best acc (over rounds)"


def summary_table(rows: Sequence[dict[str, Any]], axes: Sequence[str], target: float, *,
                  labels: dict[str, str] | None = None, baseline: str | None = None,
                  columns: Sequence[str] = (), baselines: dict[str, str] | None = None,
                  analysis: Analysis | None = None) -> str:
    """The summary table as markdown: one line per grid cell x algorithm, the headline
    metric (mean ± std over runs) first, best-over-rounds beside it, the runs whose curve
    has flattened (:func:`_plateaued`), then rounds and bytes to ``target``, the setup rounds where any run has them, ``columns`` (a declared column
    of ``analysis`` with its title and decimals, default: the registered components'),
    and the comparison with each row's reference (``baseline``, or the algorithm's
    ``baselines`` entry, named in the cell): the mean difference over partition draws with
    its 95% interval and the partitions won (:func:`partition_text`), then the runs of the
    same draw and seed won, tied and lost. ``compute_seconds_to_target`` is the mean ± std over the runs that reached
    the target, with ``k/n reached``."""
    analysis = registered_analysis() if analysis is None else analysis
    metric = rows[0]["metric"] if rows else "final_accuracy"
    target_label = f"{100 * target:g}%"
    show_setup = any((row.get("setup_rounds") or 0) > 0 for row in rows)
    header = [*axes, "algorithm", "runs (draws×seeds)", f"{metric_name(metric)} (mean ± std)"]
    if metric != "best_accuracy":
        header.append(best_title(metric))
    header.append("plateaued")
    header.append(f"rounds to {target_label}")
    if show_setup:
        header += ["setup rounds", f"effective rounds to {target_label}"]
    header.append(f"bytes to {target_label}")
    header += [metric_name(column, analysis) for column in columns]
    if baseline is not None or baselines:
        what = (f"vs {display_name(baseline, labels)}" if not baselines else
                f"vs baseline ({display_name(baseline, labels)} unless named)" if baseline else "vs baseline")
        header += [f"{what}: mean difference [95% interval] over partitions, partitions won",
                   "runs won/tied/lost (same draw and seed)"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * (len(axes) + 1) + "---:|" * (len(header) - len(axes) - 1)]
    for row in rows:
        cells = [str(row[axis]) for axis in axes] + [display_name(row["algorithm"], labels), _runs(row),
                                                     _cell(row[metric], row[f"{metric}_std"])]
        if metric != "best_accuracy":
            cells.append(_cell(row["best_accuracy"], row["best_accuracy_std"]))
        cells.append(_plateaued(row))
        cells.append(_rounds(row, "rounds_to_target"))
        if show_setup:
            cells += [f"{row['setup_rounds']:.0f}", _rounds(row, "effective_rounds_to_target")]
        cells.append(_bytes(row["bytes_to_target"]))
        for column in columns:
            if column == "total_bytes":
                cells.append(_bytes(row[column]))
            elif column == "compute_seconds_to_target":
                cells.append("not reached" if row[column] is None else
                             f"{_seconds(row[column], row[f'{column}_std'])} ({row['reached']}/{row['runs']} reached)")
            elif "seconds" in column:
                cells.append(_seconds(row[column], row[f"{column}_std"]))
            else:
                declared = analysis.column(column)
                cells.append(_cell(row[column], row[f"{column}_std"], declared.digits if declared else 4))
        if baseline is not None or baselines:
            paired = row.get("paired")
            reference = (baselines or {}).get(row["algorithm"], baseline)
            named = f" vs {display_name(reference, labels)}" if row["algorithm"] in (baselines or {}) else ""
            if reference is None:
                cells += ["-", ""]
            elif reference == row["algorithm"]:
                cells += ["(baseline)", ""]
            elif not paired or not paired["pairs"]:
                cells += ["no paired runs" + named, ""]
            else:
                cells += [partition_text(row["partitions"]) + named,
                          f"{paired['wins']}/{paired['ties']}/{paired['losses']} of {paired['pairs']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _seconds(value: float | None, std: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" + (f" ± {std:.2g}" if std is not None else "")


def partition_text(comparison: dict[str, Any], digits: int = 4) -> str:
    """A :func:`~fedplug.study.statistics.partition_comparison` as the page reads it:
    ``+0.0110 [-0.0597, +0.0817] over 3 partitions, won 2 of 3`` (the interval's
    confidence when it is not 95%; ``no interval`` with one partition)."""
    n = comparison["partitions"]
    if not n:
        return "no paired runs"
    mean = f"{comparison['difference']:+.{digits}f}"
    if comparison["low"] is None:
        interval = " (no interval)"
    else:
        level = "" if comparison["confidence"] == 0.95 else f"{100 * comparison['confidence']:g}% "
        interval = f" [{level}{comparison['low']:+.{digits}f}, {comparison['high']:+.{digits}f}]"
    return f"{mean}{interval} over {n} partition{'s' if n != 1 else ''}, won {comparison['won']} of {n}"


def tuned_table(records: Sequence[dict[str, Any]], axes: Sequence[str], *, labels: dict[str, str] | None = None,
                spaces: dict[str, dict[str, Any]] | None = None) -> str:
    """The values a study's ``tune:`` search chose, one row per grid cell and tuned
    algorithm (records in study order): each path's value, the validation accuracy (or
    loss) that chose it, the trials and the run the trials trained on; "" when no record
    was tuned. ``spaces`` (algorithm -> path -> the searched list) marks a value at either
    end of its numeric list "(grid edge)": the best may lie beyond it."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for record in records:
        if record.get("tuned"):
            key = (*(str(record["cell"].get(axis, "")) for axis in axes), str(record["algorithm"]))
            rows.setdefault(key, record)
    if not rows:
        return ""
    paths = sorted({path for record in rows.values() for path in record["tuned"]})
    header = [*axes, "algorithm", *(f"`{path}`" for path in paths), "validation value", "trials (pruned)", "tuned on"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, record in rows.items():
        tuning = record.get("tuning") or {}
        space = (spaces or {}).get(key[-1], {})
        values = [_value(record["tuned"].get(path)) + _edge(record["tuned"].get(path), space.get(path)) for path in paths]
        lines.append("| " + " | ".join([*key[:-1], display_name(key[-1], labels), *values,
                                        _cell(tuning.get("value")), f"{tuning.get('trials', '-')} ({tuning.get('pruned', 0)})",
                                        str(tuning.get("tuned_on", "-"))]) + " |")
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _edge(value: Any, searched: Any) -> str:
    numbers = [item for item in searched if isinstance(item, (int, float)) and not isinstance(item, bool)] \
        if isinstance(searched, list) else []
    return " (grid edge)" if len(numbers) >= 2 and value in (min(numbers), max(numbers)) else ""
