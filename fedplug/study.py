"""Study grids: expand a study spec into runs, check run folders, summarise results, plot.

A *study* reproduces one paper's experiment: a base experiment config, a grid of
settings (partitions, parameters), a list of algorithms (``train`` overrides, exactly like
``algorithms:`` in params.yaml), partition draws (``data.seed``) and training seeds
(``train.seed``). :func:`expand_study` turns it into one :class:`StudyRun` per grid cell x
draw x algorithm x seed, each with a validated config; the runner script
(``pipelines/studies/run_study.py``) trains them, reusing a finished run only when
:func:`run_folder_state` finds its resolved config equal to the run's; :func:`run_record`
turns a finished run into one compact line of the study's committed results file
(``pipelines/studies/results/<study>.jsonl``); :func:`summarise` (mean ± std over runs,
paired wins against a baseline), :func:`summary_table` and the ``plot_*`` functions turn
those records into a report.

A spec file::

    name: fedshift                  # folder reports/studies/<name>, MLflow experiment study-<name>
    description: one line on what the paper claims
    base: {study: ..., data: ..., train: ...}      # one experiment config
    grid:                           # axis -> value label -> dotted overrides of the config
      alpha:
        "0.1": {data.partition: {name: dirichlet_class, alpha: 0.1}}
        "0.5": {data.partition: {name: dirichlet_class, alpha: 0.5}}
    algorithms:                     # label -> overrides of `train`
      fedavg: {}
      fedprox: {loss_transform: {name: fedprox, mu: 0.01}}
    labels: {fedprox: "FedProx (mu 0.01)"}   # legend and table names (default: the key)
    baseline: fedavg                # paired wins are counted against it ...
    baselines: {fedprox-cnn: fedavg-cnn}   # ... or, per algorithm, against another one
    cells: {fedprox-cnn: ["0.1_0.5"]}      # an algorithm that runs only in these cells
    headline_metric: final_accuracy # or last3_accuracy (mean of the last 3 rounds)
    draws: [0, 1, 2]                # data.seed of each partition draw (default: the base's)
    seeds: [0, 1, 2]                # train.seed of each run
    headline: {cells: ["0.1"]}      # these cells get every draw x seed ...
    other_pairs: diagonal           # ... the others (draw, seed) = (0, 0), (1, 1), (2, 2)
    plots: [{kind: curves}, {kind: dots, metric: final_accuracy}]

A run's config is built in this order: ``base`` -> command-line overrides -> the
algorithm's ``train`` overrides (:func:`fedplug.config.deep_merge`) -> the grid cell's dotted
overrides (so a grid axis can tune the algorithm's own parameters, e.g.
``train.grouper.alpha``) -> ``data.seed`` (the draw, when ``draws`` is given) and
``train.seed``.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, NamedTuple, Sequence

import numpy as np
import yaml
from pydantic import Field, ValidationError, field_validator

from fedplug.components import StrictConfig
from fedplug.config import apply_override, deep_merge, format_validation_error, set_dotted, validate_experiment
from fedplug.errors import ConfigError, DataError
from fedplug.registry import Registry
from fedplug.simulation.results import first_round_reaching

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.+-]+$")
"""Grid value labels and algorithm labels become folder names: keep them to these characters."""

HEADLINE_METRICS = ("final_accuracy", "last3_accuracy")
"""What a study's verdict rests on: the final round's accuracy, or the mean of the last 3
rounds (less sensitive to a run that oscillates); best-over-rounds is only shown beside it."""

EXTRA_COLUMNS = ("cpd_median", "compute_seconds_model", "compute_seconds_to_target", "communication_seconds_model",
                 "total_bytes", "final_loss", "final_client_accuracy", "train_seconds")
"""Columns a spec may add to its summary table (``columns:``)."""


# --------------------------------------------------------------------------- the spec


class PlotSpec(StrictConfig):
    """One figure of a study's report."""

    kind: Literal["curves", "vs_axis", "cpd_box", "heatmap", "bars", "dots", "weight_histogram"]
    """``curves``: accuracy vs round (mean ± std over runs) and, with a ``baseline``, the
    paired difference to it, one figure per grid cell; ``vs_axis``: ``metric`` against the
    numeric value of grid axis ``axis``, one line per algorithm; ``cpd_box``: box plot of
    the per-round median CPD of every algorithm; ``heatmap``: ``metric`` over grid axes
    ``rows`` x ``columns``, one panel per value of ``panels``; ``dots``: ``metric`` per
    algorithm and grid cell, mean with ± std error bars and every run as a small dot;
    ``bars``: the same as bars from zero; ``weight_histogram``: FedDisk's sample weights
    (the records' ``weights``, from the setup phase), one histogram per grid cell x
    algorithm, pooled over the runs, with the value 1 (no reweighting) marked."""
    metric: str = "final_accuracy"
    """A column of :func:`summarise` (default ``final_accuracy``)."""
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


class StudySpec(StrictConfig):
    """A study file (see the module docstring)."""

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
    headline_metric: Literal["final_accuracy", "last3_accuracy"] = "final_accuracy"
    """The number a verdict rests on: ``final_accuracy`` or ``last3_accuracy`` (the mean
    of the last 3 rounds); best-over-rounds is shown beside it, never instead."""
    draws: list[int] | None = Field(None, min_length=1)
    """``data.seed`` of each partition draw (default None: the base's ``data.seed``, one draw)."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """``train.seed`` of each run (default [0])."""
    headline: HeadlineSpec | None = None
    """The headline runs (every draw x seed); default None: every run is a headline run."""
    other_pairs: Literal["all", "diagonal"] | list[list[int]] = "diagonal"
    """The (draw, seed) pairs of the runs outside ``headline``: ``all`` (every draw x seed),
    ``diagonal`` (draws and seeds paired in order: (d0, s0), (d1, s1), ...; the default), or
    a list of ``[draw, seed]`` pairs. Only with ``headline``."""
    columns: list[Literal[EXTRA_COLUMNS]] = Field(default_factory=list)  # type: ignore[valid-type]
    """Extra columns of the summary table, e.g. ``compute_seconds_model`` (the FedGSP cost
    model's training time)."""
    plots: list[PlotSpec] = Field(default_factory=lambda: [PlotSpec(kind="curves")])
    """Figures of the report (default: the learning curves)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if set(name) == {"."}:
            raise ValueError(f"{name!r} is not a plain name; use letters, digits, '-', '_' and '.', not only dots")
        return name


def parse_study(data: Any, source: str = "study") -> StudySpec:
    """Validate a study dict (as read from YAML).

    Raises:
        ConfigError: unknown keys, a missing section, labels that cannot be folder names,
            an empty grid axis, ``algorithms`` inside ``base``, names (baseline, labels,
            headline cells and algorithms) that the study does not have, ``other_pairs``
            without ``headline`` or outside the draws and seeds, repeated draws or seeds, or a
            grid axis that sets a seed.
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


def _sets_seed(key: str, value: Any, section: str) -> bool:
    return key == f"{section}.seed" or (key == section and isinstance(value, dict) and "seed" in value)


def _check_headline(spec: StudySpec, source: str) -> None:
    if spec.headline is None:
        if "other_pairs" in spec.model_fields_set:
            raise ConfigError(f"{source}: other_pairs applies to the runs outside `headline:`; add `headline:` or remove other_pairs")
        return
    cells = [cell_id(cell) for cell in grid_cells(spec.grid)]
    for cell in spec.headline.cells or []:
        if cell not in cells:
            raise ConfigError(f"{source}: headline.cells: {cell!r} is not a grid cell; cells: {', '.join(cells)}")
    for algorithm in spec.headline.algorithms or []:
        if algorithm not in spec.algorithms:
            raise ConfigError(f"{source}: headline.algorithms: {algorithm!r} is not one of the algorithms ({', '.join(spec.algorithms)})")
    draws = spec.draws if spec.draws is not None else [_base_draw(spec.base)]
    if spec.other_pairs == "diagonal" and len(draws) != len(spec.seeds):
        raise ConfigError(f"{source}: other_pairs: diagonal pairs draws and seeds one to one, but there are {len(draws)} "
                          f"draws and {len(spec.seeds)} seeds; give the pairs as a list of [draw, seed] or use `all`")
    if isinstance(spec.other_pairs, list):
        if not spec.other_pairs:
            raise ConfigError(f"{source}: other_pairs: give at least one [draw, seed] pair")
        for pair in spec.other_pairs:
            if len(pair) != 2 or pair[0] not in draws or pair[1] not in spec.seeds:
                raise ConfigError(f"{source}: other_pairs: {pair} is not a [draw, seed] pair of draws {draws} and seeds {spec.seeds}")
        if len({tuple(pair) for pair in spec.other_pairs}) != len(spec.other_pairs):
            raise ConfigError(f"{source}: other_pairs: {spec.other_pairs} repeats a pair; give each once")


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


def _base_draw(document: dict[str, Any]) -> int:
    data = document.get("data") if isinstance(document.get("data"), dict) else {}
    seed = data.get("seed", 0)
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0


def display_name(algorithm: str, labels: dict[str, str] | None) -> str:
    """The name shown for ``algorithm``: its ``labels:`` entry, else the label itself."""
    return (labels or {}).get(algorithm, algorithm)


# ---------------------------------------------------------------------- expansion


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


def cell_id(cell: dict[str, str]) -> str:
    """``"0.1"`` for one axis, ``"log_2_10"`` for three, ``"base"`` for no grid."""
    return "_".join(cell.values()) if cell else "base"


def grid_cells(grid: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, str]]:
    """The Cartesian product of the axes, in file order (the last axis varies fastest)."""
    axes = list(grid)
    return [dict(zip(axes, labels)) for labels in itertools.product(*(list(grid[axis]) for axis in axes))]


def planned_runs(spec: StudySpec, base_draw: int | None = None) -> list[PlannedRun]:
    """Every run of the study: grid cells outermost, then draws, then algorithms, then
    seeds (runs that share a federation come one after another). Headline runs (every run
    without ``headline:``) cover every draw x seed, the others ``other_pairs``; an
    algorithm with a ``cells:`` entry runs only in those cells.
    ``base_draw`` is the draw without ``draws:`` (default: the base's ``data.seed``)."""
    draws = spec.draws if spec.draws is not None else [base_draw if base_draw is not None else _base_draw(spec.base)]
    every_pair = [(draw, seed) for draw in draws for seed in spec.seeds]
    if spec.other_pairs == "all":
        other = every_pair
    elif spec.other_pairs == "diagonal":
        other = list(zip(draws, spec.seeds))
    else:
        other = [(pair[0], pair[1]) for pair in spec.other_pairs]
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
                pairs = every_pair if headline else other
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
    base_draw = _base_draw(_with_overrides(spec, overrides))
    for planned in planned_runs(spec, base_draw):
        document = run_document(spec, planned, overrides)
        try:
            config = validate_experiment(document, registry)
        except ConfigError as error:
            raise ConfigError(f"study {spec.name}, run {planned.run_id}: {error}") from None
        runs.append(StudyRun(planned.run_id, planned.cell, planned.algorithm, planned.draw, planned.seed,
                             planned.headline, config))
    return runs


# ------------------------------------------------------------- run folders and reuse


IGNORED_CONFIG_FIELDS = ("study", "tracking", "algorithms", "data.root", "train.workers")
"""Fields of a resolved config that cannot change a run's results, left out when a run
folder's ``config.yaml`` is compared with a study's run and from :func:`config_hash`:
``study`` (its name, ``seeds: [train.seed]`` and the target accuracy, which only the
report reads), ``tracking`` (where the run is logged), ``algorithms`` (the pipeline's
matrix; a study run is its ``train``), ``data.root`` (where the dataset files are read
from) and ``train.workers`` (how many processes the parallel engine forks). Engine
``parallel`` is compared as ``sequential``: its results are the sequential engine's, bit
for bit (tests/test_parallel_engine.py)."""


def comparable_config(document: dict[str, Any]) -> dict[str, Any]:
    """A resolved config dict without :data:`IGNORED_CONFIG_FIELDS` (engine ``parallel``
    written as ``sequential``): two runs with equal comparable configs give the same results."""
    comparable = copy.deepcopy(document)
    for dotted in IGNORED_CONFIG_FIELDS:
        *parents, last = dotted.split(".")
        node: Any = comparable
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    train = comparable.get("train")
    if isinstance(train, dict) and train.get("engine") == "parallel":
        train["engine"] = "sequential"
    return comparable


def config_hash(document: dict[str, Any]) -> str:
    """12 hex digits of the SHA-256 of :func:`comparable_config` (keys sorted)."""
    text = json.dumps(comparable_config(document), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_differences(found: Any, wanted: Any, prefix: str = "") -> list[str]:
    """Where two comparable config dicts differ, one ``path=found but the study asks
    wanted`` text per leaf (``(absent)`` for a missing key), in ``wanted``'s key order."""
    if isinstance(found, dict) and isinstance(wanted, dict):
        differences = []
        for key in list(wanted) + [key for key in found if key not in wanted]:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in found:
                differences.append(f"{path} (absent) but the study asks {_short(wanted[key])}")
            elif key not in wanted:
                differences.append(f"{path}={_short(found[key])} but the study has no such setting")
            else:
                differences += config_differences(found[key], wanted[key], path)
        return differences
    return [] if found == wanted else [f"{prefix}={_short(found)} but the study asks {_short(wanted)}"]


def _short(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


class RunFolderState(NamedTuple):
    """What a run folder holds, for one run of a study."""

    status: Literal["new", "partial", "done", "mismatched"]
    """``new``: nothing to reuse; ``partial``: a started run of this config (it resumes
    from its checkpoint); ``done``: finished with this config; ``mismatched``: results,
    a checkpoint or a config of other settings."""
    reason: str = ""
    """For ``mismatched``: why, e.g. ``it was trained with train.rounds=1 but the study asks 20``."""


def run_folder_state(run: StudyRun, folder: str | Path) -> RunFolderState:
    """Whether ``folder`` holds ``run`` finished, started, or under other settings.

    A finished run (``metrics.json``) or a started one (``checkpoint.pt``) counts only
    when its ``config.yaml`` (the resolved config :func:`fedplug.experiment.run_experiment`
    wrote) equals the run's config, :data:`IGNORED_CONFIG_FIELDS` aside.
    """
    folder = Path(folder)
    has_results = (folder / "metrics.json").is_file() or (folder / "checkpoint.pt").is_file()
    config_path = folder / "config.yaml"
    if not config_path.is_file():
        if has_results:
            return RunFolderState("mismatched", "it holds results but no config.yaml, so its settings are unknown")
        return RunFolderState("new")
    try:
        stored = yaml.safe_load(config_path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as error:
        return RunFolderState("mismatched", f"its config.yaml is unreadable ({type(error).__name__})")
    if not isinstance(stored, dict):
        return RunFolderState("mismatched", "its config.yaml is not a mapping")
    differences = config_differences(comparable_config(stored), comparable_config(run.config.model_dump(mode="json")))
    if differences:
        more = f" (and {len(differences) - 1} more differences)" if len(differences) > 1 else ""
        verb = "was trained" if (folder / "metrics.json").is_file() else "was started"
        return RunFolderState("mismatched", f"it {verb} with {differences[0]}{more}")
    return RunFolderState("done" if (folder / "metrics.json").is_file() else "partial")


def pending_runs(runs: Iterable[StudyRun], out_dir: str | Path) -> list[StudyRun]:
    """The runs whose folder under ``out_dir`` is ``new`` or ``partial`` (see
    :func:`run_folder_state`); mismatched runs are not pending: they need a decision."""
    out = Path(out_dir)
    return [run for run in runs if run_folder_state(run, out / run.run_id).status in ("new", "partial")]


# ------------------------------------------------------------------------ records


def run_row(summary: dict[str, Any], target: float) -> dict[str, float | None]:
    """The summary numbers of one run from its ``metrics.json`` dict.

    ``rounds_to_target`` is the first training round with accuracy >= ``target``;
    ``effective_rounds_to_target`` adds the setup rounds (FedDisk's density phase);
    ``bytes_to_target`` is the cumulative traffic at that round (setup included);
    ``final_client_accuracy`` is the last round's mean accuracy over the clients' own
    test splits; ``cpd_median`` is the median over rounds of each round's ``cpd_median`` (None when
    no round reported one); ``last3_accuracy`` is the mean accuracy of the last 3 rounds
    (fewer when the run has fewer); ``compute_seconds_model`` and
    ``communication_seconds_model`` are the cost model's totals over the rounds;
    ``compute_seconds_to_target`` is the cost model's compute time summed over the rounds
    up to and including the one that reaches ``target`` (time to accuracy; None when none does);
    ``seconds`` and ``setup_seconds`` are the measured wall times of the rounds and of the
    setup phase.

    Raises:
        DataError: ``summary`` has no ``history`` list.
    """
    history = summary.get("history")
    if not isinstance(history, list):
        raise DataError("metrics.json has no 'history' list; delete the run folder and run the study again")
    setup = int(summary.get("setup_rounds") or 0)
    reached = first_round_reaching(history, target)
    to_target: float | None = None
    if reached is not None:
        to_target = 0.0
        for record in history:
            to_target += float(record.get("compute_seconds_model") or 0.0)
            if record is reached:
                break
    cpds = [float(record["cpd_median"]) for record in history if _finite(record.get("cpd_median"))]
    accuracies = [float(record["accuracy"]) for record in history if _finite(record.get("accuracy"))]
    last3 = [float(record["accuracy"]) for record in history[-3:] if _finite(record.get("accuracy"))]
    return {
        "final_accuracy": float(history[-1]["accuracy"]) if history and _finite(history[-1].get("accuracy")) else None,
        "last3_accuracy": float(np.mean(last3)) if last3 else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_client_accuracy": (float(history[-1]["client_accuracy_mean"])
                                  if history and _finite(history[-1].get("client_accuracy_mean")) else None),
        "final_loss": float(history[-1]["loss"]) if history and _finite(history[-1].get("loss")) else None,
        "rounds_to_target": float(reached["round"]) if reached else None,
        "effective_rounds_to_target": float(reached["round"]) + setup if reached else None,
        "bytes_to_target": float(reached["cumulative_bytes"]) if reached else None,
        "setup_rounds": float(setup),
        "total_bytes": float(summary.get("total_bytes") or 0),
        "compute_seconds_model": float(sum(float(record.get("compute_seconds_model") or 0.0) for record in history)),
        "compute_seconds_to_target": to_target,
        "communication_seconds_model": float(sum(float(record.get("communication_seconds_model") or 0.0)
                                                 for record in history)),
        "cpd_median": float(np.median(cpds)) if cpds else None,
        "seconds": float(summary.get("total_seconds") or 0.0),
        "setup_seconds": float(summary.get("setup_seconds") or 0.0),
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _rounded(value: Any, digits: int = 6) -> float | None:
    return round(float(value), digits) if _finite(value) else None


def _significant(value: Any, digits: int = 6) -> float | None:
    """``value`` to ``digits`` significant digits (the cost model's times can be microseconds)."""
    return float(f"{float(value):.{digits}g}") if _finite(value) else None


def run_record(run: StudyRun, metrics: dict[str, Any], target: float, *, info: dict[str, Any] | None = None,
               provenance: dict[str, Any] | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One line of a study's results file: what identifies the run, its numbers and
    where they came from.

    ``metrics`` is the run's ``metrics.json``, ``info`` its ``run_info.json`` (the git
    commit and package versions at training time), ``provenance`` the runner's
    ``provenance.json`` (whether the checkout had uncommitted changes). ``accuracy`` is the
    test accuracy of every round (6 decimals), ``cpd`` each round's median CPD (only when
    the grouper reports one), ``compute_seconds`` each round's cost-model compute time
    (4 significant digits; only when the model reports one), ``weights`` the setup phase's
    sample-weight summary (:func:`weight_record`; only for runs whose loss transform reports
    one, e.g. FedDisk), ``setup_seconds`` the measured wall time of the run's setup phase
    (only when it took 0.01 s or more: a run without a setup phase takes none, one that
    loads a cached setup about none),
    ``config_hash`` is :func:`config_hash` of the run's config.
    """
    numbers = run_row(metrics, target)
    history = metrics["history"]
    record: dict[str, Any] = {
        "run": run.run_id,
        "cell": dict(run.cell),
        "algorithm": run.algorithm,
        "draw": run.draw,
        "seed": run.seed,
        "headline": run.headline,
        "dataset": run.config.data.dataset.name,
        "rounds": len(history),
        "final_accuracy": numbers["final_accuracy"],
        "last3_accuracy": _rounded(numbers["last3_accuracy"], 8),
        "best_accuracy": numbers["best_accuracy"],
        "final_loss": _rounded(numbers["final_loss"]),
        "final_client_accuracy": _rounded(numbers["final_client_accuracy"]),
        "target": target,
        "rounds_to_target": _integer(numbers["rounds_to_target"]),
        "setup_rounds": _integer(numbers["setup_rounds"]),
        "effective_rounds_to_target": _integer(numbers["effective_rounds_to_target"]),
        "bytes_to_target": _integer(numbers["bytes_to_target"]),
        "total_bytes": _integer(numbers["total_bytes"]),
        "compute_seconds_model": _significant(numbers["compute_seconds_model"]),
        "compute_seconds_to_target": _significant(numbers["compute_seconds_to_target"]),
        "communication_seconds_model": _significant(numbers["communication_seconds_model"]),
        "train_seconds": _rounded(numbers["seconds"], 2),
        "cpd_median": _rounded(numbers["cpd_median"]),
        "accuracy": [_rounded(record.get("accuracy")) for record in history],
    }
    setup_seconds = _rounded(numbers["setup_seconds"], 2)
    if setup_seconds:
        record["setup_seconds"] = setup_seconds
    if any(_finite(record.get("cpd_median")) for record in history):
        record["cpd"] = [_rounded(record.get("cpd_median")) for record in history]
    if any(_finite(record.get("compute_seconds_model")) and record["compute_seconds_model"] > 0 for record in history):
        record["compute_seconds"] = [_significant(record.get("compute_seconds_model"), 4) for record in history]
    weights = weight_record(metrics.get("setup_report") or {})
    if weights is not None:
        record["weights"] = weights
    info = info or {}
    record["commit"] = info.get("git_commit")
    record["dirty"] = (provenance or {}).get("git_dirty")
    record["fedplug"] = (info.get("packages") or {}).get("fedplug")
    record["config_hash"] = config_hash(run.config.model_dump(mode="json"))
    record["overrides"] = list(overrides)
    return record


WEIGHT_CLIENT_STATS = ("q05", "median", "q95", "std")
"""The per-client sample-weight statistics a record keeps (of FedDisk's ``sample_weight.*``)."""


def weight_record(setup_report: dict[str, Any]) -> dict[str, Any] | None:
    """The compact form of a setup phase's sample-weight summary (metrics.json's
    ``setup_report``, :func:`fedplug.algorithms.feddisk.weights.weight_summary`): the
    pooled histogram ``{"edges", "counts"}`` and, per client (client order), the weights'
    5% quantile, median, 95% quantile and std, 4 significant digits. None when the report
    has no histogram (no setup phase, or one that reports no weights)."""
    histogram = setup_report.get("sample_weight.histogram")
    if not isinstance(histogram, dict) or not histogram.get("counts"):
        return None
    compact: dict[str, Any] = {
        "edges": [_significant(edge, 4) for edge in histogram["edges"]],
        "counts": [int(count) for count in histogram["counts"]],
    }
    for stat in WEIGHT_CLIENT_STATS:
        values = setup_report.get(f"sample_weight.{stat}")
        if isinstance(values, list):
            compact[stat] = [_significant(value, 4) for value in values]
    return compact


def dump_records(records: Iterable[dict[str, Any]]) -> str:
    """A results file's text: one compact JSON object per line."""
    return "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results file (empty when it does not exist).

    Raises:
        DataError: a line is not a JSON object with ``run``, ``cell``, ``algorithm``,
            ``draw``, ``seed`` (the message names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not JSON ({error.msg}); restore the file from git or re-run the study") from None
        missing = [key for key in ("run", "cell", "algorithm", "draw", "seed") if not isinstance(record, dict) or key not in record]
        if missing:
            raise DataError(f"{path}:{number}: a study record needs {', '.join(missing)}; restore the file from git or re-run the study")
        records.append(record)
    return records


# ---------------------------------------------------------------------- statistics


SUMMARY_COLUMNS = (
    "final_accuracy", "last3_accuracy", "best_accuracy", "final_client_accuracy", "final_loss", "rounds_to_target",
    "effective_rounds_to_target", "bytes_to_target", "setup_rounds", "total_bytes", "compute_seconds_model",
    "compute_seconds_to_target", "communication_seconds_model", "cpd_median", "train_seconds",
)
"""The numeric columns of :func:`summarise` (mean over runs, and ``<column>_std``)."""


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator) of the values that
    are not None; (None, None) without values, std None with one."""
    present = [float(value) for value in values if value is not None]
    if not present:
        return None, None
    return float(np.mean(present)), (float(np.std(present, ddof=1)) if len(present) > 1 else None)


def paired_comparison(values: dict[tuple[int, int], float | None],
                      reference: dict[tuple[int, int], float | None]) -> dict[str, Any]:
    """A method against a reference on the runs both have (same draw, same seed): how
    many pairs the method wins (strictly higher), ties and loses, and the mean and sample
    std of the paired difference method - reference (None without pairs)."""
    pairs = [key for key in values if key in reference and values[key] is not None and reference[key] is not None]
    differences = [float(values[key]) - float(reference[key]) for key in pairs]  # type: ignore[arg-type]
    mean, std = mean_std(differences)
    return {
        "pairs": len(pairs),
        "wins": sum(difference > 0 for difference in differences),
        "ties": sum(difference == 0 for difference in differences),
        "losses": sum(difference < 0 for difference in differences),
        "difference": mean,
        "difference_std": std,
    }


def summarise(records: Sequence[dict[str, Any]], metric: str = "final_accuracy",
              baseline: str | None = None, baselines: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per grid cell x algorithm (in record order): the cell's axis labels,
    ``cell`` (its id), ``algorithm``, ``runs``, ``draws`` and ``seeds`` (distinct counts),
    ``reached`` (runs that reached the target), each of :data:`SUMMARY_COLUMNS` as the mean
    over the runs with a value (the target columns: the runs that reached it) plus
    ``<column>_std`` (sample std), ``metric`` (the headline metric's name),
    ``reference`` (the algorithm it is compared with: its ``baselines`` entry, else
    ``baseline``; None on the baseline's own row) and, against the reference in the same
    cell, ``paired`` = :func:`paired_comparison` of ``metric``."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((cell_id(record["cell"]), record["algorithm"]), []).append(record)
    rows = []
    for (cell, algorithm), members in groups.items():
        row: dict[str, Any] = dict(members[0]["cell"])
        row["cell"] = cell
        row["algorithm"] = algorithm
        row["runs"] = len(members)
        row["draws"] = len({member["draw"] for member in members})
        row["seeds"] = len({member["seed"] for member in members})
        row["reached"] = sum(member.get("rounds_to_target") is not None for member in members)
        for column in SUMMARY_COLUMNS:
            row[column], row[f"{column}_std"] = mean_std(member.get(column) for member in members)
        row["metric"] = metric
        row["paired"] = None
        reference = (baselines or {}).get(algorithm, baseline)
        row["reference"] = reference if reference != algorithm else None
        if row["reference"] is not None and (cell, reference) in groups:
            row["paired"] = paired_comparison(
                {(member["draw"], member["seed"]): member.get(metric) for member in members},
                {(member["draw"], member["seed"]): member.get(metric) for member in groups[(cell, reference)]},
            )
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
    return text if row["reached"] == row["runs"] else f"{text} ({row['reached']}/{row['runs']} reached)"


def _runs(row: dict[str, Any]) -> str:
    if row["runs"] == row["draws"] * row["seeds"]:
        return f"{row['runs']} ({row['draws']}×{row['seeds']})"
    return f"{row['runs']} ({row['draws']} draws, {row['seeds']} seeds)"


METRIC_NAMES = {
    "final_accuracy": "final acc",
    "last3_accuracy": "acc, mean of last 3 rounds",
    "best_accuracy": "best acc",
    "final_loss": "final loss",
    "final_client_accuracy": "final client acc",
    "rounds_to_target": "rounds to target",
    "compute_seconds_model": "cost-model compute s",
    "compute_seconds_to_target": "cost-model compute s to target",
    "communication_seconds_model": "cost-model communication s",
    "total_bytes": "total bytes",
    "train_seconds": "train s (measured)",
    "cpd_median": "median CPD",
}
"""Readable names of :func:`summarise`'s columns, for tables and axes."""


def metric_name(metric: str) -> str:
    return METRIC_NAMES.get(metric, metric.replace("_", " "))


def summary_table(rows: Sequence[dict[str, Any]], axes: Sequence[str], target: float, *,
                  labels: dict[str, str] | None = None, baseline: str | None = None,
                  columns: Sequence[str] = (), baselines: dict[str, str] | None = None) -> str:
    """The summary table as markdown: one line per grid cell x algorithm, the headline
    metric (mean ± std over runs) first, best-over-rounds beside it, then rounds and bytes
    to ``target``, the setup rounds where any run has them, ``columns`` (e.g. the median CPD),
    and the paired comparison with each row's reference (``baseline``, or the algorithm's
    ``baselines`` entry, named in the cell): wins/ties/losses and mean ± std of the paired
    difference. ``compute_seconds_to_target`` is the mean ± std over the runs that reached
    the target, with ``k/n reached``."""
    metric = rows[0]["metric"] if rows else "final_accuracy"
    target_label = f"{100 * target:g}%"
    show_setup = any((row.get("setup_rounds") or 0) > 0 for row in rows)
    header = [*axes, "algorithm", "runs (draws×seeds)", f"{metric_name(metric)} (mean ± std)"]
    if metric != "best_accuracy":
        header.append("best acc (over rounds)")
    header.append(f"rounds to {target_label}")
    if show_setup:
        header += ["setup rounds", f"effective rounds to {target_label}"]
    header.append(f"bytes to {target_label}")
    header += [metric_name(column) for column in columns]
    if baseline is not None or baselines:
        what = (f"vs {display_name(baseline, labels)}" if not baselines else
                f"vs baseline ({display_name(baseline, labels)} unless named)" if baseline else "vs baseline")
        header += [f"{what}: wins/ties/losses", "paired difference"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * (len(axes) + 1) + "---:|" * (len(header) - len(axes) - 1)]
    for row in rows:
        cells = [str(row[axis]) for axis in axes] + [display_name(row["algorithm"], labels), _runs(row),
                                                     _cell(row[metric], row[f"{metric}_std"])]
        if metric != "best_accuracy":
            cells.append(_cell(row["best_accuracy"], row["best_accuracy_std"]))
        cells.append(_rounds(row, "rounds_to_target"))
        if show_setup:
            cells += [f"{row['setup_rounds']:.0f}", _rounds(row, "effective_rounds_to_target")]
        cells.append(_bytes(row["bytes_to_target"]))
        for column in columns:
            if column == "total_bytes":
                cells.append(_bytes(row[column]))
            elif column == "compute_seconds_to_target":
                cells.append("not reached" if row[column] is None else
                             f"{_seconds(row[column], row[f'{column}_std'])} ({row['reached']}/{row['runs']} reached)")
            elif "seconds" in column:
                cells.append(_seconds(row[column], row[f"{column}_std"]))
            else:
                cells.append(_cell(row[column], row[f"{column}_std"], 3 if column == "cpd_median" else 4))
        if baseline is not None or baselines:
            paired = row.get("paired")
            reference = (baselines or {}).get(row["algorithm"], baseline)
            named = f" vs {display_name(reference, labels)}" if row["algorithm"] in (baselines or {}) else ""
            if reference is None:
                cells += ["-", ""]
            elif reference == row["algorithm"]:
                cells += ["(baseline)", ""]
            elif not paired or not paired["pairs"]:
                cells += ["no paired runs" + named, ""]
            else:
                cells += [f"{paired['wins']}/{paired['ties']}/{paired['losses']} of {paired['pairs']}{named}",
                          _signed(paired["difference"], paired["difference_std"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _seconds(value: float | None, std: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" + (f" ± {std:.2g}" if std is not None else "")


def _signed(value: float | None, std: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.4f}" + (f" ± {std:.4f}" if std is not None else "")


# ---------------------------------------------------------------------------- plots

LINE_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"), ("-.", "X"), (":", "*"))
"""Line style and marker of the i-th algorithm (with the i-th colour of tab10): curves that
lie on top of each other stay distinguishable."""

CPD_NOTE = ("CPD: class probability distance between the groups formed in a round (FedGSP, eq. 14: "
            "RBF-kernel MMD of their class distributions), the median over pairs of groups; for FedAvg "
            "every client is its own group. Lower = groups more alike.")


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
    ``"linear"`` unless the positive values span more than ``ratio`` (so that FedAvg's CPD
    does not squash the grouped modes' boxes); then ``"log"``, or ``"symlog"`` linear up
    to the smallest positive value when some values are 0."""
    positive = [value for value in values if value > 0]
    if not positive or max(positive) / min(positive) <= ratio:
        return "linear", None
    if len(positive) < len(values):
        return "symlog", min(positive)
    return "log", None


def plot_cpd_box(records: Sequence[dict[str, Any]], path: str | Path, title: str, *,
                 labels: dict[str, str] | None = None) -> None:
    """Horizontal box plot of the per-round median CPD values of each algorithm, one box
    per grid cell and algorithm when the study has several cells (runs pooled);
    algorithms without CPD values are left out. The x axis is logarithmic when the values
    span more than a factor 20 (symmetric-log, linear near 0, when some are 0). The
    caption explains CPD."""
    plt = _pyplot()
    values: dict[tuple[str, str], list[float]] = {}
    for record in records:
        cpds = [float(value) for value in record.get("cpd") or [] if _finite(value)]
        if cpds:
            values.setdefault((cell_id(record["cell"]), record["algorithm"]), []).extend(cpds)
    if not values:
        raise DataError("no run reported cpd_median values; a CPD box plot needs a grouper that computes them")
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
    axes.set_xlabel("per-round median CPD between groups" + scale)
    axes.grid(True, axis="x", alpha=0.3)
    axes.set_title(title)
    note = " [cell]: the grid cell." if several_cells else ""
    _caption(figure, CPD_NOTE + " One value per round and run; box = quartiles, whiskers = 1.5 IQR." + note)
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


def pooled_weight_histogram(records: Sequence[dict[str, Any]], bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """The records' sample-weight histograms (``weights``) on common edges (0 to the
    largest edge of any of them, ``bins`` bins), averaged over the records: (edges,
    samples per run). Each record's counts are spread over the common bins in proportion
    to how much of its bin each covers (uniform within a bin)."""
    histograms = [record["weights"] for record in records if record.get("weights")]
    if not histograms:
        raise DataError("no run has sample-weight summaries ('weights'); a weight histogram needs a setup phase that reports them")
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


def plot_weight_histogram(records: Sequence[dict[str, Any]], path: str | Path, title: str, *,
                          labels: dict[str, str] | None = None) -> None:
    """Small multiples of the setup phase's sample weights (FedDisk's density-ratio
    weights): one panel per grid cell (rows) x algorithm with weights (columns), the
    histogram of :func:`pooled_weight_histogram` on a log count axis, the value 1 (an
    untrained D: no reweighting) marked, and the median of the per-client stds written in
    the panel."""
    plt = _pyplot()
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        if record.get("weights"):
            groups.setdefault((cell_id(record["cell"]), record["algorithm"]), []).append(record)
    if not groups:
        raise DataError("no run has sample-weight summaries ('weights'); a weight histogram needs a setup phase that reports them")
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
            edges, counts = pooled_weight_histogram(members)
            axes.axvline(1.0, color="0.35", linestyle="--", linewidth=1.0, zorder=1)
            axes.stairs(counts, edges, fill=True, color=_style(j)["color"], alpha=0.8, zorder=2)
            axes.set_yscale("log")
            positive = counts[counts > 0]
            if positive.size:  # from half the smallest bar: a lone spike keeps a visible height
                axes.set_ylim(float(positive.min()) / 2, float(positive.max()) * 3)
            axes.annotate("1 = no reweighting", xy=(1.0, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                          textcoords="offset points", ha="left", va="top", fontsize=7, color="0.3")
            stds = [value for member in members for value in member["weights"].get("std") or [] if _finite(value)]
            note = f"n={len(members)} runs" + (f"\nmedian client std {np.median(stds):.3g}" if stds else "")
            axes.annotate(note, xy=(0.98, 0.84), xycoords="axes fraction", ha="right", va="top", fontsize=7)
            where = ", ".join(f"{axis} = {value}" for axis, value in members[0]["cell"].items())
            axes.set_title(display_name(algorithm, labels) + (f"\n{where}" if where else ""), fontsize=9)
            axes.grid(True, alpha=0.3)
            if j == 0:
                axes.set_ylabel("samples per run (log)")
            if i == len(cells) - 1:
                axes.set_xlabel("sample weight")
    figure.suptitle(title)
    _caption(figure, "Each panel: the sample weights of all clients pooled, counts averaged over the runs (log scale; "
                     "runs of one partition draw share their weights). Dashed line: weight 1 = an untrained D / no "
                     "reweighting; a spike there means the weighting changes nothing. Rows: "
                     + (" / ".join(axes_names) or "one cell") + ".")
    figure.savefig(path, dpi=110)
    plt.close(figure)


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
