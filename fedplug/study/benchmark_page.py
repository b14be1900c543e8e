"""The cross-paper benchmark's page (issue 40, item 5): ``docs/benchmark.md`` as Markdown,
from the numbers of :mod:`fedplug.study.benchmark_numbers` and the tuning trials
(``results/benchmark.trials.jsonl``, :func:`load_trials`).

:func:`render_page` writes the plan, the heatmap's link and caption, the "what to use
when" summary (its numbers are formatted by the same functions from the same comparisons
as the family tables, never typed), per family the comparison table and the ranks, and
each method's searches. A method with fewer reported draws in a family than the spec
plans is "incomplete (n of N draws)" there. Before any reported run the page says the
benchmark has not run yet and lists the planned cells. The figure is drawn by
:mod:`fedplug.study.benchmark_heatmap`; ``pipelines/studies/render_benchmark.py`` is the
thin script around both.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedplug.errors import ConfigError, DataError
from fedplug.study.benchmark_numbers import (
    ALPHA,
    BenchmarkTables,
    benchmark_tables,
    planned_draws,
    reference_of,
    reported_records,
)
from fedplug.study.spec import RUN_ID_PATTERN, ParamRange, cell_id, display_name, grid_cells
from fedplug.study.table_statistics import (
    PLATEAU_STATUSES,
    WINDOW_PLATEAU_TOLERANCE,
    WINDOW_PLATEAU_WINDOW,
)

COMMAND = "python pipelines/studies/render_benchmark.py"
"""The command that writes the page (and, with ``--check``, tells whether it is current)."""
PROTOCOL_PAGE = "benchmark_protocol.md"
"""The pre-registered protocol, beside the page in ``docs/``."""
HEATMAP_FILE = "img/benchmark_heatmap.png"
"""The heatmap, relative to the page's folder."""
EDGE_SHARE = 0.05
"""A chosen value within this share of a continuous range's ends (in its scale) is at its edge."""
TITLE = "# Benchmark: which fix for which skew"


@dataclass(frozen=True)
class Sources:
    """The inputs the page names, as paths relative to the repository root."""

    spec: str = "pipelines/studies/benchmark.yaml"
    results: str = "pipelines/studies/results/benchmark.jsonl"
    trials: str = "pipelines/studies/results/benchmark.trials.jsonl"
    command: str = COMMAND


# ---------------------------------------------------------------------- numbers as text


def number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def signed(value: float | None, digits: int = 4) -> str:
    """``+0.0500``; a value that rounds to zero is ``+0.0000``, never ``-0.0000``."""
    if value is None:
        return "-"
    return f"{value if round(value, digits) != 0 else 0.0:+.{digits}f}"


def p_text(p: float | None) -> str:
    """A p-value as the page writes it: 4 decimals, ``< 0.0001`` below that, ``-`` untested."""
    if p is None:
        return "-"
    return "< 0.0001" if p < 0.0001 else f"{p:.4f}"


def interval_text(low: float | None, high: float | None) -> str:
    return "(no interval)" if low is None or high is None else f"[{signed(low)}, {signed(high)}]"


def difference_text(comparison: dict[str, Any]) -> str:
    """``+0.0500 [+0.0480, +0.0520]``: the mean difference over draws and its 95% interval."""
    return f"{signed(comparison['difference'])} {interval_text(comparison['low'], comparison['high'])}"


def won_text(comparison: dict[str, Any]) -> str:
    return f"{comparison['won']} of {comparison['partitions']}"


def incomplete_text(present: int, planned: int) -> str:
    return f"incomplete ({present} of {planned} draws)"


def plateau_text(statuses: Counter[str] | None) -> str:
    """``flat 8, rising 2``: the runs' window-mean plateau statuses, in a fixed order."""
    if not statuses:
        return "-"
    return ", ".join(f"{status} {statuses[status]}" for status in PLATEAU_STATUSES if statuses[status])


def mean_sd_text(by_draw: dict[int, float]) -> str:
    """``0.9012 (0.0040)``: mean and sample sd over the draws' values."""
    if not by_draw:
        return "-"
    values = list(by_draw.values())
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return number(float(np.mean(values))) + (f" ({number(sd)})" if sd is not None else "")


def rank_text(rank: dict[str, Any]) -> str:
    return f"{rank['rank']:.2f} [{rank['low']:.2f}, {rank['high']:.2f}]"


def code(value: Any) -> str:
    """``value`` as a code span in a table cell: control characters become spaces, ``|``
    is escaped and the fence outgrows any backticks inside (record text is data)."""
    text = re.sub(r"[\x00-\x1f\x7f\u2028\u2029]+", " ", str(value)).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    padding = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{padding}{text}{padding}{fence}"


def value_text(value: Any) -> str:
    """A tuned value: a number as ``%g``, anything else as a code span."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return code(json.dumps(value) if not isinstance(value, str) else value)


# --------------------------------------------------------------------------- trials


def load_trials(path: str | Path) -> list[dict[str, Any]]:
    """The tuning trials of a trials file, one JSON object a line (none when there is no
    file). Read tolerantly: the runner's fields (``cell``, ``algorithm``, ``values``,
    ``score``, ``state``) are used where present and well formed, anything else is ignored.

    Raises:
        DataError: a line is not a JSON object (the message names the file and line), or
            a FIFO, socket or device lies at ``path``.
    """
    from fedplug.safe_files import read_regular_bytes

    advice = "restore the file from git or re-run the study's tuning"
    try:
        text = read_regular_bytes(path, what="tuning trials file", advice=advice, error=DataError).decode()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    trials = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            trial = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{line_number}: not JSON ({error.msg}); {advice}") from None
        if not isinstance(trial, dict):
            raise DataError(f"{path}:{line_number}: a trial is a JSON object; {advice}")
        trials.append(trial)
    return trials


def trial_key(trial: dict[str, Any]) -> tuple[str, str] | None:
    """(family, method) of a trial; None when its cell or algorithm is not a plain label."""
    cell, algorithm = trial.get("cell"), trial.get("algorithm")
    if isinstance(cell, dict) and all(isinstance(label, str) for label in cell.values()):
        cell = cell_id(cell)
    if not (isinstance(cell, str) and isinstance(algorithm, str)
            and RUN_ID_PATTERN.fullmatch(cell) and RUN_ID_PATTERN.fullmatch(algorithm)):
        return None
    return cell, algorithm


def trial_score(trial: dict[str, Any]) -> float | None:
    score = trial.get("score", trial.get("value"))
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return None
    return float(score)


def trial_state(trial: dict[str, Any]) -> str:
    state = trial.get("state")
    return state.lower() if isinstance(state, str) and state.lower() in ("complete", "pruned", "failed") else "unknown"


def is_edge(value: Any, searched: Any) -> bool:
    """Whether a chosen value lies at the edge of what was searched: the smallest or
    largest number of a list of at least 2 (:func:`fedplug.study.tables.tuned_table`'s
    rule), or within :data:`EDGE_SHARE` of either end of a range, on its log scale for a
    log range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(searched, list):
        numbers = [item for item in searched if isinstance(item, (int, float)) and not isinstance(item, bool)]
        return len(numbers) >= 2 and value in (min(numbers), max(numbers))
    if isinstance(searched, ParamRange):
        scale = (lambda x: math.log(x)) if searched.log and value > 0 else (lambda x: x)
        low, high, at = scale(searched.low), scale(searched.high), scale(value)
        return min(at - low, high - at) <= EDGE_SHARE * (high - low)
    return False


def search_space(spec: Any, method: str) -> dict[str, Any]:
    """The paths searched for ``method``: ``tune.params`` and its ``algorithm_params``."""
    if spec.tune is None:
        return {}
    return {**spec.tune.params, **spec.tune.algorithm_params.get(method, {})}


# ----------------------------------------------------------------------------- the page


def generated_note(sources: Sources) -> str:
    return (f"<!-- Generated by pipelines/studies/render_benchmark.py from {sources.spec}, {sources.results} and "
            f"{sources.trials}: edit those (or the renderer), not this page. -->")


def source_link(path: str) -> str:
    """A repository file as the page (in ``docs/``) links it."""
    return f"[`{path}`]({path if Path(path).is_absolute() else '../' + path})"


def header(sources: Sources) -> list[str]:
    return [TITLE, "", generated_note(sources), "",
            (f"The protocol (the federation, the skew families and their severities, the methods, the metrics, "
            f"the tuning budget and the correction for multiple comparisons, fixed before any run) is on "
            f"[the protocol page]({PROTOCOL_PAGE}). This page is generated from the benchmark's records by "
            f"`{sources.command}`; `{sources.command} --check` fails when it, or its figure, is out of date.")]


def plan_text(spec: Any, sources: Sources) -> str:
    """What the spec runs: families, methods, draws per method, seeds, rounds, metric."""
    from fedplug.study.expansion import planned_runs
    from fedplug.study.tables import metric_name

    planned = planned_draws(spec)
    families = [cell_id(cell) for cell in grid_cells(spec.grid)]
    counts = Counter(planned.values())
    usual = counts.most_common(1)[0][0] if counts else 0
    fewer = sorted({display_name(method, spec.labels) + f" {count}"
                    for (_, method), count in planned.items() if count != usual})
    rounds = (spec.base.get("train") or {}).get("rounds", "?")
    reference = display_name(reference_of(spec), spec.labels)
    return (f"**Plan** (from `{sources.spec}`): {len(families)} families ({', '.join(code(f) for f in families)}) × "
            f"{len(spec.algorithms)} methods ({', '.join(display_name(m, spec.labels) for m in spec.algorithms)}), "
            f"{len(planned_runs(spec))} runs; {usual} partition draws per method and family"
            + (f" (fewer: {', '.join(fewer)})" if fewer else "")
            + f", training seeds {spec.seeds}; {rounds} rounds; primary metric: {metric_name(spec.headline_metric)}, "
            f"each method against {reference} in each family, Holm-corrected across the table at α = {ALPHA:g}.")


def not_run_page(spec: Any | None, sources: Sources) -> str:
    """The page before any record: what is planned, and how to run it."""
    lines = header(sources) + [""]
    if spec is None:
        lines.append(f"**The benchmark has not run yet**, and its spec `{sources.spec}` is not committed yet: "
                     f"once it is, this page lists its planned cells.")
        return "\n".join(lines) + "\n"
    planned = planned_draws(spec)
    lines += [(f"**The benchmark has not run yet**: {source_link(sources.results)} holds no reported runs. "
              f"Run `python pipelines/studies/run_study.py {sources.spec}`, then `{sources.command}`."), "",
              plan_text(spec, sources), "", "Planned cells (partition draws per method):", "",
              "| family | " + " | ".join(display_name(method, spec.labels) for method in spec.algorithms) + " |",
              "|---|" + "---:|" * len(spec.algorithms)]
    for family in (cell_id(cell) for cell in grid_cells(spec.grid)):
        lines.append(f"| {code(family)} | " + " | ".join(
            str(planned.get((family, method), "-")) for method in spec.algorithms) + " |")
    return "\n".join(lines) + "\n"


def provenance_text(records: Sequence[dict[str, Any]]) -> str:
    """``commit `abc1234` `` or ``commits `abc1234` (30 runs), `def5678` (10 runs)``."""
    commits = Counter(str(record.get("commit") or "unknown")[:7] for record in records)
    if len(commits) == 1:
        return f"commit `{next(iter(commits))}`"
    return "commits " + ", ".join(f"`{commit}` ({count} runs)" for commit, count in commits.items())


def heatmap_section(tables: BenchmarkTables) -> list[str]:
    from fedplug.study.tables import metric_name

    return ["## Differences against " + tables.name(tables.reference), "",
            (f"![methods × families: mean difference in {metric_name(tables.metric)} against "
            f"{tables.name(tables.reference)}]({HEATMAP_FILE})"), "",
            (f"Each cell: the mean over partition draws of the method's {metric_name(tables.metric)} minus "
            f"{tables.name(tables.reference)}'s (runs of the same draw and seed); `*` where the Holm-adjusted p-value "
            f"across the table's {len(tables.comparisons)} comparisons is ≤ {tables.alpha:g}; a blank cell with "
            "`n/N` is incomplete (n of the N planned draws).")]


def summary_section(tables: BenchmarkTables) -> list[str]:
    """"What to use when": per family the methods better (and worse) than the reference
    after Holm, every number the family table's own text for it."""
    from fedplug.study.tables import metric_name

    reference = tables.name(tables.reference)
    lines = ["## What to use when", "",
             (f"Per skew family, the methods whose {metric_name(tables.metric)} is above {reference}'s after the "
             f"Holm correction across the whole table (α = {tables.alpha:g}); quoted from the tables below."), ""]
    for family in tables.families:
        compared = {method: tables.comparisons[(family, method)] for method in tables.methods
                    if (family, method) in tables.comparisons}
        if not compared:
            lines.append(f"- {code(family)}: not compared yet (no method and {reference} both complete).")
            continue
        better = sorted((method for method, c in compared.items() if c["significant"] and c["difference"] > 0),
                        key=lambda method: -compared[method]["difference"])
        worse = [method for method, c in compared.items() if c["significant"] and c["difference"] < 0]
        text = (", ".join(f"**{tables.name(method)}** ({quoted(compared[method], fixed_budget_text(tables, family, method))})"
                          for method in better)
                + f" beat{'s' if len(better) == 1 else ''} {reference} after correction" if better
                else f"none beats {reference} after correction")
        if worse:
            text += "; worse than it after correction: " + ", ".join(
                f"{tables.name(method)} ({quoted(compared[method], fixed_budget_text(tables, family, method))})"
                for method in worse)
        ranks = (tables.rankings.get(family) or [None])[0]
        if ranks is not None and ranks["draws"]:
            first = min(ranks["methods"], key=lambda method: ranks["ranks"][method]["rank"])
            text += f"; ranked first: {tables.name(first)} (average rank {rank_text(ranks['ranks'][first])})"
        skipped = len([m for m in tables.methods if (family, m) in tables.planned and not tables.complete(family, m)])
        if skipped:
            text += f"; {skipped} method{'s' if skipped != 1 else ''} incomplete, not compared"
        lines.append(f"- {code(family)}: {text}.")
    return lines


def quoted(comparison: dict[str, Any], fixed_budget: str = "") -> str:
    """A comparison as the summary quotes it, in the family table's own words."""
    return (f"{difference_text(comparison)}, Holm-adjusted p {p_text(comparison['p_holm'])}, "
            f"won {won_text(comparison)} draws" + (f"; {fixed_budget}" if fixed_budget else ""))


def fixed_budget_text(tables: BenchmarkTables, family: str, method: str) -> str:
    """``fixed-budget (100 rounds)`` when a curve of the comparison had not flattened, else ""."""
    return f"fixed-budget ({tables.rounds} rounds)" if tables.fixed_budget(family, method) else ""


def family_section(tables: BenchmarkTables, family: str) -> list[str]:
    """One family: each method against the reference, then the average ranks."""
    reference = tables.name(tables.reference)
    size = next(iter(tables.comparisons.values()))["family_size"] if tables.comparisons else 0
    lines = [f"### {code(family)}", "",
             (f"| method | draws | mean (sd over draws) | difference vs {reference} [95% interval] | "
             f"simultaneous interval (Bonferroni, m = {size}) | p | Holm-adjusted p | beats or trails {reference} "
             f"after Holm | draws won | plateau (window means) |"),
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for method in tables.methods:
        key = (family, method)
        if key not in tables.planned:
            continue
        present, planned = tables.present(family, method), tables.planned[key]
        cells = [tables.name(method) + (" (reference)" if method == tables.reference else ""),
                 f"{present} of {planned}" if present < planned else str(present),
                 mean_sd_text(tables.draws.get(key, {}))]
        comparison = tables.comparisons.get(key)
        if method == tables.reference:
            cells += ["-"] * 6
        elif comparison is None:
            missing = (incomplete_text(present, planned) if present < planned else
                       f"{reference} {incomplete_text(tables.present(family, tables.reference), tables.planned.get((family, tables.reference), 0))}")
            cells += [missing] + ["-"] * 5
        else:
            verdict = ("beats" if comparison["difference"] > 0 else "trails") if comparison["significant"] else "no"
            verdict += "; " + fixed_budget_text(tables, family, method) if tables.fixed_budget(family, method) else ""
            cells += [difference_text(comparison),
                      interval_text(comparison["low_simultaneous"], comparison["high_simultaneous"]),
                      p_text(comparison["p_value"]), p_text(comparison["p_holm"]), verdict, won_text(comparison)]
        cells.append(plateau_text(tables.plateaus.get(key)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""] + ranks_lines(tables, family)


def ranks_lines(tables: BenchmarkTables, family: str) -> list[str]:
    """The family's rankings (:func:`family_rankings`), each best first, with Friedman's
    test and Nemenyi's CD; the methods not ranked because they are incomplete."""
    rankings = tables.rankings.get(family) or []
    lines: list[str] = []
    for number, ranks in enumerate(rankings):
        lines += ranking_lines(tables, ranks, second=number > 0) + [""]
    if not rankings:
        lines += [f"_Ranks: fewer than 2 methods have all their draws in {code(family)}._", ""]
    incomplete = [tables.name(m) for m in tables.methods
                  if (family, m) in tables.planned_sets and not tables.complete(family, m)]
    if incomplete:
        lines += [f"Not ranked (incomplete): {', '.join(incomplete)}.", ""]
    return lines[:-1]


def ranking_lines(tables: BenchmarkTables, ranks: dict[str, Any], second: bool) -> list[str]:
    """One ranking as a table, best first, and its Friedman test and Nemenyi CD."""
    order = sorted(ranks["methods"], key=lambda method: (ranks["ranks"][method]["rank"], ranks["methods"].index(method)))
    lead = (f"{'Also ranked, with the methods planned on fewer draws: average' if second else 'Average'} ranks "
            f"(1 = best) over draws {draws_text(ranks['draws'])}, with {100 * ranks['confidence']:g}% bootstrap "
            f"intervals ({ranks['resamples']} resamples of the draws):")
    lines = [lead, "", "| rank | method | average rank [interval] |", "|---:|---|---:|"]
    lines += [f"| {place} | {tables.name(method)} | {rank_text(ranks['ranks'][method])} |"
              for place, method in enumerate(order, 1)]
    friedman = ("Friedman's test: not defined (fewer than 3 methods or 2 draws, or every draw a tie)"
                if ranks["friedman_p"] is None else
                f"Friedman's test: χ² = {ranks['friedman_statistic']:.2f}, p = {p_text(ranks['friedman_p'])}")
    return lines + ["", (f"{friedman}; Nemenyi's critical difference at α = {ranks['alpha']:g}: "
                         f"{ranks['critical_difference']:.2f} (two methods whose average ranks differ by at least "
                         "this differ).")]


def draws_text(draws: Sequence[int]) -> str:
    """``0-9`` for consecutive draws, else ``0, 2, 5``."""
    ordered = sorted(draws)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def tuning_section(tables: BenchmarkTables, records: Sequence[dict[str, Any]], trials: Sequence[dict[str, Any]],
                   sources: Sources) -> list[str]:
    """Each method's searches per family (a search re-run on a widened space is a second
    one): trials by state, best score, the best trial's values with their edge flags, and
    whether the reported runs trained with them."""
    spec = tables.spec
    lines = ["## Tuned values and searches", ""]
    if spec.tune is None:
        return lines + ["The spec has no `tune:` section: every method runs at the spec's values."]
    tune = spec.tune
    budget = f"{tune.trials} trials" if tune.trials else "every grid point once"
    tuning_draws = getattr(tune, "draws", None)  # tuning draws apart from the reported ones, where the spec has them
    lines += [f"The spec's `tune:`: Optuna's {tune.sampler} sampler, {budget} per method"
              f"{' and family' if tune.per_cell else ''}, chosen on {tune.metric} {selection_text(tune)}"
              + (f", on partition draws {tuning_draws}" if tuning_draws else "")
              + f"; every trial is a line of {source_link(sources.trials)} ({len(trials)} trials). A value at the "
              "edge of its search space is marked (edge); a search re-run on a widened space is listed after the first.",
              "", ("| family | method | search | trials (complete / pruned / failed) | best score | best values | "
                   "used by the runs |"), "|---|---|---:|---:|---:|---|---|"]
    chosen: dict[tuple[str, str], dict[str, Any]] = {}
    for record in reported_records(spec, records):
        if isinstance(record.get("tuned"), dict):
            chosen.setdefault((cell_id(record["cell"]), record["algorithm"]), record["tuned"])
    searches = trial_searches(trials)
    for family in tables.families:
        for method in tables.methods:
            key = (family, method)
            runs_values = chosen.get(key)
            for number, searched in enumerate(searches.get(key, []), 1):
                best = best_trial(searched, maximise=tune.metric != "val_loss")
                values = trial_values(best) if best else {}
                states = Counter(trial_state(trial) for trial in searched)
                lines.append(f"| {code(family)} | {tables.name(method)} | {number} | {len(searched)} ({states['complete']} "
                             f"/ {states['pruned']} / {states['failed']}) | {number_or_dash(best)} | "
                             f"{values_text(values, best, search_space(spec, method))} | "
                             f"{'yes' if runs_values is not None and runs_values == values else '-'} |")
            if key in chosen and not any(trial_values(best_trial(searched, tune.metric != "val_loss")) == runs_values
                                         for searched in searches.get(key, [])):
                lines.append(f"| {code(family)} | {tables.name(method)} | - | no trials in the file | - | "
                             f"{values_text(runs_values or {}, None, search_space(spec, method))} | yes |")
    unequal = unequal_budgets(tables, searches)
    lines += ["", ("Trials per method within each family (each method's last search): equal." if not unequal else
                   "**Unequal trials per method within a family** (each method's last search): "
                   + "; ".join(unequal) + ".")]
    return lines


def trial_searches(trials: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[list[dict[str, Any]]]]:
    """(family, method) -> its searches in file order, each its trials: trials of one
    search share a ``fingerprint`` (else a ``search`` key; else they are one search)."""
    grouped: dict[tuple[str, str], dict[Any, list[dict[str, Any]]]] = {}
    for trial in trials:
        key = trial_key(trial)
        if key is not None:
            search = trial.get("fingerprint", trial.get("search"))
            grouped.setdefault(key, {}).setdefault(search if isinstance(search, str) else None, []).append(trial)
    return {key: list(by_search.values()) for key, by_search in grouped.items()}


def best_trial(trials: Sequence[dict[str, Any]], maximise: bool = True) -> dict[str, Any] | None:
    """The first complete trial with the best score (None without one)."""
    scored = [trial for trial in trials if trial_state(trial) == "complete" and trial_score(trial) is not None]
    if not scored:
        return None
    best = (max if maximise else min)(trial_score(trial) for trial in scored)  # type: ignore[type-var]
    return next(trial for trial in scored if trial_score(trial) == best)


def trial_values(trial: dict[str, Any] | None) -> dict[str, Any]:
    values = (trial or {}).get("values", (trial or {}).get("params"))
    return values if isinstance(values, dict) else {}


def number_or_dash(trial: dict[str, Any] | None) -> str:
    return number(trial_score(trial)) if trial is not None else "-"


def values_text(values: dict[str, Any], trial: dict[str, Any] | None, spec_space: dict[str, Any]) -> str:
    """``train.optimizer.lr 1 (edge)``: each value, marked where the trial's line says it
    is at an edge, or, without that, where :func:`is_edge` finds it on the space the trial
    searched (its ``space``) or the spec's."""
    recorded = (trial or {}).get("edge") if isinstance((trial or {}).get("edge"), dict) else {}
    searched = trial_space(trial) or spec_space
    return ", ".join(f"`{path}` {value_text(value)}"
                     + (" (edge)" if recorded.get(path) is True or is_edge(value, searched.get(path)) else "")
                     for path, value in sorted(values.items())) or "-"


def trial_space(trial: dict[str, Any] | None) -> dict[str, Any]:
    """The space a trial's line says its search searched: lists, and ranges as :class:`ParamRange`."""
    space = (trial or {}).get("space")
    if not isinstance(space, dict):
        return {}
    parsed: dict[str, Any] = {}
    for path, searched in space.items():
        if isinstance(searched, list):
            parsed[path] = searched
        elif isinstance(searched, dict):
            try:
                parsed[path] = ParamRange.model_validate(searched)
            except ValueError:  # pydantic's ValidationError: not a range; no edge to tell
                continue
    return parsed


def selection_text(tune: Any) -> str:
    """How a trial is scored: at the last round, best over rounds, or a window mean."""
    if tune.select == "window":
        return f"(the mean of the last {getattr(tune, 'window', '?')} rounds)"
    return "(best over rounds)" if tune.select == "best" else "(at the last round)"


def unequal_budgets(tables: BenchmarkTables, searches: dict[tuple[str, str], list[list[dict[str, Any]]]]) -> list[str]:
    """``"`lda0.1`: FedAvg 5, FedProx 15"`` for each family whose methods' last searches had
    different numbers of trials (only methods with trials in the file count)."""
    found = []
    for family in tables.families:
        counts = {method: len(searches[(family, method)][-1]) for method in tables.methods
                  if (family, method) in searches}
        if len(set(counts.values())) > 1:
            found.append(f"{code(family)}: " + ", ".join(f"{tables.name(m)} {count}" for m, count in counts.items()))
    return found


def render_page(spec: Any | None, records: Sequence[dict[str, Any]], trials: Sequence[dict[str, Any]],
                sources: Sources = Sources(), tables: BenchmarkTables | None = None) -> str:
    """The whole page (the "not run yet" page without reported runs); the same bytes every
    time for the same inputs (no timestamps; the bootstrap is seeded).

    Raises:
        ConfigError: records without a spec to read them with.
    """
    if spec is None:
        if records:
            raise ConfigError(f"{sources.results} holds runs but {sources.spec} is missing: restore the spec")
        return not_run_page(None, sources)
    reported = reported_records(spec, records)
    if not reported:
        return not_run_page(spec, sources)
    tables = tables if tables is not None else benchmark_tables(spec, records)
    from fedplug.study.expansion import planned_runs

    planned = planned_runs(spec)
    present = {record["run"] for record in reported}
    lines = header(sources) + [
        "", plan_text(spec, sources), "",
        (f"**Records**: {source_link(sources.results)}, {len(present)} of {len(planned)} planned runs, "
        f"{provenance_text(reported)}. Plateau status per run on window means: the mean of the last "
        f"{WINDOW_PLATEAU_WINDOW} rounds against the {WINDOW_PLATEAU_WINDOW} before, flat within "
        f"{WINDOW_PLATEAU_TOLERANCE:g}."), ""]
    lines += heatmap_section(tables) + [""] + summary_section(tables) + ["", "## Families", ""]
    for family in tables.families:
        lines += family_section(tables, family) + [""]
    lines += tuning_section(tables, records, trials, sources)
    return "\n".join(lines) + "\n"
