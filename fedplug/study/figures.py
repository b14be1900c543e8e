"""Which figures a study's ``plots:`` asks for (:func:`figure_plan`), and drawing them into
the report folder (:func:`draw_figures`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedplug.study.plots import (
    plot_cpd_box,
    plot_curves,
    plot_dots,
    plot_heatmap,
    plot_vs_axis,
    plot_weight_histogram,
)
from fedplug.study.spec import StudySpec, cell_id
from fedplug.study.statistics import summarise
from fedplug.study.tables import metric_name


def figure_plan(spec: StudySpec, records: Sequence[dict[str, Any]], prefix: str = "") -> list[tuple[str, Any]]:
    """The figures of ``spec.plots`` for ``records``: (file name, function that draws it
    into a given path), in order; file names start with ``prefix``. Empty without records."""
    if not records:
        return []
    rows = summarise(records, spec.headline_metric, spec.baseline, spec.baselines)
    target = float(records[0]["target"])
    base_title = f"{spec.name} on {records[0].get('dataset') or '?'}"
    plan: list[tuple[str, Any]] = []
    for plot in spec.plots:
        if plot.kind == "curves":
            for cell in dict.fromkeys(cell_id(record["cell"]) for record in records):
                members = [record for record in records if cell_id(record["cell"]) == cell]
                label = ", ".join(f"{axis} = {value}" for axis, value in members[0]["cell"].items())
                title = base_title + (f": {label}" if label else "")
                plan.append((f"{prefix}curves_{cell}.png", lambda path, members=members, title=title: plot_curves(
                    members, path, title, target, labels=spec.labels, baseline=spec.baseline,
                    baselines=spec.baselines)))
        elif plot.kind == "vs_axis":
            plan.append((f"{prefix}{plot.metric}_vs_{plot.axis}.png", lambda path, plot=plot: plot_vs_axis(
                rows, plot.axis, plot.metric, path, f"{base_title}: {metric_name(plot.metric)}", plot.log_x,
                labels=spec.labels)))
        elif plot.kind == "cpd_box":
            plan.append((f"{prefix}cpd_box.png", lambda path: plot_cpd_box(
                records, path, f"{base_title}: per-round median CPD", labels=spec.labels)))
        elif plot.kind == "heatmap":
            plan.append((f"{prefix}{plot.metric}_heatmap.png", lambda path, plot=plot: plot_heatmap(
                rows, spec.grid, plot.rows, plot.columns, plot.panels, plot.metric, path,
                f"{base_title}: {metric_name(plot.metric)}")))
        elif plot.kind in ("dots", "bars"):
            plan.append((f"{prefix}{plot.metric}_{plot.kind}.png", lambda path, plot=plot: plot_dots(
                rows, records, list(spec.grid), plot.metric, path, f"{base_title}: {metric_name(plot.metric)}",
                labels=spec.labels, bars=plot.kind == "bars", log_y=plot.log_y)))
        elif plot.kind == "weight_histogram":
            plan.append((f"{prefix}weight_histogram.png", lambda path: plot_weight_histogram(
                records, path, f"{base_title}: sample weights of the setup phase", labels=spec.labels)))
    return plan


def draw_figures(
    spec: StudySpec,
    records: Sequence[dict[str, Any]],
    folder: str | Path,
    prefix: str = "",
    save: Callable[[Path, Callable[[Path], None]], None] | None = None,
) -> list[str]:
    """Draw every figure of :func:`figure_plan` into ``folder``; returns the file names, in
    order. ``save(path, draw)`` (default: ``draw(path)``) lets the caller write each one its
    way (:func:`fedplug.output_folder.write_through_path`: atomically, never through a link)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for name, draw in figure_plan(spec, records, prefix):
        if save is None:
            draw(folder / name)
        else:
            save(folder / name, draw)
        names.append(name)
    return names
