"""A study's runs: the grid cells x draws x algorithms x seeds it plans
(:func:`planned_runs`), each run's experiment dict (:func:`run_document`) and validated
config (:func:`expand_study`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedplug.config import apply_override, deep_merge, set_dotted, validate_experiment
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.study.spec import StudySpec, base_data_seed, cell_id, grid_cells


@dataclass(frozen=True)
class PlannedRun:
    """One run of a study, before its config is built."""

    run_id: str
    """``<cell labels joined by _>__<algorithm>__d<draw>s<seed>``, e.g. ``0.1__fedavg__d0s0``."""
    cell: dict[str, str]
    """Grid axis -> value label of this run's cell."""
    algorithm: str
    draw: int
    """``data.seed``: which random partition (and local train/test split) the run uses."""
    seed: int
    """``train.seed``: initialisation, client sampling, shuffling."""
    headline: bool
    """Whether the run belongs to the study's headline comparison."""

    @property
    def cell_id(self) -> str:
        return cell_id(self.cell)


@dataclass(frozen=True)
class StudyRun(PlannedRun):
    """One training run of a study, with its validated experiment config."""

    config: Any = None



def planned_runs(spec: StudySpec, base_draw: int | None = None) -> list[PlannedRun]:
    """Every run of the study: grid cells outermost, then draws, then algorithms, then
    seeds (runs that share a federation come one after another). Headline runs (every run
    without ``headline:``) cover every draw x seed, or ``headline.pairs``; the others their
    ``pairs`` entry or ``other_pairs``; an algorithm with a ``cells:`` entry runs only in
    those cells.
    ``base_draw`` is the draw without ``draws:`` (default: the base's ``data.seed``)."""
    draws = spec.draws if spec.draws is not None else [base_draw if base_draw is not None else base_data_seed(spec.base)]
    every_pair = [(draw, seed) for draw in draws for seed in spec.seeds]
    if spec.other_pairs == "all":
        other = every_pair
    elif spec.other_pairs == "diagonal":
        other = list(zip(draws, spec.seeds))
    else:
        other = [(pair[0], pair[1]) for pair in spec.other_pairs]
    own = {algorithm: [(pair[0], pair[1]) for pair in pairs] for algorithm, pairs in spec.pairs.items()}
    headline_pairs = every_pair
    if spec.headline is not None and spec.headline.pairs is not None:
        headline_pairs = [(pair[0], pair[1]) for pair in spec.headline.pairs]
    runs = []
    for cell in grid_cells(spec.grid):
        for draw in draws:
            for algorithm in spec.algorithms:
                if algorithm in spec.cells and cell_id(cell) not in spec.cells[algorithm]:
                    continue
                headline = spec.headline is None or (
                    (spec.headline.cells is None or cell_id(cell) in spec.headline.cells)
                    and (spec.headline.algorithms is None or algorithm in spec.headline.algorithms)
                )
                pairs = headline_pairs if headline else own.get(algorithm, other)
                for seed in spec.seeds:
                    if (draw, seed) in pairs:
                        run_id = f"{cell_id(cell)}__{algorithm}__d{draw}s{seed}"
                        runs.append(PlannedRun(run_id, cell, algorithm, draw, seed, headline))
    return runs


def run_document(spec: StudySpec, run: PlannedRun, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The experiment dict of one run (before validation): base, then ``overrides``
    (``dotted.key=value`` strings, e.g. ``data.dataset=fashion_mnist``), then the
    algorithm, then the grid cell, then the draw (``data.seed``, with ``draws:``) and the seed."""
    document = _with_overrides(spec, overrides)
    document["train"] = deep_merge(document.get("train") or {}, spec.algorithms[run.algorithm] or {})
    for axis, label in run.cell.items():
        for key, value in spec.grid[axis][label].items():
            document = set_dotted(document, key, value)
    if spec.draws is not None:
        document["data"] = {**(document.get("data") or {}), "seed": run.draw}
    document["train"] = {**document["train"], "seed": run.seed}
    document["study"] = {**(document.get("study") or {}), "name": spec.name, "seeds": [run.seed]}
    return document


def _with_overrides(spec: StudySpec, overrides: Sequence[str]) -> dict[str, Any]:
    document = copy.deepcopy(spec.base)
    for assignment in overrides:
        key = assignment.partition("=")[0].strip()
        if key == "train.seed" or key.startswith("train.seed."):
            raise ConfigError(f"--set {assignment!r}: the study sets train.seed from its `seeds:`; change seeds in the study file")
        if spec.draws is not None and (key == "data.seed" or key.startswith("data.seed.")):
            raise ConfigError(f"--set {assignment!r}: the study sets data.seed from its `draws:`; change draws in the study file")
        document = apply_override(document, assignment)
    return document


def expand_study(spec: StudySpec, registry: Registry | None = None, overrides: Sequence[str] = ()) -> list[StudyRun]:
    """Every run of :func:`planned_runs`, each with its validated config.

    Raises:
        ConfigError: a run's config does not validate (the message names the run), or an
            override sets a seed that the study's ``seeds:`` or ``draws:`` sets.
    """
    runs = []
    base_draw = base_data_seed(_with_overrides(spec, overrides))
    for planned in planned_runs(spec, base_draw):
        document = run_document(spec, planned, overrides)
        try:
            config = validate_experiment(document, registry)
        except ConfigError as error:
            raise ConfigError(f"study {spec.name}, run {planned.run_id}: {error}") from None
        runs.append(StudyRun(planned.run_id, planned.cell, planned.algorithm, planned.draw, planned.seed,
                             planned.headline, config))
    return runs

