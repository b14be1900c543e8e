"""The figures of a study's report, one function per kind of plot, each drawn from
records or summary rows into a PNG file (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedplug.analysis import BoxFigure, HistogramFigure
from fedplug.errors import ConfigError, DataError
from fedplug.study.records import is_finite_number
from fedplug.study.spec import cell_id, display_name
from fedplug.study.tables import metric_name

LINE_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"), ("-.", "X"), (":", "*"))
"""Line style and marker of the i-th algorithm (with the i-th colour of tab10): curves that
lie on top of each other stay distinguishable."""

def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(index: int) -> dict[str, Any]:
    plt = _pyplot()
    linestyle, marker = LINE_STYLES[index % len(LINE_STYLES)]
    return {"color": plt.get_cmap("tab10")(index % 10), "linestyle": linestyle, "marker": marker}


def _line_markers(index: int) -> dict[str, Any]:
    """Hollow markers, the earlier lines' larger: where two curves coincide, the later one's
    marker sits visibly inside the earlier one's."""
    return {"markersize": 9.0 - 1.5 * (index % 4), "markerfacecolor": "none", "markeredgewidth": 1.4}


def _caption(figure: Any, text: str) -> None:
    """A note under the figure (wrapped): what the lines, bands and markers mean."""
    import textwrap

    width = max(60, int(figure.get_figwidth() * 13))  # characters of 8-point text per line
    figure.supxlabel("\n".join(textwrap.wrap(text, width)), fontsize=8, color="0.25")


def _accuracy_matrix(members: Sequence[dict[str, Any]]) -> np.ndarray:
    """Runs x rounds accuracies (NaN where a run has no value or fewer rounds)."""
    length = max(len(member.get("accuracy") or []) for member in members)
    matrix = np.full((len(members), length), np.nan)
    for row, member in enumerate(members):
        values = [np.nan if value is None else float(value) for value in member.get("accuracy") or []]
        matrix[row, : len(values)] = values
    return matrix


def _mean_and_std(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a round no run reached: NaN is right
        mean = np.nanmean(matrix, axis=0)
        std = np.nanstd(matrix, axis=0, ddof=1) if matrix.shape[0] > 1 else None
    return mean, std


def plot_curves(records: Sequence[dict[str, Any]], path: str | Path, title: str, target: float | None = None, *,
                labels: dict[str, str] | None = None, baseline: str | None = None,
                baselines: dict[str, str] | None = None) -> None:
    """Test accuracy vs round of the records of one grid cell, one line per algorithm
    (mean over its runs, band ± 1 std), each with its own colour, line style and markers;
    with a ``baseline`` among them, a second panel shows each algorithm's accuracy minus
    the baseline's in the same draw and seed (mean ± std over the pairs), where curves
    that overlap in the first panel come apart; an algorithm with a ``baselines`` entry is
    compared with that algorithm instead."""
    plt = _pyplot()
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("accuracy"):
            groups.setdefault(record["algorithm"], []).append(record)
    if not groups:
        raise DataError(f"no run has per-round accuracies; nothing to plot in {path}")
    references = {algorithm: (baselines or {}).get(algorithm, baseline) for algorithm in groups}
    references = {algorithm: reference for algorithm, reference in references.items()
                  if reference in groups and reference != algorithm}
    with_difference = bool(references)
    figure, axes_grid = plt.subplots(1, 2 if with_difference else 1, figsize=(13 if with_difference else 8, 5),
                                     constrained_layout=True, squeeze=False)
    accuracy_axes = axes_grid[0][0]
    for index, (algorithm, members) in enumerate(groups.items()):
        mean, std = _mean_and_std(_accuracy_matrix(members))
        rounds = np.arange(1, len(mean) + 1)
        step = max(1, len(rounds) // 8)
        style = _style(index)
        accuracy_axes.plot(rounds, mean, label=f"{display_name(algorithm, labels)} (n={len(members)})", linewidth=1.4,
                           markevery=(index % step, step), **_line_markers(index), **style)
        if std is not None:
            accuracy_axes.fill_between(rounds, mean - std, mean + std, color=style["color"], alpha=0.12, linewidth=0)
    target_shown = False
    if target is not None:
        low, high = accuracy_axes.get_ylim()
        if target <= high + 0.25 * (high - low):  # a far-away target line would squash the curves
            accuracy_axes.axhline(target, color="0.4", linestyle=":", linewidth=1)
            accuracy_axes.annotate(f"target {target:g}", xy=(1.0, target), xycoords=("axes fraction", "data"),
                                   xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", fontsize=8,
                                   color="0.3")
            target_shown = True
        else:
            accuracy_axes.annotate(f"target {target:g}: above this range", xy=(1.0, 1.0), xycoords="axes fraction",
                                   xytext=(-4, -4), textcoords="offset points", ha="right", va="top", fontsize=8,
                                   color="0.3")
    accuracy_axes.set_xlabel("communication round")
    accuracy_axes.set_ylabel("global test accuracy")
    accuracy_axes.set_title("accuracy vs round", fontsize=10)
    accuracy_axes.xaxis.get_major_locator().set_params(integer=True)
    accuracy_axes.grid(True, alpha=0.3)
    if with_difference:
        difference_axes = axes_grid[0][1]
        for index, (algorithm, members) in enumerate(groups.items()):
            if algorithm not in references:
                continue
            reference = {(member["draw"], member["seed"]): member for member in groups[references[algorithm]]}
            paired = [member for member in members if (member["draw"], member["seed"]) in reference]
            if not paired:
                continue
            ours = _accuracy_matrix(paired)
            theirs = _accuracy_matrix([reference[(member["draw"], member["seed"])] for member in paired])
            length = min(ours.shape[1], theirs.shape[1])
            mean, std = _mean_and_std(ours[:, :length] - theirs[:, :length])
            rounds = np.arange(1, length + 1)
            step = max(1, length // 8)
            style = _style(index)
            difference_axes.plot(rounds, mean, linewidth=1.4, markevery=(index % step, step), **_line_markers(index), **style)
            if std is not None:
                difference_axes.fill_between(rounds, mean - std, mean + std, color=style["color"], alpha=0.12, linewidth=0)
        difference_axes.axhline(0.0, color="black", linewidth=0.9)
        shared = set(references.values())
        name = display_name(next(iter(shared)), labels) if len(shared) == 1 else "its baseline"
        difference_axes.set_xlabel("communication round")
        difference_axes.set_ylabel(f"accuracy minus {name}'s")
        difference_axes.set_title(f"difference to {name} (same draw and seed)", fontsize=10)
        difference_axes.xaxis.get_major_locator().set_params(integer=True)
        difference_axes.grid(True, alpha=0.3)
    figure.legend(loc="outside right upper", fontsize="small")
    figure.suptitle(title)
    caption = "Lines: mean over n runs (partition draws × training seeds); band = ± 1 sample std."
    if target_shown:
        caption += (f" Dotted line: the target accuracy {target:g}; 'rounds to target' in the table is the first round "
                    "at or above it.")
    if with_difference:
        caption += (" Right: each run minus the baseline's run of the same draw and seed, mean ± std over the pairs; "
                    "above 0 = better than the baseline.")
        if len(set(references.values())) > 1:
            caption += " Baselines: " + "; ".join(
                f"{display_name(algorithm, labels)} vs {display_name(reference, labels)}"
                for algorithm, reference in references.items()) + "."
    _caption(figure, caption)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def axis_value(label: str, axis: str) -> float:
    """The number a grid value label stands for (``"0.05"`` -> 0.05).

    Raises:
        ConfigError: the label is not a number.
    """
    try:
        return float(label)
    except ValueError:
        raise ConfigError(f"grid axis {axis!r}: label {label!r} is not a number, so it cannot be plotted on an x axis") from None


def plot_vs_axis(rows: Sequence[dict[str, Any]], axis: str, metric: str, path: str | Path, title: str,
                 log_x: bool = False, *, labels: dict[str, str] | None = None) -> None:
    """``metric`` against the numeric labels of ``axis``, one line per algorithm (mean
    over runs, error bars = sample std over runs), each with its own colour, line style and
    marker, shifted a little sideways so that error bars at the same x do not hide each
    other. Rows of other axes are averaged per x."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8.5, 4.8), constrained_layout=True)
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    for index, algorithm in enumerate(algorithms):
        points: dict[float, list[tuple[float, float]]] = {}
        for row in rows:
            if row["algorithm"] == algorithm and row[metric] is not None:
                points.setdefault(axis_value(row[axis], axis), []).append((row[metric], row.get(f"{metric}_std") or 0.0))
        xs = sorted(points)
        if not xs:
            continue
        offset = (index - (len(algorithms) - 1) / 2) * 0.025
        shifted = [x * 10 ** offset if log_x else x + offset * (max(xs) - min(xs) or 1.0) for x in xs]
        means = [float(np.mean([value for value, _ in points[x]])) for x in xs]
        stds = [float(np.mean([std for _, std in points[x]])) for x in xs]
        style = _style(index)
        axes.errorbar(shifted, means, yerr=stds, capsize=3, linewidth=1.3, **_line_markers(index),
                      label=display_name(algorithm, labels), **style)
    if log_x:
        axes.set_xscale("log")
    axes.set_xlabel(axis + (" (log scale)" if log_x else ""))
    axes.set_ylabel(metric_name(metric))
    axes.grid(True, alpha=0.3)
    figure.legend(loc="outside right upper", fontsize="small")
    axes.set_title(title)
    _caption(figure, "Mean over runs (partition draws × training seeds); error bars = ± 1 sample std. "
                     "Points at the same x are shifted a little sideways so that none hides another.")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def spread_scale(values: Sequence[float], ratio: float = 20.0) -> tuple[str, float | None]:
    """The axis scale for ``values`` (>= 0) and, for ``"symlog"``, its linear threshold:
    ``"linear"`` unless the positive values span more than ``ratio`` (so that one
    algorithm's large values do not squash the others' boxes); then ``"log"``, or ``"symlog"`` linear up
    to the smallest positive value when some values are 0."""
    positive = [value for value in values if value > 0]
    if not positive or max(positive) / min(positive) <= ratio:
        return "linear", None
    if len(positive) < len(values):
        return "symlog", min(positive)
    return "log", None


def plot_metric_box(records: Sequence[dict[str, Any]], path: str | Path, title: str, figure_spec: BoxFigure, *,
                    labels: dict[str, str] | None = None) -> None:
    """Horizontal box plot of a per-round metric (the records' ``figure_spec.series``) of
    each algorithm, one box per grid cell and algorithm when the study has several cells
    (runs pooled); algorithms without values are left out. The x axis is logarithmic when
    the values span more than a factor 20 (symmetric-log, linear near 0, when some are 0).
    The caption starts with the declaration's ``note``."""
    plt = _pyplot()
    values: dict[tuple[str, str], list[float]] = {}
    for record in records:
        series = [float(value) for value in record.get(figure_spec.series) or [] if is_finite_number(value)]
        if series:
            values.setdefault((cell_id(record["cell"]), record["algorithm"]), []).extend(series)
    if not values:
        raise DataError(f"no run has per-round {figure_spec.series!r} values; the {figure_spec.kind} plot needs "
                        "a component that reports them each round")
    several_cells = len({cell for cell, _ in values}) > 1
    names = [display_name(algorithm, labels) + (f" [{cell}]" if several_cells else "") for cell, algorithm in values]
    figure, axes = plt.subplots(figsize=(9.5, max(3.0, 0.38 * len(values) + 1.6)), constrained_layout=True)
    series = list(values.values())
    axes.boxplot(series[::-1], tick_labels=names[::-1], vert=False, showfliers=True)  # first on top
    scale, threshold = spread_scale([value for serie in series for value in serie])
    if scale == "symlog":
        axes.set_xscale("symlog", linthresh=threshold)
    elif scale == "log":
        axes.set_xscale("log")
    scale = {"log": " (log scale)", "symlog": " (log scale, linear near 0)"}.get(axes.get_xscale(), "")
    axes.set_xlabel(figure_spec.axis_label + scale)
    axes.grid(True, axis="x", alpha=0.3)
    axes.set_title(title)
    note = " [cell]: the grid cell." if several_cells else ""
    _caption(figure, (figure_spec.note + " " if figure_spec.note else "") + "One value per round and run; box = quartiles, whiskers = 1.5 IQR." + note)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def heatmap_matrix(rows: Sequence[dict[str, Any]], row_axis: str, column_axis: str, metric: str,
                   row_labels: Sequence[str], column_labels: Sequence[str]) -> np.ndarray:
    """``metric`` (mean over the matching rows) in a ``len(row_labels) x len(column_labels)``
    matrix; NaN where no run has a value."""
    matrix = np.full((len(row_labels), len(column_labels)), np.nan)
    for i, row_label in enumerate(row_labels):
        for j, column_label in enumerate(column_labels):
            values = [row[metric] for row in rows
                      if row[row_axis] == row_label and row[column_axis] == column_label and row[metric] is not None]
            if values:
                matrix[i, j] = float(np.mean(values))
    return matrix


def plot_heatmap(rows: Sequence[dict[str, Any]], grid: dict[str, dict[str, Any]], row_axis: str, column_axis: str,
                 panel_axis: str | None, metric: str, path: str | Path, title: str) -> None:
    """``metric`` over two grid axes, one panel per label of ``panel_axis``, values (mean
    ± std over runs) written in the cells; all panels share one colour scale."""
    plt = _pyplot()
    row_labels, column_labels = list(grid[row_axis]), list(grid[column_axis])
    panels = list(grid[panel_axis]) if panel_axis else [None]
    selected = [[row for row in rows if panel is None or row[panel_axis] == panel] for panel in panels]
    matrices = [heatmap_matrix(part, row_axis, column_axis, metric, row_labels, column_labels) for part in selected]
    spreads = [heatmap_matrix(part, row_axis, column_axis, f"{metric}_std", row_labels, column_labels) for part in selected]
    finite = np.concatenate([matrix[np.isfinite(matrix)] for matrix in matrices]) if matrices else np.array([])
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    # Enough decimals that the written values differ where the colours do; equal values get
    # one colour (matplotlib would colour an empty range arbitrarily).
    digits = 3 if high - low >= 0.01 or high == low else min(6, math.ceil(-math.log10(high - low)) + 1)
    if high == low:
        low, high = low - 1.0, high + 1.0
    figure, axes_list = plt.subplots(1, len(panels), figsize=(1.1 * len(column_labels) * len(panels) + 2.5 * len(panels), 0.7 * len(row_labels) + 2.6),
                                     constrained_layout=True, squeeze=False)
    image = None
    for axes, panel, matrix, spread in zip(axes_list[0], panels, matrices, spreads):
        image = axes.imshow(matrix, cmap="viridis_r", vmin=low, vmax=high, aspect="auto")
        axes.set_xticks(range(len(column_labels)), column_labels)
        axes.set_yticks(range(len(row_labels)), row_labels)
        axes.set_xlabel(column_axis)
        axes.set_ylabel(row_axis)
        axes.set_title(f"{panel_axis} = {panel}" if panel is not None else metric_name(metric))
        for i in range(matrix.shape[0]):
            for j in range(matrix.shape[1]):
                if np.isfinite(matrix[i, j]):
                    text = f"{matrix[i, j]:.{digits}f}" + (f"\n± {spread[i, j]:.{digits}f}" if np.isfinite(spread[i, j]) else "")
                    axes.text(j, i, text, ha="center", va="center", fontsize=8,
                              color="white" if matrix[i, j] > (low + high) / 2 else "black")
    if image is not None:
        figure.colorbar(image, ax=list(axes_list[0]), label=metric_name(metric))
    figure.suptitle(title)
    _caption(figure, "Each cell: mean ± sample std over runs (partition draws × training seeds); one colour scale for all panels.")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_dots(rows: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], axes_names: Sequence[str], metric: str,
              path: str | Path, title: str, *, labels: dict[str, str] | None = None, bars: bool = False,
              log_y: bool = False) -> None:
    """``metric`` per grid cell and algorithm: the mean with ± 1 std error bars and every
    run as a small dot beside it (``bars``: bars from zero instead of the mean's marker;
    ``log_y``: a logarithmic y axis, not with ``bars``).
    A target never reached is written as such instead of an empty slot, and a mean over
    only some runs (the target columns) says how many reached it (``k/n``)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    cells = list(dict.fromkeys(row["cell"] for row in rows))
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    width = 0.8 / max(len(algorithms), 1)
    figure, axes = plt.subplots(figsize=(min(max(7.0, 0.45 * len(cells) * len(algorithms) + 3.5), 16.0), 4.8),
                                constrained_layout=True)
    partial_column = metric in ("rounds_to_target", "effective_rounds_to_target", "bytes_to_target",
                                "compute_seconds_to_target")
    handles = []
    for index, algorithm in enumerate(algorithms):
        style = _style(index)
        name = display_name(algorithm, labels)
        handles.append(Patch(color=style["color"], label=name) if bars else
                       Line2D([], [], linestyle="none", marker=style["marker"], color=style["color"], label=name))
        for position_index, cell in enumerate(cells):
            position = position_index + (index - (len(algorithms) - 1) / 2) * width
            match = [row for row in rows if row["algorithm"] == algorithm and row["cell"] == cell]
            if not match:
                continue
            value = match[0][metric]
            if value is None:
                axes.annotate("not reached" if partial_column else "n/a", xy=(position, 0.01),
                              xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7,
                              rotation=90, color=style["color"])
                continue
            std = match[0].get(f"{metric}_std") or 0.0
            if bars:
                axes.bar(position, value, width * 0.9, yerr=std, capsize=2, color=style["color"])
            else:
                axes.errorbar([position], [value], yerr=[std], marker=style["marker"], color=style["color"],
                              capsize=3, markersize=6, linestyle="none")
            if partial_column and match[0]["reached"] < match[0]["runs"]:
                axes.annotate(f"{match[0]['reached']}/{match[0]['runs']}", xy=(position, value + std),
                              xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7,
                              color=style["color"])
            runs = [record.get(metric) for record in records
                    if record["algorithm"] == algorithm and cell_id(record["cell"]) == cell and record.get(metric) is not None]
            if runs:
                axes.plot([position + width * 0.3] * len(runs), runs, linestyle="none", marker=".", markersize=3,
                          color="black" if bars else style["color"], alpha=0.6)
    axes.set_xticks(range(len(cells)), cells)
    axes.set_xlim(-0.5, len(cells) - 0.5)
    axes.set_xlabel(" / ".join(axes_names) if axes_names else "")
    axes.set_ylabel(metric_name(metric) + (" (log scale)" if log_y else ""))
    if bars:
        axes.set_ylim(bottom=0.0)
    elif log_y:
        axes.set_yscale("log")
    axes.grid(True, axis="y", alpha=0.3)
    figure.legend(handles=handles, loc="outside right upper", fontsize="small")
    axes.set_title(title)
    caption = (("Bars from zero: mean" if bars else "Large marker: mean") + " over runs (partition draws × training "
               "seeds), error bar ± 1 sample std; small dots beside it: the single runs.")
    if partial_column:
        caption += " The mean counts only the runs that reached the target; k/n: k of n runs reached it."
    _caption(figure, caption)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def pooled_histogram(records: Sequence[dict[str, Any]], key: str, bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """The records' setup-summary histograms (``record[key]``, ``{"edges", "counts"}``) on
    common edges (0 to the largest edge of any of them, ``bins`` bins), averaged over the
    records: (edges, samples per run). Each record's counts are spread over the common
    bins in proportion to how much of its bin each covers (uniform within a bin)."""
    histograms = [record[key] for record in records if record.get(key)]
    if not histograms:
        raise DataError(f"no run has the setup summary {key!r}; its histogram needs a setup phase that reports it")
    top = max(float(histogram["edges"][-1]) for histogram in histograms)
    edges = np.linspace(0.0, top if top > 0 else 1.0, bins + 1)
    total = np.zeros(bins)
    for histogram in histograms:
        own = np.asarray(histogram["edges"], dtype=float)
        for low, high, count in zip(own[:-1], own[1:], histogram["counts"]):
            if not count:
                continue
            if high <= low:  # a zero-width bin (all weights equal): all of it where it lies
                total[min(int(np.searchsorted(edges, low, side="right")) - 1, bins - 1)] += count
                continue
            overlap = np.clip(np.minimum(edges[1:], high) - np.maximum(edges[:-1], low), 0.0, None)
            total += count * overlap / (high - low)
    return edges, total / len(histograms)


def plot_setup_histogram(records: Sequence[dict[str, Any]], path: str | Path, title: str, figure_spec: HistogramFigure,
                         *, labels: dict[str, str] | None = None) -> None:
    """Small multiples of a setup summary's histogram (the records' ``figure_spec.summary``):
    one panel per grid cell (rows) x algorithm with the summary (columns), the histogram of
    :func:`pooled_histogram` on a log count axis, the declared reference value marked, and
    the median of the per-client ``spread`` values written in the panel."""
    plt = _pyplot()
    key = figure_spec.summary
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        if record.get(key):
            groups.setdefault((cell_id(record["cell"]), record["algorithm"]), []).append(record)
    if not groups:
        raise DataError(f"no run has the setup summary {key!r}; its histogram needs a setup phase that reports it")
    cells = list(dict.fromkeys(cell for cell, _ in groups))
    algorithms = list(dict.fromkeys(algorithm for _, algorithm in groups))
    axes_names = list(next(iter(groups.values()))[0]["cell"])
    figure, axes_grid = plt.subplots(len(cells), len(algorithms), figsize=(3.4 * len(algorithms) + 1.0, 2.6 * len(cells) + 1.4),
                                     constrained_layout=True, squeeze=False, sharex=True)
    for i, cell in enumerate(cells):
        for j, algorithm in enumerate(algorithms):
            axes = axes_grid[i][j]
            members = groups.get((cell, algorithm))
            if not members:
                axes.set_axis_off()
                continue
            edges, counts = pooled_histogram(members, key)
            if figure_spec.reference is not None:
                axes.axvline(figure_spec.reference, color="0.35", linestyle="--", linewidth=1.0, zorder=1)
            axes.stairs(counts, edges, fill=True, color=_style(j)["color"], alpha=0.8, zorder=2)
            axes.set_yscale("log")
            positive = counts[counts > 0]
            if positive.size:  # from half the smallest bar: a lone spike keeps a visible height
                axes.set_ylim(float(positive.min()) / 2, float(positive.max()) * 3)
            if figure_spec.reference is not None and figure_spec.reference_label:
                axes.annotate(figure_spec.reference_label, xy=(figure_spec.reference, 1.0),
                              xycoords=("data", "axes fraction"), xytext=(3, -3),
                              textcoords="offset points", ha="left", va="top", fontsize=7, color="0.3")
            spreads = [value for member in members for value in member[key].get(figure_spec.spread) or []
                       if is_finite_number(value)]
            note = f"n={len(members)} runs" + (f"\nmedian client {figure_spec.spread} {np.median(spreads):.3g}"
                                                 if spreads else "")
            axes.annotate(note, xy=(0.98, 0.84), xycoords="axes fraction", ha="right", va="top", fontsize=7)
            where = ", ".join(f"{axis} = {value}" for axis, value in members[0]["cell"].items())
            axes.set_title(display_name(algorithm, labels) + (f"\n{where}" if where else ""), fontsize=9)
            axes.grid(True, alpha=0.3)
            if j == 0:
                axes.set_ylabel("samples per run (log)")
            if i == len(cells) - 1:
                axes.set_xlabel(figure_spec.value_label)
    figure.suptitle(title)
    _caption(figure, (figure_spec.note + " " if figure_spec.note else "") + "Rows: "
             + (" / ".join(axes_names) or "one cell") + ".")
    figure.savefig(path, dpi=110)
    plt.close(figure)

