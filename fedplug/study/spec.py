"""A study file: its schema (:class:`StudySpec`), its validation (:func:`parse_study`) and
the grid cells it names.

The file format, with an example, is described in docs/pipeline.md ("Study files").
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedplug.analysis import Analysis, registered_analysis
from fedplug.components import StrictConfig
from fedplug.config import format_validation_error
from fedplug.errors import ConfigError

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.+-]+$")
"""Grid value labels and algorithm labels become folder names: keep them to these characters."""

HEADLINE_METRICS = ("final_accuracy", "last3_accuracy", "final_client_accuracy")
"""What a study's verdict rests on: the final round's accuracy, the mean of the last 3
rounds (less sensitive to a run that oscillates), or the final round's mean accuracy over
the clients' own test splits (for papers that score each client on its own data);
best-over-rounds is only shown beside it."""

EXTRA_COLUMNS = ("compute_seconds_model", "compute_seconds_to_target", "communication_seconds_model",
                 "total_bytes", "final_loss", "final_client_accuracy", "train_seconds", "final_accuracy")
"""Columns a spec may add to its summary table (``columns:``), besides those the components
declare (:func:`known_columns`)."""

BUILTIN_PLOT_KINDS = ("curves", "vs_axis", "heatmap", "bars", "dots")
"""The study's own plot kinds; the components declare others (:func:`known_plot_kinds`)."""


def known_columns(analysis: Analysis | None = None) -> list[str]:
    """:data:`EXTRA_COLUMNS` and the columns the components declare in ``analysis``
    (default: the registered components', :func:`~fedplug.analysis.registered_analysis`)."""
    analysis = registered_analysis() if analysis is None else analysis
    return [*(column.name for column in analysis.columns), *EXTRA_COLUMNS]


def known_plot_kinds(analysis: Analysis | None = None) -> list[str]:
    """:data:`BUILTIN_PLOT_KINDS` and the figures the components declare in ``analysis``
    (default: the registered components')."""
    analysis = registered_analysis() if analysis is None else analysis
    return [*BUILTIN_PLOT_KINDS, *(figure.kind for figure in analysis.figures)]


class PlotSpec(StrictConfig):
    """One figure of a study's report."""

    kind: str
    """``curves``: accuracy vs round (mean ± std over runs) and, with a ``baseline``, the
    paired difference to it, one figure per grid cell; ``vs_axis``: ``metric`` against the
    numeric value of grid axis ``axis``, one line per algorithm; ``heatmap``: ``metric``
    over grid axes ``rows`` x ``columns``, one panel per value of ``panels``; ``dots``:
    ``metric`` per algorithm and grid cell, mean with ± std error bars and every run as a
    small dot; ``bars``: the same as bars from zero. Any other kind is a figure a component
    declares (:class:`fedplug.analysis.Analysis`: a box plot of a per-round metric, a
    histogram of a setup summary), named as it declares it."""
    metric: str = "final_accuracy"
    """A column of :func:`~fedplug.study.statistics.summarise` (default ``final_accuracy``)."""
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
    log_y: bool = False
    """Logarithmic y axis for ``dots`` (default False), for a metric whose values span
    orders of magnitude (a CNN's cost-model seconds beside an MLP's). Not for ``bars``,
    which start at zero."""


class HeadlineSpec(StrictConfig):
    """The runs a study's verdict rests on: they get every partition draw x training seed."""

    cells: list[str] | None = None
    """Grid cell ids (the labels joined by ``_``, e.g. ``"0.1"`` or ``"log_2_10"``;
    ``"base"`` without a grid); default None: every cell."""
    algorithms: list[str] | None = None
    """Algorithm labels; default None: every algorithm."""
    pairs: list[list[int]] | None = None
    """The ``[draw, seed]`` pairs of the headline runs; default None: every draw x seed.
    For example more partition draws with one seed beside earlier draws with three (issue
    #23: the draw is the unit), without re-running those."""


class ParamRange(StrictConfig):
    """A numeric range a sampler draws a parameter from (``{low: 0.005, high: 0.5, log: true}``)."""

    low: float
    high: float
    log: bool = False
    """Draw on a log scale (default False); needs ``low > 0``."""
    integer: bool = False
    """Draw whole numbers (default False), e.g. ``train.local_epochs``."""

    @model_validator(mode="after")
    def _ordered(self) -> ParamRange:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        return self


GridValue = bool | int | float | str | None
"""A value a parameter can take in a list (what Optuna's samplers store)."""


class TuneSpec(StrictConfig):
    """A study's hyperparameter search (``tune:``): Optuna chooses ``params`` on validation
    samples held out of the clients' training data, never the test sets; the study's runs
    then train with the chosen values (:mod:`fedplug.study.tuning`, docs/pipeline.md)."""

    params: dict[str, ParamRange | list[GridValue]] = Field(min_length=1)
    """Dotted config path -> a list of values (``grid``, or categories for ``tpe``) or a
    range ``{low, high, log, integer}`` (``tpe`` only), e.g. ``train.optimizer.lr``."""
    algorithm_params: dict[str, dict[str, ParamRange | list[GridValue]]] = Field(default_factory=dict)
    """Algorithm label -> more paths searched for it alone, beside ``params`` (e.g. a
    server learning rate only the momentum aggregator has); default none."""
    algorithms: list[str] | None = Field(None, min_length=1)
    """The algorithms tuned (default: every one); the others keep their study values,
    e.g. ablations whose fixed values are the point."""
    sampler: Literal["tpe", "grid"] = "tpe"
    """``tpe`` (Optuna's TPESampler) or ``grid`` (Optuna's GridSampler: every point once,
    in an order ``seed`` shuffles); the best trial wins, the earliest of equals."""
    trials: int | None = Field(None, ge=1, le=10_000)
    """Trials per tuned algorithm; ``tpe`` needs it, ``grid`` defaults to every point."""
    metric: Literal["val_accuracy", "val_loss"] = "val_accuracy"
    """What is chosen on: ``val_accuracy`` (maximised) or ``val_loss`` (minimised), on
    the union of the clients' validation samples."""
    select: Literal["last", "best", "window"] = "last"
    """The metric's value at the ``last`` round (default), the ``best`` over rounds, or
    the mean over the last ``window`` rounds (``window``: one noisy round decides less)."""
    window: int | None = Field(None, ge=1, le=100_000)
    """The rounds ``select: window`` averages, e.g. 10 (the last 10 rounds); only with it."""
    draws: list[int] | None = Field(None, min_length=1)
    """``data.seed`` of the partition draws the trials train on, e.g. ``[100, 101]``
    (default None: the tuned run's own draw, the study's first). A trial's score is the
    mean over these draws of its score on each. They may not be among the study's
    reported ``draws``: a value chosen on a reported draw is favoured there."""
    equal_trials: bool = False
    """Refuse, before anything trains, a search space that gives one tuned algorithm
    fewer trials than another (a grid with fewer points than ``trials``), so that every
    method in a cell has the same budget (default False)."""
    validation_fraction: float = Field(0.1, gt=0, lt=1)
    """``data.validation_fraction`` of the trials: the share of each client's training
    samples held out to choose on (default 0.1). The study's runs train on all of them."""
    seed: int = Field(0, ge=0)
    """Seed of the sampler (default 0)."""
    pruner: Literal["none", "median"] = "none"
    """``median``: Optuna's MedianPruner stops a trial whose metric after a round is
    worse than the median of earlier trials' after the same round (default ``none``)."""
    pruner_startup_trials: int = Field(2, ge=1)
    """Trials that finish before the pruner may stop one (default 2)."""
    pruner_warmup_rounds: int = Field(0, ge=0)
    """Rounds of a trial the pruner lets pass before it may stop it (default 0)."""
    per_algorithm: bool = True
    """Tune each algorithm on its own (default True); False: tune the first algorithm and
    give its values to every algorithm."""
    cell: dict[str, str] = Field(default_factory=dict)
    """Grid axis -> value label of the cell tuned on (default: the first cell; axes left
    out take their first label). An algorithm that does not run there is tuned on its
    first cell. Trials use the first draw (or ``draws``) and seed."""
    per_cell: bool = False
    """One search per grid cell (default False: one for every cell, in ``cell``): each
    cell's runs train with the values chosen in that cell, on its first draw (or ``draws``)
    and seed."""

    @model_validator(mode="after")
    def _fits_the_sampler(self) -> TuneSpec:
        spaces = [("params", self.params)] + [(f"algorithm_params.{label}", params)
                                              for label, params in self.algorithm_params.items()]
        for where, path, values in ((where, path, values) for where, params in spaces for path, values in params.items()):
            if isinstance(values, list) and not values:
                raise ValueError(f"{where}.{path}: give at least one value")
            if self.sampler == "grid" and not isinstance(values, list):
                raise ValueError(f"{where}.{path}: the grid sampler needs a list of values, e.g. [0.01, 0.05, 0.1]")
        if self.per_cell and self.cell:
            raise ValueError("per_cell tunes in every cell; remove `cell:` (or per_cell)")
        if self.sampler == "tpe" and self.trials is None:
            raise ValueError("sampler tpe needs `trials:` (how many to run per algorithm)")
        if (self.select == "window") != (self.window is not None):
            raise ValueError("select: window needs `window:` (how many last rounds to average), and `window:` "
                             "applies only to select: window")
        if self.draws is not None and (len(set(self.draws)) != len(self.draws) or min(self.draws) < 0):
            raise ValueError(f"draws: {self.draws}: give each data.seed once, as a whole number >= 0")
        return self


TUNE_FORBIDDEN = {"train.seed": "seeds", "data.seed": "draws", "data.validation_fraction": "tune.validation_fraction"}
"""Paths ``tune.params`` may not set, and what sets them instead."""


class StudySpec(StrictConfig):
    """A study file (format and example: docs/pipeline.md, "Study files")."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    """Study name: the report folder, the results file and (prefixed ``study-``) the MLflow
    experiment. A plain name: letters, digits, ``-``, ``_`` and ``.``, not only dots (``..``
    would name the folder above ``reports/studies/``)."""
    description: str = ""
    """What the paper claims and what the study checks."""
    base: dict[str, Any]
    """One experiment config (``study``, ``data``, ``train``; ``algorithms`` is not allowed)."""
    grid: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    """Axis name -> value label -> ``{dotted.key: value}`` overrides; the runs cover the
    Cartesian product of the axes (default: one cell, the base)."""
    algorithms: dict[str, dict[str, Any]] = Field(min_length=1)
    """Label -> overrides of ``train`` (``{}`` = the base as is)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Algorithm label -> the name shown in tables and legends (default: the label)."""
    baseline: str | None = None
    """The algorithm every other one is compared with, run by run (same cell, draw and
    seed): paired wins and the mean paired difference (default None: no comparison)."""
    baselines: dict[str, str] = Field(default_factory=dict)
    """Algorithm label -> the algorithm it is compared with instead of ``baseline``, e.g.
    ``{fedshift-cnn: fedavg-cnn}`` for a variant pair (default: none). The reference must
    run in every cell the algorithm runs in."""
    cells: dict[str, list[str]] = Field(default_factory=dict)
    """Algorithm label -> the grid cells (ids, as in ``headline.cells``) it runs in, e.g.
    an expensive CNN variant only in the headline cell (default: every algorithm in every cell)."""
    headline_metric: Literal["final_accuracy", "last3_accuracy", "final_client_accuracy"] = "final_accuracy"
    """The number a verdict rests on: ``final_accuracy``, ``last3_accuracy`` (the mean
    of the last 3 rounds) or ``final_client_accuracy`` (the mean over the clients' own test
    splits, with ``final_accuracy`` as a ``columns:`` entry beside it); best-over-rounds is
    shown beside it, never instead."""
    draws: list[int] | None = Field(None, min_length=1)
    """``data.seed`` of each partition draw (default None: the base's ``data.seed``, one draw)."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """``train.seed`` of each run (default [0])."""
    headline: HeadlineSpec | None = None
    """The headline runs (every draw x seed, or ``headline.pairs``); default None: every run
    is a headline run."""
    other_pairs: Literal["all", "diagonal"] | list[list[int]] = "diagonal"
    """The (draw, seed) pairs of the runs outside ``headline``: ``all`` (every draw x seed),
    ``diagonal`` (draws and seeds paired in order: (d0, s0), (d1, s1), ...; the default), or
    a list of ``[draw, seed]`` pairs. Only with ``headline``."""
    pairs: dict[str, list[list[int]]] = Field(default_factory=dict)
    """Algorithm label -> its own ``[draw, seed]`` pairs instead of ``other_pairs``, for a
    costly variant outside ``headline`` kept to fewer runs (e.g. a CNN at 5 min a run on
    2 cores) (default: none)."""
    columns: list[str] = Field(default_factory=list)
    """Extra columns of the summary table: :data:`EXTRA_COLUMNS` (e.g.
    ``compute_seconds_model``, the cost model's training time) or a column a component
    declares (:class:`fedplug.analysis.RoundMetricColumn`)."""
    plots: list[PlotSpec] = Field(default_factory=lambda: [PlotSpec(kind="curves")])
    """Figures of the report (default: the learning curves)."""
    tune: TuneSpec | None = None
    """A hyperparameter search run before the study's runs, whose choice they train with
    (default None: none). Format: docs/pipeline.md, "Tuning a study"."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if set(name) == {"."}:
            raise ValueError(f"{name!r} is not a plain name; use letters, digits, '-', '_' and '.', not only dots")
        return name


def parse_study(data: Any, source: str = "study", analysis: Analysis | None = None) -> StudySpec:
    """Validate a study dict (as read from YAML); the columns and plot kinds the components
    declare are those of ``analysis`` (default: the registered components').

    Raises:
        ConfigError: unknown keys, a missing section, labels that cannot be folder names,
            an empty grid axis, ``algorithms`` inside ``base``, names (baseline, labels,
            headline cells and algorithms) that the study does not have, ``other_pairs``
            without ``headline`` or outside the draws and seeds, repeated draws or seeds, or a
            grid axis that sets a seed, a column or plot kind that neither the study nor
            a component declares.
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
        for label, overrides in values.items():
            _check_label(label, f"{source}: grid.{axis}")
            for key, value in overrides.items():
                if _sets_seed(key, value, "train") or (spec.draws is not None and _sets_seed(key, value, "data")):
                    section = "train" if _sets_seed(key, value, "train") else "data"
                    raise ConfigError(f"{source}: grid.{axis}.{label}: sets {section}.seed, which the study's "
                                      f"`{'seeds' if section == 'train' else 'draws'}:` sets; remove it from the grid")
    for label in spec.algorithms:
        _check_label(label, f"{source}: algorithms")
    known = ", ".join(spec.algorithms)
    if spec.baseline is not None and spec.baseline not in spec.algorithms:
        raise ConfigError(f"{source}: baseline {spec.baseline!r} is not one of the algorithms ({known})")
    for label in spec.labels:
        if label not in spec.algorithms:
            raise ConfigError(f"{source}: labels: {label!r} is not one of the algorithms ({known})")
    for field, values in (("seeds", spec.seeds), ("draws", spec.draws or [])):
        if len(set(values)) != len(values):
            raise ConfigError(f"{source}: {field}: {values} repeats a value; give each once")
        if any(value < 0 for value in values):
            raise ConfigError(f"{source}: {field}: seeds are whole numbers >= 0, got {values}")
    _check_headline(spec, source)
    _check_cells_and_baselines(spec, source)
    _check_tune(spec, source)
    _check_declared(spec, source, registered_analysis() if analysis is None else analysis)
    for plot in spec.plots:
        for field in ("axis", "rows", "columns", "panels"):
            axis = getattr(plot, field)
            if axis is not None and axis not in spec.grid:
                raise ConfigError(f"{source}: plots: {field} {axis!r} is not a grid axis; axes: {', '.join(spec.grid) or '(none)'}")
        if plot.kind == "vs_axis" and plot.axis is None:
            raise ConfigError(f"{source}: plots: a vs_axis plot needs `axis:` (a grid axis with numeric labels)")
        if plot.kind == "heatmap" and (plot.rows is None or plot.columns is None):
            raise ConfigError(f"{source}: plots: a heatmap needs `rows:` and `columns:` (grid axes)")
        if plot.log_y and plot.kind != "dots":
            raise ConfigError(f"{source}: plots: log_y is for `dots` plots only, not {plot.kind!r}")
    return spec


def _check_declared(spec: StudySpec, source: str, analysis: Analysis) -> None:
    columns = known_columns(analysis)
    for column in spec.columns:
        if column not in columns:
            raise ConfigError(f"{source}: columns: {column!r} is neither a study column nor one a component "
                              f"declares; columns: {', '.join(columns)}")
    kinds = known_plot_kinds(analysis)
    for plot in spec.plots:
        if plot.kind not in kinds:
            raise ConfigError(f"{source}: plots: kind {plot.kind!r} is neither a study plot nor a figure a "
                              f"component declares; kinds: {', '.join(kinds)}")


def _check_tune(spec: StudySpec, source: str) -> None:
    """What ``tune:`` can be checked for without the runs' configs (the parameter paths
    themselves are checked against them: :func:`fedplug.study.tuning.check_tune_params`)."""
    if spec.tune is None:
        return
    known = ", ".join(spec.algorithms)
    for label in spec.tune.algorithms or []:
        if label not in spec.algorithms:
            raise ConfigError(f"{source}: tune.algorithms: {label!r} is not one of the algorithms ({known})")
    tuned = spec.tune.algorithms or list(spec.algorithms)
    for label in spec.tune.algorithm_params:
        if label not in tuned:
            raise ConfigError(f"{source}: tune.algorithm_params: {label!r} is not a tuned algorithm "
                              f"({', '.join(tuned)})")
    every_path = [*spec.tune.params, *(path for params in spec.tune.algorithm_params.values() for path in params)]
    for path in every_path:
        if path in TUNE_FORBIDDEN:
            raise ConfigError(f"{source}: tune.params: {path} is set by the study's `{TUNE_FORBIDDEN[path]}:`; "
                              "remove it from tune.params")
        if path.split(".")[0] not in ("train", "data") or len(path.split(".")) < 2:
            raise ConfigError(f"{source}: tune.params: {path!r} is not a config path; give a dotted path under "
                              "train. or data., e.g. train.optimizer.lr")
    reported = spec.draws if spec.draws is not None else [base_data_seed(spec.base)]
    shared = sorted(set(spec.tune.draws or []) & set(reported))
    if shared:
        raise ConfigError(f"{source}: tune.draws: {shared} {'is' if len(shared) == 1 else 'are'} also reported "
                          f"(draws {reported}); tune on draws the study does not report, e.g. [100, 101]")
    for axis, label in spec.tune.cell.items():
        if axis not in spec.grid:
            raise ConfigError(f"{source}: tune.cell: {axis!r} is not a grid axis; axes: {', '.join(spec.grid) or '(none)'}")
        if label not in spec.grid[axis]:
            raise ConfigError(f"{source}: tune.cell.{axis}: {label!r} is not one of its labels ({', '.join(spec.grid[axis])})")


def _sets_seed(key: str, value: Any, section: str) -> bool:
    return key == f"{section}.seed" or (key == section and isinstance(value, dict) and "seed" in value)


def _check_headline(spec: StudySpec, source: str) -> None:
    if spec.headline is None:
        for key in ("other_pairs", "pairs"):
            if key in spec.model_fields_set:
                raise ConfigError(f"{source}: {key} applies to the runs outside `headline:`; add `headline:` or remove {key}")
        return
    cells = [cell_id(cell) for cell in grid_cells(spec.grid)]
    for cell in spec.headline.cells or []:
        if cell not in cells:
            raise ConfigError(f"{source}: headline.cells: {cell!r} is not a grid cell; cells: {', '.join(cells)}")
    for algorithm in spec.headline.algorithms or []:
        if algorithm not in spec.algorithms:
            raise ConfigError(f"{source}: headline.algorithms: {algorithm!r} is not one of the algorithms ({', '.join(spec.algorithms)})")
    draws = spec.draws if spec.draws is not None else [base_data_seed(spec.base)]
    if spec.other_pairs == "diagonal" and len(draws) != len(spec.seeds):
        raise ConfigError(f"{source}: other_pairs: diagonal pairs draws and seeds one to one, but there are {len(draws)} "
                          f"draws and {len(spec.seeds)} seeds; give the pairs as a list of [draw, seed] or use `all`")
    if isinstance(spec.other_pairs, list):
        _check_pairs(spec.other_pairs, draws, spec.seeds, f"{source}: other_pairs")
    if spec.headline.pairs is not None:
        _check_pairs(spec.headline.pairs, draws, spec.seeds, f"{source}: headline.pairs")
    headline_algorithms = spec.headline.algorithms
    for algorithm, pairs in spec.pairs.items():
        if algorithm not in spec.algorithms:
            raise ConfigError(f"{source}: pairs: {algorithm!r} is not one of the algorithms ({', '.join(spec.algorithms)})")
        if headline_algorithms is None or algorithm in headline_algorithms:
            raise ConfigError(f"{source}: pairs.{algorithm}: a headline algorithm runs the headline's pairs; "
                              "give pairs only to algorithms outside headline.algorithms (or set headline.pairs)")
        _check_pairs(pairs, draws, spec.seeds, f"{source}: pairs.{algorithm}")


def _check_pairs(pairs: list[list[int]], draws: list[int], seeds: list[int], where: str) -> None:
    if not pairs:
        raise ConfigError(f"{where}: give at least one [draw, seed] pair")
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in draws or pair[1] not in seeds:
            raise ConfigError(f"{where}: {pair} is not a [draw, seed] pair of draws {draws} and seeds {seeds}")
    if len({tuple(pair) for pair in pairs}) != len(pairs):
        raise ConfigError(f"{where}: {pairs} repeats a pair; give each once")


def _check_cells_and_baselines(spec: StudySpec, source: str) -> None:
    cells = [cell_id(cell) for cell in grid_cells(spec.grid)]
    known = ", ".join(spec.algorithms)
    for algorithm, restricted in spec.cells.items():
        if algorithm not in spec.algorithms:
            raise ConfigError(f"{source}: cells: {algorithm!r} is not one of the algorithms ({known})")
        if not restricted:
            raise ConfigError(f"{source}: cells.{algorithm}: give at least one grid cell, or remove the entry to run it in every cell")
        for cell in restricted:
            if cell not in cells:
                raise ConfigError(f"{source}: cells.{algorithm}: {cell!r} is not a grid cell; cells: {', '.join(cells)}")
        if len(set(restricted)) != len(restricted):
            raise ConfigError(f"{source}: cells.{algorithm}: {restricted} repeats a cell; give each once")
    for algorithm, reference in spec.baselines.items():
        if algorithm not in spec.algorithms:
            raise ConfigError(f"{source}: baselines: {algorithm!r} is not one of the algorithms ({known})")
        if reference not in spec.algorithms:
            raise ConfigError(f"{source}: baselines.{algorithm}: {reference!r} is not one of the algorithms ({known})")
        if reference == algorithm:
            raise ConfigError(f"{source}: baselines.{algorithm}: an algorithm cannot be its own baseline")
        for cell in algorithm_cells(spec, algorithm):
            if cell not in algorithm_cells(spec, reference):
                raise ConfigError(f"{source}: baselines.{algorithm}: {reference!r} does not run in cell {cell!r}, where "
                                  f"{algorithm!r} runs; add the cell to cells.{reference} or restrict cells.{algorithm}")


def algorithm_cells(spec: StudySpec, algorithm: str) -> list[str]:
    """The ids of the grid cells ``algorithm`` runs in: its ``cells:`` entry, else every cell."""
    every = [cell_id(cell) for cell in grid_cells(spec.grid)]
    restricted = spec.cells.get(algorithm)
    return [cell for cell in every if restricted is None or cell in restricted]


def baseline_of(spec: StudySpec, algorithm: str) -> str | None:
    """The algorithm ``algorithm`` is compared with: its ``baselines:`` entry, else ``baseline``."""
    return spec.baselines.get(algorithm, spec.baseline)


def _check_label(label: str, where: str) -> None:
    if not RUN_ID_PATTERN.match(label):
        raise ConfigError(f"{where}: label {label!r} must use only letters, digits and . _ + - (it names a folder)")


def base_data_seed(document: dict[str, Any]) -> int:
    """The draw of a study without ``draws:``: the experiment's ``data.seed`` (0 when it has none)."""
    data = document.get("data") if isinstance(document.get("data"), dict) else {}
    seed = data.get("seed", 0)
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0


def display_name(algorithm: str, labels: dict[str, str] | None) -> str:
    """The name shown for ``algorithm``: its ``labels:`` entry, else the label itself."""
    return (labels or {}).get(algorithm, algorithm)


def cell_id(cell: dict[str, str]) -> str:
    """``"0.1"`` for one axis, ``"log_2_10"`` for three, ``"base"`` for no grid."""
    return "_".join(cell.values()) if cell else "base"


def grid_cells(grid: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, str]]:
    """The Cartesian product of the axes, in file order (the last axis varies fastest)."""
    axes = list(grid)
    return [dict(zip(axes, labels)) for labels in itertools.product(*(list(grid[axis]) for axis in axes))]

