"""What a component asks a study to keep and draw of what it reports: the per-round
metrics to summarise as columns, the setup-report entries a record keeps, and the figures
drawn from them. A component config declares an :class:`Analysis` (``analysis`` on its
class); the study code (:mod:`fedplug.study`) reads the union over the registry
(:func:`registered_analysis`) and names no algorithm itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fedplug.registry import Registry

Reduction = Literal["median", "mean", "last", "min", "max"]


@dataclass(frozen=True)
class RoundMetricColumn:
    """A per-round metric (a key of each round's record, :meth:`round_metrics`) that a
    study reduces over the rounds into one column of each run's record and of the
    summary table, and keeps round by round under ``series`` (for box plots)."""

    metric: str
    """The key in each round's record, e.g. ``cpd_median``."""
    title: str
    """The column's name in tables and on axes, e.g. ``median CPD``."""
    reduce: Reduction = "median"
    """How the rounds' values become one number per run (rounds without a value skipped)."""
    column: str | None = None
    """The record and summary column (default: ``metric``)."""
    series: str | None = None
    """The record key of the per-round values, written when any round has one (default
    None: not kept)."""
    digits: int = 4
    """Decimals in the summary table."""

    @property
    def name(self) -> str:
        """The record and summary column."""
        return self.column or self.metric


@dataclass(frozen=True)
class SetupSummary:
    """Entries of a run's setup report (``setup_report`` in metrics.json) that its study
    record keeps under ``key``, compactly: a histogram ``{"edges", "counts"}`` and some
    per-client lists, 4 significant digits."""

    key: str
    """The record key, e.g. ``weights``."""
    prefix: str
    """The setup report's key prefix, e.g. ``sample_weight.`` for ``sample_weight.histogram``."""
    per_client: tuple[str, ...] = ()
    """The per-client lists kept (``<prefix><name>``), e.g. ``("median", "std")``."""
    histogram: str = "histogram"
    """The histogram entry (``<prefix><histogram>``); without it the record keeps nothing."""


@dataclass(frozen=True)
class BoxFigure:
    """A box plot of a per-round metric's values (a :class:`RoundMetricColumn`'s
    ``series``), one box per grid cell and algorithm, runs pooled."""

    kind: str
    """The plot kind a study file names (``plots: [{kind: ...}]``) and the figure's file name."""
    series: str
    """The record key of the per-round values."""
    title: str
    """Appended to the study's title, e.g. ``per-round median CPD``."""
    axis_label: str
    """The value axis's label."""
    note: str = ""
    """The caption's first sentences: what the metric is."""


@dataclass(frozen=True)
class HistogramFigure:
    """Small multiples of a setup summary's histogram (:class:`SetupSummary`), one panel
    per grid cell x algorithm, pooled over the runs, with a reference value marked."""

    kind: str
    """The plot kind a study file names and the figure's file name."""
    summary: str
    """The record key of the :class:`SetupSummary`."""
    title: str
    """Appended to the study's title."""
    value_label: str
    """The value axis's label, e.g. ``sample weight``."""
    spread: str = "std"
    """The per-client list whose median each panel shows (``median client <spread>``)."""
    reference: float | None = None
    """A value to mark with a dashed line (None: none)."""
    reference_label: str = ""
    """The words beside the reference line."""
    note: str = ""
    """The caption (before the line naming the grid axes of the rows)."""


Figure = BoxFigure | HistogramFigure


@dataclass(frozen=True)
class Analysis:
    """What a study summarises and draws of one component's reports (empty by default)."""

    columns: tuple[RoundMetricColumn, ...] = ()
    setup_summaries: tuple[SetupSummary, ...] = ()
    figures: tuple[Figure, ...] = ()

    def __or__(self, other: Analysis) -> Analysis:
        """Both declarations, each name once (a repeated name must be declared alike)."""
        return Analysis(
            columns=_merged(self.columns, other.columns, lambda item: item.name),
            setup_summaries=_merged(self.setup_summaries, other.setup_summaries, lambda item: item.key),
            figures=_merged(self.figures, other.figures, lambda item: item.kind),
        )

    def column(self, name: str) -> RoundMetricColumn | None:
        """The declared column ``name``, or None."""
        return next((column for column in self.columns if column.name == name), None)

    def figure(self, kind: str) -> Figure | None:
        """The declared figure of plot kind ``kind``, or None."""
        return next((figure for figure in self.figures if figure.kind == kind), None)


def _merged(first: tuple, second: tuple, name) -> tuple:  # type: ignore[no-untyped-def]
    merged = {name(item): item for item in first}
    for item in second:
        known = merged.setdefault(name(item), item)
        if known != item:
            raise ValueError(f"two components declare {name(item)!r} differently for a study "
                             f"({known} and {item}); give one of them another name")
    return tuple(merged.values())


def registered_analysis(registry: Registry | None = None) -> Analysis:
    """The union of every registered component's :class:`Analysis` (``registry`` default:
    the environment's, :func:`fedplug.plugins.default_registry`)."""
    if registry is None:
        from fedplug.plugins import default_registry

        registry = default_registry()
    from fedplug.registry import KINDS

    analysis = Analysis()
    for kind in KINDS:
        for entry in registry.entries(kind):
            analysis = analysis | getattr(entry.config_class, "analysis", Analysis())
    return analysis
