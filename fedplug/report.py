"""The comparison report of a study: a markdown table, learning curves and DVC metrics.

Pure functions turn the runs' ``metrics.json`` contents (:class:`RunMetrics`) into
per-algorithm summaries (:func:`summarize`), a markdown table (:func:`comparison_markdown`),
a flat metrics dict (:func:`summary_metrics`) and long-format curve rows
(:func:`curve_rows`); the plotting functions draw onto files; :func:`write_report` is the one
writer that puts everything into a reports folder.

With several seeds per algorithm, accuracies are given as mean ± standard deviation over
the seeds (population std, ``ddof=0``), curves as the mean over seeds with a shaded
min-max band, and "rounds to target" as the mean over the seeds that reached the target,
with the number that did.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedplug.errors import DataError
from fedplug.run.results import rounds_to_target
from fedplug.safe_files import read_regular_bytes

# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class RunMetrics:
    """One finished run: its label, seed and the content of its ``metrics.json``."""

    algorithm: str
    seed: int
    history: list[dict[str, Any]]
    """One dict per round (the ``history`` of ``metrics.json``), in round order."""
    total_bytes: int
    """All traffic, setup phase included (``metrics.json``'s ``total_bytes``)."""
    train_seconds: float
    """Sum of the rounds' wall times."""
    setup_seconds: float = 0.0
    """Wall time of work done before round 1 in another stage (a component's setup phase)."""
    setup_rounds: int = 0
    """Communication rounds spent before training (a component's setup phase)."""

    @property
    def wall_seconds(self) -> float:
        return self.train_seconds + self.setup_seconds


def run_metrics_from_summary(
    algorithm: str, seed: int, summary: dict[str, Any], setup_seconds: float = 0.0
) -> RunMetrics:
    """Build :class:`RunMetrics` from a ``metrics.json`` dict (``RunResult.summary()``).

    Raises:
        DataError: the dict lacks ``history``, or a round lacks ``round``/``accuracy``/
            ``cumulative_bytes``.
    """
    history = summary.get("history")
    if not isinstance(history, list):
        raise DataError(
            f"metrics of {algorithm} seed {seed} have no 'history' list; re-run its train stage"
        )
    for record in history:
        if (
            not isinstance(record, dict)
            or not {"round", "accuracy", "cumulative_bytes"} <= record.keys()
        ):
            raise DataError(
                f"metrics of {algorithm} seed {seed}: a history entry lacks round, accuracy or "
                "cumulative_bytes; re-run its train stage"
            )
    return RunMetrics(
        algorithm=algorithm,
        seed=seed,
        history=history,
        total_bytes=int(summary.get("total_bytes") or 0),
        train_seconds=float(summary.get("total_seconds") or 0.0),
        setup_seconds=float(setup_seconds),
        setup_rounds=int(summary.get("setup_rounds") or 0),
    )


def load_run_metrics(
    path: str | os.PathLike[str], algorithm: str, seed: int, setup_seconds: float = 0.0
) -> RunMetrics:
    """Read one run's ``metrics.json``.

    Raises:
        DataError: the file is missing, not JSON or not a regular file (a FIFO is refused
            in one line, not waited on; the message says which stage to run).
    """
    path = Path(path)
    try:
        summary = json.loads(
            read_regular_bytes(path, what="run metrics", advice=f"delete it and re-run the train stage of {algorithm} seed {seed}",
                               error=DataError)
        )
    except FileNotFoundError:
        raise DataError(
            f"{path} does not exist; run the train stage of {algorithm} seed {seed} first"
        ) from None
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not readable JSON ({error}); re-run its train stage") from None
    return run_metrics_from_summary(algorithm, seed, summary, setup_seconds)


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class AlgorithmSummary:
    """One row of the comparison table: an algorithm over its seeds."""

    algorithm: str
    seeds: list[int]
    final_accuracy: list[float]
    """Final-round accuracy of each seed (NaN for a run without rounds)."""
    best_accuracy: list[float]
    rounds_to_target: list[int | None]
    total_bytes: list[int]
    wall_seconds: list[float]
    setup_rounds: list[int] = field(default_factory=list)

    @property
    def reached(self) -> list[int]:
        return [rounds for rounds in self.rounds_to_target if rounds is not None]


def _number(value: Any) -> float:
    """A metric value as float; None (how metrics.json writes NaN) becomes NaN."""
    return float(value) if value is not None else float("nan")


def _accuracy(record: dict[str, Any]) -> float:
    return _number(record.get("accuracy"))


def summarize(runs: Iterable[RunMetrics], target: float) -> list[AlgorithmSummary]:
    """Group runs by algorithm (in order of first appearance), seeds sorted."""
    grouped: dict[str, list[RunMetrics]] = {}
    for run in runs:
        grouped.setdefault(run.algorithm, []).append(run)
    summaries = []
    for algorithm, members in grouped.items():
        members = sorted(members, key=lambda run: run.seed)
        summaries.append(
            AlgorithmSummary(
                algorithm=algorithm,
                seeds=[run.seed for run in members],
                final_accuracy=[
                    _accuracy(run.history[-1]) if run.history else float("nan") for run in members
                ],
                best_accuracy=[
                    max((_accuracy(record) for record in run.history), default=float("nan"))
                    for run in members
                ],
                rounds_to_target=[rounds_to_target(run.history, target) for run in members],
                total_bytes=[run.total_bytes for run in members],
                wall_seconds=[run.wall_seconds for run in members],
                setup_rounds=[run.setup_rounds for run in members],
            )
        )
    return summaries


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _mean_std(values: Sequence[float], digits: int = 4) -> str:
    if not values or all(math.isnan(value) for value in values):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}"


def format_bytes(count: float) -> str:
    """Decimal units: ``format_bytes(47_810_400) == "47.8 MB"``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def tick_bytes(count: float) -> str:
    """Short axis label: ``tick_bytes(2e7) == "20 MB"``, ``tick_bytes(1.5e9) == "1.5 GB"``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:g} {unit}"
    return f"{count:g} B"


def format_rounds(summary: AlgorithmSummary) -> str:
    """``"7"`` (one seed), ``"6.5"`` (all of several seeds, mean), ``"7 (1/2 seeds)"``
    (some seeds), ``"not reached"`` (none)."""
    reached = summary.reached
    if not reached:
        return "not reached"
    mean = float(np.mean(reached))
    text = f"{mean:.0f}" if mean.is_integer() else f"{mean:.1f}"
    if len(reached) < len(summary.rounds_to_target):
        text += f" ({len(reached)}/{len(summary.rounds_to_target)} seeds)"
    return text


def ranked(summaries: Sequence[AlgorithmSummary]) -> list[AlgorithmSummary]:
    """Best first: by mean final accuracy, then mean best accuracy (a run without rounds,
    NaN, ranks last); equal algorithms keep their order."""

    def key(summary: AlgorithmSummary) -> tuple[float, float]:
        final, best = _mean(summary.final_accuracy), _mean(summary.best_accuracy)
        return (-final if math.isfinite(final) else math.inf, -best if math.isfinite(best) else math.inf)

    return sorted(summaries, key=key)


def comparison_markdown(summaries: Sequence[AlgorithmSummary], target: float, title: str) -> str:
    """The comparison table as markdown, one row per algorithm, ranked by :func:`ranked`.
    Only values the params and the code determine: the file reproduces byte for byte (wall
    times are in :func:`wall_time_markdown`)."""
    target_label = f"{100 * target:g}%"
    header = (
        f"| rank | algorithm | seeds | final accuracy | best accuracy | rounds to {target_label} "
        "| total bytes |"
    )
    lines = [
        f"# {title}",
        "",
        header,
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for rank, summary in enumerate(ranked(summaries), start=1):
        seeds = ", ".join(str(seed) for seed in summary.seeds)
        setup = max(summary.setup_rounds, default=0)
        rounds = format_rounds(summary) + (f" (+{setup} setup)" if setup else "")
        lines.append(
            f"| {rank} | {summary.algorithm} | {seeds} | {_mean_std(summary.final_accuracy)} "
            f"| {_mean_std(summary.best_accuracy)} | {rounds} "
            f"| {format_bytes(_mean(summary.total_bytes))} |"
        )
    note = (
        "Ranked by final accuracy (mean over seeds), then best accuracy. Accuracy is on the "
        "global test set after each round; with several seeds, mean ± std over the seeds "
        '(population std). Rounds to target count training rounds; "+N setup" are rounds spent '
        "before training (a component's setup phase). Total bytes are all model traffic up and "
        "down, setup included (mean over seeds)."
    )
    lines += ["", note, ""]
    return "\n".join(lines)


def wall_time_markdown(summaries: Sequence[AlgorithmSummary], title: str) -> str:
    """Wall time per algorithm (mean over seeds): the training rounds plus work done before
    round 1 in another stage (a component's setup phase). Measured, so it differs from run to
    run: kept apart from the reproducible comparison."""
    lines = [f"# {title}: wall time", "", "| algorithm | seeds | wall time |", "|---|---|---:|"]
    for summary in summaries:
        seeds = ", ".join(str(seed) for seed in summary.seeds)
        lines.append(f"| {summary.algorithm} | {seeds} | {_mean(summary.wall_seconds):.1f} s |")
    return "\n".join(lines) + "\n"


def summary_metrics(
    summaries: Sequence[AlgorithmSummary],
) -> dict[str, dict[str, float | int | None]]:
    """``{algorithm: {final_accuracy, best_accuracy, rounds_to_target, total_bytes}}``
    (means over seeds; rounds_to_target None when no seed reached it), for ``dvc metrics
    show``; no wall times, so the file reproduces byte for byte."""
    metrics: dict[str, dict[str, float | int | None]] = {}
    for summary in summaries:
        reached = summary.reached
        metrics[summary.algorithm] = {
            "final_accuracy": _json_float(_mean(summary.final_accuracy)),
            "best_accuracy": _json_float(_mean(summary.best_accuracy)),
            "rounds_to_target": _json_float(float(np.mean(reached))) if reached else None,
            "total_bytes": round(_mean(summary.total_bytes)),
        }
    return metrics


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


CURVE_FIELDS = ("algorithm", "seed", "round", "accuracy", "loss", "cumulative_bytes")


def curve_rows(runs: Iterable[RunMetrics]) -> list[dict[str, Any]]:
    """Long-format learning curves (one row per run and round, :data:`CURVE_FIELDS`),
    the data of the pipeline's DVC plots."""
    rows = []
    for run in runs:
        for record in run.history:
            rows.append(
                {
                    "algorithm": run.algorithm,
                    "seed": run.seed,
                    "round": int(record["round"]),
                    "accuracy": record.get("accuracy"),
                    "loss": record.get("loss"),
                    "cumulative_bytes": int(record["cumulative_bytes"]),
                }
            )
    return rows


def mean_curve(
    runs: Sequence[RunMetrics], key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, low, high)`` of ``key`` over seeds, on the rounds all runs have."""
    length = min(len(run.history) for run in runs)
    values = np.array(
        [[_number(record.get(key)) for record in run.history[:length]] for run in runs]
    )
    rounds = np.array([int(record["round"]) for record in runs[0].history[:length]])
    return rounds, values.mean(axis=0), values.min(axis=0), values.max(axis=0)


# ------------------------------------------------------------------------------ plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_comparison(
    runs: Sequence[RunMetrics],
    path: str | os.PathLike[str],
    title: str,
    target: float | None = None,
) -> None:
    """Two panels, every algorithm on each: accuracy vs round, and accuracy vs cumulative
    bytes (log scale). Several seeds: the mean with a min-max band."""
    plt = _pyplot()
    grouped: dict[str, list[RunMetrics]] = {}
    for run in runs:
        if run.history:
            grouped.setdefault(run.algorithm, []).append(run)
    figure, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    colors = plt.get_cmap("tab10" if len(grouped) <= 10 else "tab20")
    for index, (algorithm, members) in enumerate(grouped.items()):
        # Colour, line style and marker all change from one algorithm to the next, so curves
        # that lie on top of each other (FedAvg and FedProx at a small mu) stay visible.
        style = {
            "color": colors(index % colors.N),
            "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
            "marker": MARKERS[index % len(MARKERS)],
            "markersize": 5,
            "markerfacecolor": "none",
            "linewidth": 1.4,
        }
        rounds, mean, low, high = mean_curve(members, "accuracy")
        _, bytes_mean, _, _ = mean_curve(members, "cumulative_bytes")
        label = algorithm if len(members) == 1 else f"{algorithm} ({len(members)} seeds)"
        by_round.plot(rounds, mean, label=label, **style)
        by_bytes.plot(bytes_mean, mean, label=label, **style)
        color = style["color"]
        if len(members) > 1:
            by_round.fill_between(rounds, low, high, color=color, alpha=0.15)
            by_bytes.fill_between(bytes_mean, low, high, color=color, alpha=0.15)
    for axes in (by_round, by_bytes):
        axes.set_ylabel("test accuracy")
        axes.grid(True, alpha=0.3)
        if target is not None:
            axes.axhline(
                target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}"
            )
    by_round.set_xlabel("communication round")
    by_round.set_title("accuracy vs round")
    by_round.xaxis.get_major_locator().set_params(integer=True)
    by_bytes.set_xlabel("cumulative bytes communicated, up and down (log scale, setup included)")
    by_bytes.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    by_bytes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    by_bytes.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: tick_bytes(value)))
    by_bytes.xaxis.set_minor_formatter(NullFormatter())
    by_bytes.set_title("accuracy vs communication")
    by_round.legend(loc="lower right", fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_run_curves(
    history: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str
) -> None:
    """One run's learning curves: accuracy (global and mean client) and loss vs round."""
    plt = _pyplot()
    rounds = [int(record["round"]) for record in history]
    figure, (accuracy_axes, loss_axes) = plt.subplots(
        1, 2, figsize=(10, 4), constrained_layout=True
    )
    _plot_round_metric(accuracy_axes, rounds, history, "accuracy", marker="o", label="global test set")
    _plot_round_metric(
        accuracy_axes, rounds, history, "client_accuracy_mean", marker="s",
        label="mean over clients' local test sets",
    )
    accuracy_axes.set_xlabel("communication round")
    accuracy_axes.set_ylabel("accuracy")
    accuracy_axes.legend(loc="lower right", fontsize="small")
    _plot_round_metric(loss_axes, rounds, history, "loss", marker="o", color="tab:red")
    loss_axes.set_xlabel("communication round")
    loss_axes.set_ylabel("global test loss")
    for axes in (accuracy_axes, loss_axes):
        axes.grid(True, alpha=0.3)
        axes.xaxis.get_major_locator().set_params(integer=True)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_round_metric(
    axes: Any, rounds: list[int], history: Sequence[dict[str, Any]], key: str, **style: Any
) -> None:
    """Draw ``key`` of each round's record against its round, in small markers (a gap where
    a record lacks it); ``style``: the marker, label or colour."""
    axes.plot(rounds, [record.get(key) for record in history], markersize=3, **style)


def plot_partition_heatmap(
    class_counts: np.ndarray, path: str | os.PathLike[str], title: str
) -> None:
    """The K x C class-count matrix as a heatmap (clients down, classes across), with the
    counts written in the cells when the matrix is small enough to read them."""
    plt = _pyplot()
    counts = np.asarray(class_counts)
    num_clients, num_classes = counts.shape
    width = min(max(6.0, 0.6 * num_classes + 2), 20.0)
    height = min(max(4.0, 0.35 * num_clients + 1.5), 20.0)
    figure, axes = plt.subplots(figsize=(width, height), constrained_layout=True)
    image = axes.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    figure.colorbar(image, ax=axes, label="samples")
    axes.set_xlabel("class")
    axes.set_ylabel("client")
    if num_classes <= 30:
        axes.set_xticks(range(num_classes))
    if num_clients <= 40:
        axes.set_yticks(range(num_clients))
    if num_clients * num_classes <= 400:
        threshold = counts.max() / 2 if counts.size else 0
        for client in range(num_clients):
            for label in range(num_classes):
                value = int(counts[client, label])
                axes.text(
                    label,
                    client,
                    str(value),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if value > threshold else "white",
                )
    axes.set_title(title, fontsize="medium")
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ----------------------------------------------------------------------------- writer


def write_curve_csv(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    fields: Sequence[str] = CURVE_FIELDS,
) -> None:
    """Write rows as CSV with a header (missing values as empty cells)."""
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if row.get(key) is None else row.get(key) for key in fields})


@dataclass(frozen=True)
class ReportFiles:
    """The files :func:`write_report` wrote."""

    comparison: Path
    curves_png: Path
    curves_csv: Path
    summary: Path


def write_report(
    runs: Sequence[RunMetrics], out_dir: str | os.PathLike[str], target: float, title: str
) -> ReportFiles:
    """Write ``comparison.md``, ``curves.png``, ``curves.csv`` and ``summary.json`` into
    ``out_dir`` (created if missing).

    Raises:
        DataError: ``runs`` is empty.
    """
    if not runs:
        raise DataError("no runs to compare: the params define no algorithms or seeds")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarize(runs, target)
    files = ReportFiles(
        out / "comparison.md", out / "curves.png", out / "curves.csv", out / "summary.json"
    )
    files.comparison.write_text(comparison_markdown(summaries, target, title))
    files.summary.write_text(json.dumps(summary_metrics(summaries), indent=2) + "\n")
    write_curve_csv(curve_rows(runs), files.curves_csv)
    plot_comparison(runs, files.curves_png, title, target)
    return files
