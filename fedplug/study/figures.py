"""Which figures a study's ``plots:`` asks for (:func:`figure_plan`), and drawing them into
the report folder (:func:`draw_figures`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedplug.analysis import Analysis, BoxFigure, registered_analysis
from fedplug.errors import ConfigError
from fedplug.study.plots import (
    plot_curves,
    plot_dots,
    plot_heatmap,
    plot_metric_box,
    plot_setup_histogram,
    plot_vs_axis,
)
from fedplug.study.spec import BUILTIN_PLOT_KINDS, StudySpec, cell_id, known_plot_kinds
from fedplug.study.statistics import summarise
from fedplug.study.tables import metric_name


def figure_plan(spec: StudySpec, records: Sequence[dict[str, Any]], prefix: str = "",
                analysis: Analysis | None = None) -> list[tuple[str, Any]]:
    """The figures of ``spec.plots`` for ``records``: (file name, function that draws it
    into a given path), in order; file names start with ``prefix``. Empty without records.
    A plot kind that is none of the study's own is a figure a component declares in
    ``analysis`` (default: the registered components',
    :func:`~fedplug.analysis.registered_analysis`), drawn as its box plot or histogram.

    Raises:
        ConfigError: a plot kind that neither the study nor any component declares.
    """
    if not records:
        return []
    analysis = registered_analysis() if analysis is None else analysis
    rows = summarise(records, spec.headline_metric, spec.baseline, spec.baselines, analysis)
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
        elif plot.kind == "heatmap":
            plan.append((f"{prefix}{plot.metric}_heatmap.png", lambda path, plot=plot: plot_heatmap(
                rows, spec.grid, plot.rows, plot.columns, plot.panels, plot.metric, path,
                f"{base_title}: {metric_name(plot.metric)}")))
        elif plot.kind in ("dots", "bars"):
            plan.append((f"{prefix}{plot.metric}_{plot.kind}.png", lambda path, plot=plot: plot_dots(
                rows, records, list(spec.grid), plot.metric, path, f"{base_title}: {metric_name(plot.metric)}",
                labels=spec.labels, bars=plot.kind == "bars", log_y=plot.log_y)))
        elif plot.kind not in BUILTIN_PLOT_KINDS:
            declared = analysis.figure(plot.kind)
            if declared is None:
                raise ConfigError(f"plots: no component declares a figure {plot.kind!r}; "
                                  f"kinds: {', '.join(known_plot_kinds(analysis))}")
            draw = plot_metric_box if isinstance(declared, BoxFigure) else plot_setup_histogram
            plan.append((f"{prefix}{declared.kind}.png", lambda path, declared=declared, draw=draw: draw(
                records, path, f"{base_title}: {declared.title}", declared, labels=spec.labels)))
    return plan



def draw_figures(
    spec: StudySpec,
    records: Sequence[dict[str, Any]],
    folder: str | Path,
    prefix: str = "",
    save: Callable[[Path, Callable[[Path], None]], None] | None = None,
    analysis: Analysis | None = None,
) -> list[str]:
    """Draw every figure of :func:`figure_plan` into ``folder``; returns the file names, in
    order. ``save(path, draw)`` (default: ``draw(path)``) lets the caller write each one its
    way (:func:`fedplug.output_folder.write_through_path`: atomically, never through a link);
    ``analysis`` as in :func:`figure_plan`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for name, draw in figure_plan(spec, records, prefix, analysis):
        if save is None:
            draw(folder / name)
        else:
            save(folder / name, draw)
        names.append(name)
    return names
