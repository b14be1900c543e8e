"""Every number of the cross-paper benchmark's page (issue 40, item 5), computed once
from the benchmark's spec and records (:func:`benchmark_tables`) with
:mod:`fedplug.study.table_statistics`; :mod:`fedplug.study.benchmark_page` writes them.

The benchmark is one study (``pipelines/studies/benchmark.yaml``): its grid cells are the
skew families, its algorithms the methods, its ``baseline`` the reference (FedAvg), its
``headline_metric`` the primary metric. Every planned run is a reported run (tuning
trials live in their own file). Per family:

- each method against the reference (``cell_comparison``) where both have every draw the
  spec plans for them; those comparisons form one Holm family across the table
  (``comparison_family``); a method with fewer draws is incomplete and not compared;
- average ranks with bootstrap intervals, Friedman's p and Nemenyi's critical difference
  (``average_ranks``), over each set of draws the spec plans (:func:`family_rankings`:
  a method planned on 5 of 10 draws gets a ranking of its own);
- each run's plateau status on window means (``window_plateau``), and whether a
  comparison is a fixed-budget result (a curve not flat).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedplug.errors import ConfigError
from fedplug.study.spec import cell_id, display_name, grid_cells
from fedplug.study.table_statistics import (
    RANK_RESAMPLES,
    Values,
    average_ranks,
    cell_comparison,
    cell_values,
    comparison_family,
    window_plateau,
)

DEFAULT_REFERENCE = "fedavg"
"""The reference when the spec names no ``baseline``."""
ALPHA = 0.05
"""The family-wise error rate of the Holm correction across the table."""


@dataclass(frozen=True)
class BenchmarkTables:
    """Every number of the page, computed once (:func:`benchmark_tables`)."""

    spec: Any
    reference: str
    metric: str
    families: list[str]
    """Cell ids, in the spec's grid order."""
    methods: list[str]
    """Algorithm labels, in the spec's order (the reference among them)."""
    planned_sets: dict[tuple[str, str], frozenset[int]]
    """(family, method) -> the draws the spec plans for its reported runs."""
    draws: dict[tuple[str, str], dict[int, float]]
    """(family, method) -> the primary metric of each reported draw (mean over its seeds)."""
    plateaus: dict[tuple[str, str], Counter[str]]
    """(family, method) -> how many of its runs are flat, rising, falling, too short."""
    comparisons: dict[tuple[str, str], dict[str, Any]]
    """(family, method) -> its comparison with the reference, Holm-corrected across the
    table; only where both are complete."""
    rankings: dict[str, list[dict[str, Any]]]
    """family -> its rankings (:func:`family_rankings`), the one over the most draws first."""
    rounds: int
    """The most rounds of a reported run: a comparison whose curves are not all flat is a
    result at this fixed budget."""
    alpha: float

    @property
    def planned(self) -> dict[tuple[str, str], int]:
        """(family, method) -> how many draws the spec plans for it."""
        return {key: len(draws) for key, draws in self.planned_sets.items()}

    def present(self, family: str, method: str) -> int:
        return len(self.draws.get((family, method), {}))

    def complete(self, family: str, method: str) -> bool:
        planned = self.planned_sets.get((family, method))
        return planned is not None and self.present(family, method) >= len(planned)

    def fixed_budget(self, family: str, method: str) -> bool:
        """Whether a run of ``method`` or of the reference in ``family`` had not flattened
        (window means): the difference may still move with more rounds."""
        return any(status != "flat" for key in ((family, method), (family, self.reference))
                   for status, count in self.plateaus.get(key, Counter()).items() if count)

    def name(self, method: str) -> str:
        return display_name(method, self.spec.labels)


def reference_of(spec: Any) -> str:
    """The method every other one is compared with: the spec's ``baseline`` (default fedavg).

    Raises:
        ConfigError: the reference is not one of the spec's algorithms.
    """
    reference = spec.baseline or DEFAULT_REFERENCE
    if reference not in spec.algorithms:
        raise ConfigError(f"{spec.name}: the benchmark compares every method with {reference!r}, which is not one of "
                          f"its algorithms ({', '.join(spec.algorithms)}); set `baseline:` to one of them")
    return reference


def planned_draw_sets(spec: Any) -> dict[tuple[str, str], frozenset[int]]:
    """(family, method) -> the partition draws of its planned runs (a method the spec
    gives fewer draws, through ``pairs:``, has fewer)."""
    from fedplug.study.expansion import planned_runs

    draws: dict[tuple[str, str], set[int]] = {}
    for run in planned_runs(spec):
        draws.setdefault((run.cell_id, run.algorithm), set()).add(run.draw)
    return {key: frozenset(found) for key, found in draws.items()}


def planned_draws(spec: Any) -> dict[tuple[str, str], int]:
    """(family, method) -> the number of partition draws of its planned runs."""
    return {key: len(draws) for key, draws in planned_draw_sets(spec).items()}


def reported_records(spec: Any, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the spec's planned runs, in file order: every planned run of the
    benchmark is reported (its tuning trials live in their own file); records of runs the
    spec no longer plans are left out."""
    from fedplug.study.expansion import planned_runs

    planned = {run.run_id for run in planned_runs(spec)}
    return [record for record in records if record.get("run") in planned]


def draw_averages(values: Values) -> dict[int, float]:
    """Each draw's mean over its seeds of the values present, by draw."""
    by_draw: dict[int, list[float]] = {}
    for (draw, _), value in values.items():
        if value is not None and not math.isnan(value):
            by_draw.setdefault(draw, []).append(float(value))
    return {draw: float(np.mean(by_draw[draw])) for draw in sorted(by_draw)}


def benchmark_tables(spec: Any, records: Sequence[dict[str, Any]], alpha: float = ALPHA,
                     resamples: int = RANK_RESAMPLES) -> BenchmarkTables:
    """The page's numbers from the spec and its records (:func:`reported_records` of them).

    Each method is compared with the reference in each family where both have every
    planned draw; those comparisons form one Holm family. Ranks per family are over its
    complete methods (the reference included), ``resamples`` bootstrap resamples each."""
    reference = reference_of(spec)
    metric = spec.headline_metric
    reported = reported_records(spec, records)
    values = cell_values(reported, metric)
    families = [cell_id(cell) for cell in grid_cells(spec.grid)]
    methods = list(spec.algorithms)
    planned = planned_draw_sets(spec)
    draws = {(family, method): draw_averages(by_seed)
             for family, by_method in values.items() for method, by_seed in by_method.items()}
    plateaus: dict[tuple[str, str], Counter[str]] = {}
    for record in reported:
        key = (cell_id(record["cell"]), record["algorithm"])
        plateaus.setdefault(key, Counter())[window_plateau(record.get("accuracy") or [])] += 1
    rounds = max((int(record.get("rounds") or 0) for record in reported), default=0)
    tables = BenchmarkTables(spec, reference, metric, families, methods, planned, draws, plateaus, {}, {}, rounds,
                             alpha)
    compared = {
        (family, method): cell_comparison(values[family][method], values[family][reference])
        for family in families for method in methods
        if method != reference and tables.complete(family, method) and tables.complete(family, reference)
    }
    tables.comparisons.update(comparison_family(compared, alpha) if compared else {})
    for family in families:
        tables.rankings[family] = family_rankings(tables, family, resamples)
    return tables


def family_rankings(tables: BenchmarkTables, family: str, resamples: int = RANK_RESAMPLES) -> list[dict[str, Any]]:
    """The family's average ranks (``average_ranks``) over each set of draws the spec
    plans for some complete method, the largest first: the first ranks the methods planned
    on every draw; one planned on fewer (5 of 10, say) is ranked in a second ranking,
    over its draws, with every method planned on them. A ranking needs 2 methods."""
    complete = [method for method in tables.methods if tables.complete(family, method)]
    draw_sets = sorted({tables.planned_sets[(family, method)] for method in complete},
                       key=lambda draws: (-len(draws), sorted(draws)))
    rankings = []
    for draws in draw_sets:
        members = [method for method in complete if tables.planned_sets[(family, method)] >= draws]
        if len(members) >= 2:
            scores = {method: {draw: value for draw, value in tables.draws[(family, method)].items() if draw in draws}
                      for method in members}
            rankings.append(average_ranks(scores, resamples=resamples, alpha=tables.alpha))  # type: ignore[arg-type]
    return rankings
