"""Study grids: expand a study spec into runs, summarise their results, draw the plots.

A *study* reproduces one paper's experiment: a base experiment config, a grid of
settings (partitions, parameters), a list of algorithms (``train`` overrides, exactly like
``algorithms:`` in params.yaml) and seeds. :func:`expand_study` turns it into one
:class:`StudyRun` per grid cell x algorithm x seed, each with a validated config; the
runner script (``pipelines/studies/run_study.py``) trains them; :func:`summary_rows`,
:func:`summary_markdown` and the ``plot_*`` functions turn their ``metrics.json`` files
into a report.

A spec file::

    name: fedshift                  # folder reports/studies/<name>, MLflow experiment study-<name>
    description: one line on what the paper claims
    base: {study: ..., data: ..., train: ...}      # one experiment config
    grid:                           # axis -> value label -> dotted overrides of the config
      partition:
        "0.1": {data.partition: {name: dirichlet_class, alpha: 0.1}}
        "0.5": {data.partition: {name: dirichlet_class, alpha: 0.5}}
    algorithms:                     # label -> overrides of `train`
      fedavg: {}
      fedprox: {loss_transform: {name: fedprox, mu: 0.01}}
    seeds: [0, 1]                   # train.seed of each run (the partition stays fixed)
    plots: [{kind: curves}, {kind: vs_axis, axis: partition, metric: final_accuracy}]

A run's config is built in this order: ``base`` -> the algorithm's ``train`` overrides
(:func:`fedplug.config.deep_merge`) -> the grid cell's dotted overrides (so a grid axis
can tune the algorithm's own parameters, e.g. ``train.grouper.alpha``) -> ``train.seed``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import numpy as np
from pydantic import Field, ValidationError

from fedplug.components import StrictConfig
from fedplug.config import apply_override, deep_merge, format_validation_error, set_dotted, validate_experiment
from fedplug.errors import ConfigError, DataError
from fedplug.registry import Registry
from fedplug.simulation.results import first_round_reaching

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.+-]+$")
"""Grid value labels and algorithm labels become folder names: keep them to these characters."""


# --------------------------------------------------------------------------- the spec


class PlotSpec(StrictConfig):
    """One figure of a study's report."""

    kind: Literal["curves", "vs_axis", "cpd_box", "heatmap", "bars"]
    """``curves``: accuracy vs round and vs bytes, one figure per grid cell;
    ``vs_axis``: ``metric`` against the numeric value of grid axis ``axis``, one line per
    algorithm; ``cpd_box``: box plot of the per-round ``cpd_median`` of every algorithm;
    ``heatmap``: ``metric`` over grid axes ``rows`` x ``columns``, one panel per value of
    ``panels``; ``bars``: ``metric`` per algorithm, one group per grid cell."""
    metric: str = "final_accuracy"
    """A column of :func:`summary_rows` (default ``final_accuracy``)."""
    axis: str | None = None
    """Grid axis on the x axis of ``vs_axis`` (its labels must be numbers)."""
    rows: str | None = None
    """Grid axis of the heatmap's rows."""
    columns: str | None = None
    """Grid axis of the heatmap's columns."""
    panels: str | None = None
    """Grid axis that splits a heatmap into panels (default None: one panel)."""
    log_x: bool = False
    """Logarithmic x axis for ``vs_axis`` (default False)."""


class StudySpec(StrictConfig):
    """A study file (see the module docstring)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Study name: the report folder and (prefixed ``study-``) the MLflow experiment."""
    description: str = ""
    """What the paper claims and what the study checks."""
    base: dict[str, Any]
    """One experiment config (``study``, ``data``, ``train``; ``algorithms`` is not allowed)."""
    grid: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    """Axis name -> value label -> ``{dotted.key: value}`` overrides; the runs cover the
    Cartesian product of the axes (default: one cell, the base)."""
    algorithms: dict[str, dict[str, Any]] = Field(min_length=1)
    """Label -> overrides of ``train`` (``{}`` = the base as is)."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """``train.seed`` of each run (default [0])."""
    plots: list[PlotSpec] = Field(default_factory=lambda: [PlotSpec(kind="curves")])
    """Figures of the report (default: the learning curves)."""


def parse_study(data: Any, source: str = "study") -> StudySpec:
    """Validate a study dict (as read from YAML).

    Raises:
        ConfigError: unknown keys, a missing section, labels that cannot be folder names,
            an empty grid axis, or ``algorithms`` inside ``base``.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with name, base, algorithms, got {type(data).__name__}")
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{source}: invalid study:\n" + format_validation_error(error, data)) from None
    if "algorithms" in spec.base:
        raise ConfigError(f"{source}: base.algorithms: put the algorithms in the study's top-level `algorithms:`")
    for axis, values in spec.grid.items():
        if not values:
            raise ConfigError(f"{source}: grid.{axis}: give at least one value label")
        for label in values:
            _check_label(label, f"{source}: grid.{axis}")
    for label in spec.algorithms:
        _check_label(label, f"{source}: algorithms")
    for plot in spec.plots:
        for field in ("axis", "rows", "columns", "panels"):
            axis = getattr(plot, field)
            if axis is not None and axis not in spec.grid:
                raise ConfigError(f"{source}: plots: {field} {axis!r} is not a grid axis; axes: {', '.join(spec.grid) or '(none)'}")
        if plot.kind == "vs_axis" and plot.axis is None:
            raise ConfigError(f"{source}: plots: a vs_axis plot needs `axis:` (a grid axis with numeric labels)")
        if plot.kind == "heatmap" and (plot.rows is None or plot.columns is None):
            raise ConfigError(f"{source}: plots: a heatmap needs `rows:` and `columns:` (grid axes)")
    return spec


def _check_label(label: str, where: str) -> None:
    if not RUN_ID_PATTERN.match(label):
        raise ConfigError(f"{where}: label {label!r} must use only letters, digits and . _ + - (it names a folder)")


# ---------------------------------------------------------------------- expansion


@dataclass(frozen=True)
class StudyRun:
    """One training run of a study."""

    run_id: str
    """``<cell labels joined by _>__<algorithm>__s<seed>``, e.g. ``0.1__fedavg__s0``."""
    cell: dict[str, str]
    """Grid axis -> value label of this run's cell."""
    algorithm: str
    seed: int
    config: Any
    """The validated experiment config."""

    @property
    def cell_id(self) -> str:
        return cell_id(self.cell)


def cell_id(cell: dict[str, str]) -> str:
    """``"0.1"`` for one axis, ``"log_2_10"`` for three, ``"base"`` for no grid."""
    return "_".join(cell.values()) if cell else "base"


def grid_cells(grid: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, str]]:
    """The Cartesian product of the axes, in file order (the last axis varies fastest)."""
    axes = list(grid)
    return [dict(zip(axes, labels)) for labels in itertools.product(*(list(grid[axis]) for axis in axes))]


def run_document(spec: StudySpec, cell: dict[str, str], algorithm: str, seed: int,
                 overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The experiment dict of one run (before validation): base, then ``overrides``
    (``dotted.key=value`` strings, e.g. ``data.dataset=fashion_mnist``), then the
    algorithm, then the grid cell, then the seed."""
    document = dict(spec.base)
    for assignment in overrides:
        document = apply_override(document, assignment)
    document["train"] = deep_merge(document.get("train") or {}, spec.algorithms[algorithm] or {})
    for axis, label in cell.items():
        for key, value in spec.grid[axis][label].items():
            document = set_dotted(document, key, value)
    train = dict(document["train"])
    train["seed"] = seed
    document["train"] = train
    study = dict(document.get("study") or {})
    study["name"] = spec.name
    study["seeds"] = [seed]
    document["study"] = study
    return document


def expand_study(spec: StudySpec, registry: Registry | None = None, overrides: Sequence[str] = ()) -> list[StudyRun]:
    """Every run of the study, grid cells outermost, then algorithms, then seeds (runs that
    share a federation come one after another).

    Raises:
        ConfigError: a run's config does not validate; the message names the run.
    """
    runs = []
    for cell in grid_cells(spec.grid):
        for algorithm in spec.algorithms:
            for seed in spec.seeds:
                run_id = f"{cell_id(cell)}__{algorithm}__s{seed}"
                document = run_document(spec, cell, algorithm, seed, overrides)
                try:
                    config = validate_experiment(document, registry)
                except ConfigError as error:
                    raise ConfigError(f"study {spec.name}, run {run_id}: {error}") from None
                runs.append(StudyRun(run_id, cell, algorithm, seed, config))
    return runs


def pending_runs(runs: Iterable[StudyRun], out_dir: str | Path) -> list[StudyRun]:
    """The runs whose ``<out_dir>/<run_id>/metrics.json`` does not exist yet."""
    out = Path(out_dir)
    return [run for run in runs if not (out / run.run_id / "metrics.json").is_file()]


# ------------------------------------------------------------------------ summaries


SUMMARY_COLUMNS = (
    "final_accuracy", "best_accuracy", "final_client_accuracy", "final_loss", "rounds_to_target", "effective_rounds_to_target",
    "bytes_to_target", "setup_rounds", "total_bytes", "cpd_median", "seconds",
)
"""The numeric columns of :func:`summary_rows` (means over seeds)."""


def run_row(summary: dict[str, Any], target: float) -> dict[str, float | None]:
    """The summary numbers of one run from its ``metrics.json`` dict.

    ``rounds_to_target`` is the first training round with accuracy >= ``target``;
    ``effective_rounds_to_target`` adds the setup rounds (FedDisk's density phase);
    ``bytes_to_target`` is the cumulative traffic at that round (setup included);
    ``final_client_accuracy`` is the last round's mean accuracy over the clients' own
    test splits; ``cpd_median`` is the median over rounds of each round's ``cpd_median`` (None when
    no round reported one).

    Raises:
        DataError: ``summary`` has no ``history`` list.
    """
    history = summary.get("history")
    if not isinstance(history, list):
        raise DataError("metrics.json has no 'history' list; delete the run folder and run the study again")
    setup = int(summary.get("setup_rounds") or 0)
    reached = first_round_reaching(history, target)
    cpds = [float(record["cpd_median"]) for record in history if _finite(record.get("cpd_median"))]
    accuracies = [float(record["accuracy"]) for record in history if _finite(record.get("accuracy"))]
    return {
        "final_accuracy": float(history[-1]["accuracy"]) if history and _finite(history[-1].get("accuracy")) else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_client_accuracy": (float(history[-1]["client_accuracy_mean"])
                                  if history and _finite(history[-1].get("client_accuracy_mean")) else None),
        "final_loss": float(history[-1]["loss"]) if history and _finite(history[-1].get("loss")) else None,
        "rounds_to_target": float(reached["round"]) if reached else None,
        "effective_rounds_to_target": float(reached["round"]) + setup if reached else None,
        "bytes_to_target": float(reached["cumulative_bytes"]) if reached else None,
        "setup_rounds": float(setup),
        "total_bytes": float(summary.get("total_bytes") or 0),
        "cpd_median": float(np.median(cpds)) if cpds else None,
        "seconds": float(summary.get("total_seconds") or 0.0),
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class FinishedRun:
    """A run and the content of its ``metrics.json``."""

    run: StudyRun
    summary: dict[str, Any]


def summary_rows(finished: Sequence[FinishedRun], target: float) -> list[dict[str, Any]]:
    """One row per grid cell x algorithm (in run order): the cell's axis labels,
    ``algorithm``, ``seeds`` (count), ``reached`` (seeds that reached the target) and each of
    :data:`SUMMARY_COLUMNS` as the mean over seeds (None when no seed has a value; the
    target columns average only the seeds that reached it) plus ``<column>_std``
    (population std over the seeds with a value)."""
    groups: dict[tuple[str, str], list[FinishedRun]] = {}
    for item in finished:
        groups.setdefault((item.run.cell_id, item.run.algorithm), []).append(item)
    rows = []
    for (_, algorithm), members in groups.items():
        per_seed = [run_row(member.summary, target) for member in members]
        row: dict[str, Any] = dict(members[0].run.cell)
        row["algorithm"] = algorithm
        row["seeds"] = len(members)
        row["reached"] = sum(values["rounds_to_target"] is not None for values in per_seed)
        for column in SUMMARY_COLUMNS:
            present = [values[column] for values in per_seed if values[column] is not None]
            row[column] = float(np.mean(present)) if present else None
            row[f"{column}_std"] = float(np.std(present)) if len(present) > 1 else None
        rows.append(row)
    return rows


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
    return text if row["reached"] == row["seeds"] else f"{text} ({row['reached']}/{row['seeds']} seeds)"


def summary_markdown(rows: Sequence[dict[str, Any]], axes: Sequence[str], target: float) -> str:
    """The summary table as markdown: one line per grid cell x algorithm."""
    target_label = f"{100 * target:g}%"
    show_setup = any((row.get("setup_rounds") or 0) > 0 for row in rows)
    show_cpd = any(row.get("cpd_median") is not None for row in rows)
    header = [*axes, "algorithm", "seeds", "final acc", "best acc", "final client acc", "final loss",
              f"rounds to {target_label}"]
    if show_setup:
        header += ["setup rounds", f"effective rounds to {target_label}"]
    header += [f"bytes to {target_label}", "total bytes"]
    if show_cpd:
        header += ["median CPD"]
    header += ["train s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(axes) + "---|---:|" + "---:|" * (len(header) - len(axes) - 2)]
    for row in rows:
        cells = [str(row[axis]) for axis in axes] + [row["algorithm"], str(row["seeds"])]
        cells += [
            _cell(row["final_accuracy"], row["final_accuracy_std"]),
            _cell(row["best_accuracy"], row["best_accuracy_std"]),
            _cell(row["final_client_accuracy"], row["final_client_accuracy_std"]),
            _cell(row["final_loss"], row["final_loss_std"]),
            _rounds(row, "rounds_to_target"),
        ]
        if show_setup:
            cells += [f"{row['setup_rounds']:.0f}", _rounds(row, "effective_rounds_to_target")]
        cells += [_bytes(row["bytes_to_target"]), _bytes(row["total_bytes"])]
        if show_cpd:
            cells += [_cell(row["cpd_median"], digits=3)]
        cells += [f"{row['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
                 log_x: bool = False) -> None:
    """``metric`` against the numeric labels of ``axis``, one line per algorithm (mean
    over seeds, error bars = std over seeds). Rows of other axes are averaged per x."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    for algorithm in algorithms:
        points: dict[float, list[tuple[float, float]]] = {}
        for row in rows:
            if row["algorithm"] == algorithm and row[metric] is not None:
                points.setdefault(axis_value(row[axis], axis), []).append((row[metric], row.get(f"{metric}_std") or 0.0))
        xs = sorted(points)
        means = [float(np.mean([value for value, _ in points[x]])) for x in xs]
        stds = [float(np.mean([std for _, std in points[x]])) for x in xs]
        axes.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=algorithm)
    if log_x:
        axes.set_xscale("log")
    axes.set_xlabel(axis)
    axes.set_ylabel(metric.replace("_", " "))
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    axes.set_title(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_cpd_box(finished: Sequence[FinishedRun], path: str | Path, title: str) -> None:
    """Box plot of the per-round ``cpd_median`` values of each algorithm (all seeds and
    cells pooled); algorithms without CPD values are left out."""
    plt = _pyplot()
    values: dict[str, list[float]] = {}
    for item in finished:
        cpds = [float(record["cpd_median"]) for record in item.summary.get("history", []) if _finite(record.get("cpd_median"))]
        if cpds:
            values.setdefault(item.run.algorithm, []).extend(cpds)
    if not values:
        raise DataError("no run reported cpd_median values; a CPD box plot needs a grouper that computes them")
    figure, axes = plt.subplots(figsize=(max(5.0, 1.6 * len(values) + 2), 4.5), constrained_layout=True)
    axes.boxplot(list(values.values()), tick_labels=list(values), showfliers=True)
    low = min(min(series) for series in values.values())
    high = max(max(series) for series in values.values())
    if low > 0 and high / low > 20:  # FedAvg's CPD would squash the grouped modes' boxes
        axes.set_yscale("log")
    axes.set_ylabel("per-round median CPD between groups" + (" (log scale)" if axes.get_yscale() == "log" else ""))
    axes.grid(True, axis="y", alpha=0.3)
    axes.set_title(title)
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
    """``metric`` over two grid axes, one panel per label of ``panel_axis``, values written in
    the cells; all panels share one colour scale."""
    plt = _pyplot()
    row_labels, column_labels = list(grid[row_axis]), list(grid[column_axis])
    panels = list(grid[panel_axis]) if panel_axis else [None]
    matrices = [
        heatmap_matrix([row for row in rows if panel is None or row[panel_axis] == panel], row_axis, column_axis,
                       metric, row_labels, column_labels)
        for panel in panels
    ]
    finite = np.concatenate([matrix[np.isfinite(matrix)] for matrix in matrices]) if matrices else np.array([])
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    figure, axes_list = plt.subplots(1, len(panels), figsize=(0.9 * len(column_labels) * len(panels) + 2.5 * len(panels), 0.6 * len(row_labels) + 2.2),
                                     constrained_layout=True, squeeze=False)
    image = None
    for axes, panel, matrix in zip(axes_list[0], panels, matrices):
        image = axes.imshow(matrix, cmap="viridis_r", vmin=low, vmax=high, aspect="auto")
        axes.set_xticks(range(len(column_labels)), column_labels)
        axes.set_yticks(range(len(row_labels)), row_labels)
        axes.set_xlabel(column_axis)
        axes.set_ylabel(row_axis)
        axes.set_title(f"{panel_axis} = {panel}" if panel is not None else metric)
        for i in range(matrix.shape[0]):
            for j in range(matrix.shape[1]):
                if np.isfinite(matrix[i, j]):
                    axes.text(j, i, f"{matrix[i, j]:.3f}", ha="center", va="center", fontsize=8,
                              color="white" if matrix[i, j] > (low + high) / 2 else "black")
    if image is not None:
        figure.colorbar(image, ax=list(axes_list[0]), label=metric.replace("_", " "))
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_bars(rows: Sequence[dict[str, Any]], axes_names: Sequence[str], metric: str, path: str | Path, title: str) -> None:
    """``metric`` per algorithm as grouped bars, one group per grid cell (error bars = std
    over seeds)."""
    plt = _pyplot()
    cells = list(dict.fromkeys(cell_id({axis: row[axis] for axis in axes_names}) for row in rows))
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    width = 0.8 / max(len(algorithms), 1)
    figure, axes = plt.subplots(figsize=(min(max(6.0, 0.35 * len(cells) * len(algorithms) + 3), 14.0), 4.5),
                                constrained_layout=True)
    for index, algorithm in enumerate(algorithms):
        heights, errors = [], []
        for cell in cells:
            match = [row for row in rows if row["algorithm"] == algorithm and cell_id({axis: row[axis] for axis in axes_names}) == cell]
            value = match[0][metric] if match and match[0][metric] is not None else np.nan
            heights.append(value)
            errors.append(match[0].get(f"{metric}_std") or 0.0 if match else 0.0)
        positions = np.arange(len(cells)) + (index - (len(algorithms) - 1) / 2) * width
        bars = axes.bar(positions, heights, width, yerr=errors, capsize=2, label=algorithm)
        for position, height in zip(positions, heights):
            if not np.isfinite(height):  # e.g. a target never reached: say so instead of an empty slot
                axes.text(position, 0, "not reached" if "target" in metric else "n/a", ha="center", va="bottom",
                          fontsize=8, rotation=90,
                          color=bars.patches[0].get_facecolor())
    axes.set_xticks(range(len(cells)), cells)
    axes.set_xlabel(" / ".join(axes_names) if axes_names else "")
    axes.set_ylabel(metric.replace("_", " "))
    finite = [row[metric] for row in rows if row[metric] is not None]
    if finite and metric.endswith("accuracy"):
        axes.set_ylim(max(0.0, min(finite) - 0.05), min(1.0, max(finite) + 0.03))
    axes.grid(True, axis="y", alpha=0.3)
    # Below the axes: bars fill the whole plot, so a legend inside would hide some.
    axes.legend(fontsize="small", ncol=min(len(algorithms), 6), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    axes.set_title(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
