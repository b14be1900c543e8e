"""A study's hyperparameter search (``tune:``): Optuna chooses the parameters of each
algorithm on validation samples held out of the clients' training data, and the study's
runs train with the chosen values.

For each tuned algorithm (or once, ``per_algorithm: false``), one Optuna study (a seeded
``TPESampler``, or a ``GridSampler``, which tries its points in an order its seed shuffles) runs
``trials`` trials. A trial trains the algorithm's run of the tuned cell (first draw and
seed, or each of ``tune.draws``) with the trial's values and ``data.validation_fraction``
set, reports the round's ``val_accuracy`` (or ``val_loss``) to Optuna after every round,
and is stopped by the ``median`` pruner when it falls behind. Its score is the last
round's value, the best, or the mean of the last ``window`` rounds, averaged over its
draws. Trials never read a test set: the objective and the pruner see only the validation
metrics (:meth:`fedplug.data.federation.Federation.validation_set`).

Every finished trial is one line of the study's trials file (:mod:`fedplug.study.trials`),
appended as it ends; a search interrupted midway starts from the trials the file holds.

Every trial is an MLflow run nested under one tuning parent run per study folder
(experiment ``study-<name>``, found again by its tag ``fedplug.parent = tune:<folder>``).
The choice is written to ``<folder>/tuned.json`` (algorithm -> values, trials, best
value), reused while the ``tune:`` section and the tuned run's config are unchanged, and
recorded in every run's record (``tuned``). The runner calls :func:`apply_tuning` once.
``tuned.json`` and the MLflow runs are kept by :mod:`fedplug.study.tuning_records`; each
trial's line of the trials file by :mod:`fedplug.study.trials`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedplug.config import flatten, set_dotted, validate_experiment
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError, DataError, TrainingError
from fedplug.registry import Registry
from fedplug.run.model import resolve_device
from fedplug.run.results import RoundRecord, RunResult
from fedplug.study.expansion import StudyRun
from fedplug.study.run_folders import comparable_config
from fedplug.study.spec import StudySpec, TuneSpec, algorithm_cells, cell_id, grid_cells
from fedplug.study.tuning_records import (  # noqa: F401 - re-exported: callers import them from here
    TUNED_NAME,
    TuningTracking,
    log_tuning_summary,
    open_tuning_parent,
    read_tuned,
    trial_tracker_opener,
    write_tuned,
)
from fedplug.study.trials import (
    SearchContext,
    TrialOutcome,
    append_trial,
    edge_message,
    edges,
    frozen_trial,
    load_trials,
    restorable_lines,
    trial_line,
)

EVERY_ALGORITHM = "all"
"""The key of ``tuned.json``'s one entry with ``per_algorithm: false``."""
FAILURE_ATTR = "fedplug.failure"
"""The user attribute of a failed Optuna trial that keeps why it failed (one line)."""
FAILURE_TAG_LENGTH = 500
"""Characters of a failure's reason kept in a trial's line, attribute and MLflow tag."""


@dataclass(frozen=True)
class TunedRun(StudyRun):
    """A study run whose config holds values chosen by the study's ``tune:`` search."""

    tuned: dict[str, Any] = field(default_factory=dict)
    """Config path -> chosen value, as written to the run's record."""
    tuning: dict[str, Any] = field(default_factory=dict)
    """What chose them (:meth:`Choice.summary`), as written to the run's record."""


@dataclass(frozen=True)
class Choice:
    """What one search chose: the values, the trials behind them, the best metric."""

    params: dict[str, Any]
    value: float
    trials: int
    pruned: int
    tuned_on: str
    """The run id whose config the trials trained (with the trial's values)."""
    fingerprint: str
    """:func:`search_fingerprint` of the search: it is reused while this matches."""
    seconds: float = 0.0
    """The search's wall time."""
    edge: dict[str, bool] = field(default_factory=dict)
    """Path -> whether its chosen value lies at an edge of its search space
    (:func:`fedplug.study.trials.edge_side`); empty for a choice made before it was kept."""

    def as_dict(self) -> dict[str, Any]:
        entry = {"params": self.params, "value": self.value, "trials": self.trials, "pruned": self.pruned,
                 "tuned_on": self.tuned_on, "fingerprint": self.fingerprint, "seconds": self.seconds}
        return {**entry, "edge": self.edge} if self.edge else entry

    def summary(self) -> dict[str, Any]:
        """What a run's record keeps of the search: its best validation value, trials,
        pruned trials, wall time, the run it trained and its fingerprint (with the record's
        ``tuned`` values, the whole choice: :func:`recorded_choice` reads it back)."""
        return {"value": self.value, "trials": self.trials, "pruned": self.pruned, "seconds": self.seconds,
                "tuned_on": self.tuned_on, "fingerprint": self.fingerprint}


def recorded_choice(spec: StudySpec, runs: Sequence[StudyRun], records: Sequence[Mapping[str, Any]], key: str,
                    fingerprint: str) -> Choice | None:
    """The choice of search ``key`` as a record of one of its runs keeps it (``tuned`` and
    ``tuning``), when that record's search had ``fingerprint``; else None. So a study
    whose results file is committed needs no search on a fresh clone."""
    keyed = {run.run_id for run in runs if search_key(spec, run) == key}
    for record in records:
        tuning, tuned = record.get("tuning"), record.get("tuned")
        if record.get("run") in keyed and isinstance(tuning, dict) and isinstance(tuned, dict):
            choice = stored_choice({**tuning, "params": dict(tuned)}, fingerprint)
            if choice is not None:
                return choice
    return None


OPTIONAL_CHOICE_FIELDS = {"edge"}
"""Fields of a :class:`Choice` that entries written before them lack."""


def stored_choice(entry: Any, fingerprint: str) -> Choice | None:
    """``entry`` (a ``tuned.json`` entry, or a record's ``tuning`` with its ``tuned``
    values) as a :class:`Choice` when it has a choice's fields (those of
    :data:`OPTIONAL_CHOICE_FIELDS` or not) and ``fingerprint``; else None (another search,
    or another version of the fields)."""
    every = set(Choice.__dataclass_fields__)
    if (isinstance(entry, Mapping) and every - OPTIONAL_CHOICE_FIELDS <= set(entry) <= every
            and entry["fingerprint"] == fingerprint):
        return Choice(**entry)
    return None


# ---------------------------------------------------------------------- checking


def check_tune_params(spec: StudySpec, runs: Sequence[StudyRun], registry: Registry | None = None) -> None:
    """Refuse (one line) a ``tune.params`` path that a tuned algorithm's config lacks,
    naming the known keys beside it, or a value the config refuses (each value of a list,
    a range's ends), before anything trains.

    Raises:
        ConfigError: e.g. ``train.optimizer.lrr`` (did you mean ``train.optimizer.lr``?).
    """
    if spec.tune is None:
        return
    check_budgets(spec)
    for algorithm in tuned_algorithms(spec):
        config = tuning_run(spec, runs, algorithm).config
        if spec.tune.window is not None and spec.tune.window > config.train.rounds:
            raise ConfigError(f"{spec.name}: tune.window {spec.tune.window} is more rounds than algorithm "
                              f"{algorithm!r} trains ({config.train.rounds}); lower it or raise train.rounds")
        known = flatten(config)
        sections = {".".join(key.split(".")[:depth]) for key in known for depth in range(1, key.count(".") + 1)}
        params = algorithm_space(spec.tune, algorithm).params
        for path in params:
            if path not in known and path not in sections:
                raise ConfigError(f"{spec.name}: tune.params: {unknown_path_message(path, algorithm, known)}")
            space = params[path]
            for value in space if isinstance(space, list) else [space.low, space.high]:
                with_values(config, {path: value}, registry)


def check_budgets(spec: StudySpec) -> None:
    """With ``tune.equal_trials``, refuse (one line) search spaces that give the tuned
    algorithms different numbers of trials (:func:`number_of_trials`).

    Raises:
        ConfigError: e.g. ``fedavg 5 trials, fedprox 15``.
    """
    if spec.tune is None or not spec.tune.equal_trials:
        return
    budgets = {algorithm: number_of_trials(algorithm_space(spec.tune, algorithm))
               for algorithm in tuned_algorithms(spec)}
    if len(set(budgets.values())) > 1:
        listed = ", ".join(f"{algorithm} {count}" for algorithm, count in budgets.items())
        raise ConfigError(f"{spec.name}: tune.equal_trials: the searches get different numbers of trials ({listed}); "
                          f"set `trials:` to at most {min(budgets.values())} or give every grid as many points")


def unknown_path_message(path: str, algorithm: str, known: Mapping[str, Any]) -> str:
    """``'train.optimizer.lrr' is not a key of algorithm 'fedavg''s config; did you mean
    'train.optimizer.lr'? keys under train.optimizer: ...``."""
    parts = path.split(".")
    prefix = ""
    for depth in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:depth])
        if any(key.startswith(candidate + ".") for key in known):
            prefix = candidate
            break
    siblings = sorted(key for key in known if key.startswith(prefix + ".")) if prefix else sorted(known)
    close = difflib.get_close_matches(path, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{path!r} is not a key of algorithm {algorithm!r}'s config{hint} "
            f"keys{' under ' + prefix if prefix else ''}: {', '.join(siblings)}")


# ---------------------------------------------------------------------- planning


def tuned_algorithms(spec: StudySpec) -> list[str]:
    """The algorithms a search runs for: each of ``tune.algorithms`` (default: every
    algorithm) with ``per_algorithm``, else the first of them."""
    algorithms = [label for label in spec.algorithms if spec.tune is None or spec.tune.algorithms is None
                  or label in spec.tune.algorithms]
    return algorithms if spec.tune is None or spec.tune.per_algorithm else algorithms[:1]


def algorithm_space(tune: TuneSpec, algorithm: str) -> TuneSpec:
    """``tune`` with ``algorithm``'s search space: ``params`` and its ``algorithm_params``."""
    extra = tune.algorithm_params.get(algorithm)
    return tune.model_copy(update={"params": {**tune.params, **extra}}) if extra else tune


@dataclass(frozen=True)
class Search:
    """One search of a study: what it tunes, where, and the key of its choice."""

    algorithm: str
    cell: str
    key: str
    """Its entry in ``tuned.json``: the algorithm (:data:`EVERY_ALGORITHM` without
    ``per_algorithm``), then ``@<cell id>`` with ``per_cell``."""


def searches(spec: StudySpec) -> list[Search]:
    """Every search of the study, in study order: one per tuned algorithm (or one), in
    its tuning cell, or, with ``per_cell``, in every cell it runs in."""
    tune = spec.tune
    if tune is None:
        return []
    found = []
    for algorithm in tuned_algorithms(spec):
        cells = algorithm_cells(spec, algorithm) if tune.per_cell else [tuning_cell(spec, algorithm)]
        found.extend(Search(algorithm, cell, choice_key(tune, algorithm, cell)) for cell in cells)
    return found


def search_key(spec: StudySpec, run: StudyRun) -> str | None:
    """The key of the choice ``run`` trains with (None: its algorithm is not tuned)."""
    tune = spec.tune
    if tune is None or (tune.algorithms is not None and run.algorithm not in tune.algorithms):
        return None
    return choice_key(tune, run.algorithm, run.cell_id)


def choice_key(tune: TuneSpec, algorithm: str, cell: str) -> str:
    """The ``tuned.json`` key of the choice ``algorithm`` trains with in ``cell``: the
    algorithm (:data:`EVERY_ALGORITHM` without ``per_algorithm``), then ``@<cell>`` with
    ``per_cell``. The searches write under it and the runs read it, so both call this."""
    name = algorithm if tune.per_algorithm else EVERY_ALGORITHM
    return f"{name}@{cell}" if tune.per_cell else name


def tuning_cell(spec: StudySpec, algorithm: str) -> str:
    """The id of the cell ``algorithm`` is tuned in: the first cell matching
    ``tune.cell`` that the algorithm runs in, else its first cell."""
    wanted = spec.tune.cell if spec.tune is not None else {}
    runs_in = algorithm_cells(spec, algorithm)
    for cell in grid_cells(spec.grid):
        if all(cell.get(axis) == label for axis, label in wanted.items()) and cell_id(cell) in runs_in:
            return cell_id(cell)
    return runs_in[0]


def tuning_run(spec: StudySpec, runs: Sequence[StudyRun], algorithm: str, cell: str | None = None) -> StudyRun:
    """The run whose config ``algorithm``'s trials train: its first in ``cell`` (default:
    its tuning cell)."""
    cell = cell if cell is not None else tuning_cell(spec, algorithm)
    for run in runs:
        if run.algorithm == algorithm and run.cell_id == cell:
            return run
    raise ConfigError(f"{spec.name}: tune: algorithm {algorithm!r} has no run in cell {cell!r}")


def with_values(config: Any, values: Mapping[str, Any], registry: Registry | None) -> Any:
    """``config`` with each dotted path of ``values`` set, validated again.

    Raises:
        ConfigError: a value the config refuses (the message names it).
    """
    document = copy.deepcopy(config.model_dump(mode="json"))
    for path, value in values.items():
        document = set_dotted(document, path, value)
    try:
        updated = validate_experiment(document, registry)
    except ConfigError as error:
        reason = str(error).removeprefix("invalid config:").strip().replace("\n", "; ")
        raise ConfigError(f"tune: {dict(values)} gives an invalid config: {reason}") from None
    updated.data.read_against(getattr(config.data, "_folder", None))  # a relative data.root, read as before
    return updated


def trial_config(config: Any, tune: TuneSpec, values: Mapping[str, Any], registry: Registry | None,
                 draw: int | None = None) -> Any:
    """A trial's config: ``config`` with the trial's ``values``, the validation split and,
    given a ``draw``, that partition draw (``data.seed``)."""
    drawn = {} if draw is None else {"data.seed": draw}
    return with_values(config, {**values, "data.validation_fraction": tune.validation_fraction, **drawn}, registry)


def tuning_draws(tune: TuneSpec, config: Any) -> list[int]:
    """The draws a trial trains on: ``tune.draws``, else the tuned run's own."""
    return list(tune.draws) if tune.draws is not None else [config.data.seed]


OTHER_SEARCHES = {"algorithms", "algorithm_params"}
"""``tune:`` fields that name other algorithms' searches; a search's fingerprint leaves
them out (its own ``algorithm_params`` are already in its ``params``)."""
CHECKS_ONLY = {"equal_trials"}
"""``tune:`` fields that only check the study file: no choice depends on them."""
ADDED_FIELDS = ("window", "draws")
"""``tune:`` fields added after searches were committed: a fingerprint holds one only when
it is set, so that the choices made before it existed are still found."""


def search_fingerprint(tune: TuneSpec, config: Any) -> str:
    """What a search's choice depends on: its search space (``tune`` as
    :func:`algorithm_space` gives it, without :data:`OTHER_SEARCHES`, :data:`CHECKS_ONLY`
    and the unset :data:`ADDED_FIELDS`) and the tuned run's config as far as it can change
    results (:func:`~fedplug.study.run_folders.comparable_config`: not the study's name, the
    tracking, the worker count). Adding an algorithm to the search, changing another one's
    grid, or renaming the study keeps it."""
    left_out = OTHER_SEARCHES | CHECKS_ONLY | {name for name in ADDED_FIELDS if getattr(tune, name) is None}
    content = json.dumps({"tune": tune.model_dump(mode="json", exclude=left_out),
                          "config": comparable_config(config.model_dump(mode="json"))}, sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()


# ---------------------------------------------------------------------- one search


def objective_value(history: Sequence[RoundRecord], tune: TuneSpec) -> float:
    """A trial's score on one draw: its validation metric at the last round, the best over
    rounds, or the mean over the last ``window`` rounds (a diverged round, NaN, makes it the
    worst value)."""
    values = [round_value(record, tune) for record in history]
    if tune.select == "last":
        return values[-1]
    if tune.select == "window":
        last = values[-int(tune.window or 1):]
        return math.fsum(last) / len(last)
    return max(values) if tune.metric == "val_accuracy" else min(values)


def round_value(record: RoundRecord, tune: TuneSpec) -> float:
    """A round's validation metric; a NaN (a diverged loss) counts as the worst value.

    Raises:
        TrainingError: the round has no validation metric (a runtime without the split).
    """
    if tune.metric not in record.metrics:
        raise TrainingError(f"round {record.round} reports no {tune.metric}; the runtime evaluates no validation split")
    value = float(record.metrics[tune.metric])
    if math.isnan(value):
        return -math.inf if tune.metric == "val_accuracy" else math.inf
    return value


def make_sampler(tune: TuneSpec) -> Any:
    """Optuna's sampler for ``tune``: a seeded TPESampler (its first half of the trials,
    at most 10, drawn at random), or a GridSampler over the lists."""
    import optuna

    if tune.sampler == "grid":
        return optuna.samplers.GridSampler(dict(tune.params), seed=tune.seed)  # type: ignore[arg-type]
    trials = tune.trials or 1
    return optuna.samplers.TPESampler(seed=tune.seed, n_startup_trials=max(1, min(10, trials // 2)))


def make_pruner(tune: TuneSpec) -> Any:
    """Optuna's MedianPruner with ``tune``'s settings, or a pruner that never prunes."""
    import optuna

    if tune.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tune.pruner_startup_trials,
                                           n_warmup_steps=tune.pruner_warmup_rounds)
    return optuna.pruners.NopPruner()


def grid_points(tune: TuneSpec) -> list[dict[str, Any]]:
    """Every combination of the lists (the grid's points)."""
    paths = list(tune.params)
    lists = [tune.params[path] for path in paths]
    return [dict(zip(paths, values)) for values in itertools.product(*lists)]  # type: ignore[arg-type]


def number_of_trials(tune: TuneSpec) -> int:
    """``trials``, at most the number of grid points for ``grid``."""
    if tune.sampler == "grid":
        points = len(grid_points(tune))
        return points if tune.trials is None else min(points, tune.trials)
    return int(tune.trials or 1)


def suggest(trial: Any, tune: TuneSpec) -> dict[str, Any]:
    """The trial's values, one Optuna suggestion per path."""
    values: dict[str, Any] = {}
    for path, space in tune.params.items():
        if isinstance(space, list):
            values[path] = trial.suggest_categorical(path, space)
        elif space.integer:
            values[path] = trial.suggest_int(path, int(space.low), int(space.high), log=space.log)
        else:
            values[path] = trial.suggest_float(path, space.low, space.high, log=space.log)
    return values


def trial_failures() -> tuple[type[Exception], ...]:
    """What fails one trial and not the search: values that train badly
    (:class:`TrainingError`: a diverged model), or that the data or the config refuse
    although the ``tune:`` ranges' ends passed (:class:`DataError`: ``data.num_clients``
    above the dataset's samples; :class:`ConfigError` and pydantic's ``ValidationError``)."""
    from pydantic import ValidationError

    return (TrainingError, DataError, ConfigError, ValidationError)


def failure_reason(error: BaseException) -> str:
    """``error``'s message on one line, at most :data:`FAILURE_TAG_LENGTH` characters."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text[:FAILURE_TAG_LENGTH]


class ReportedFailures(logging.Filter):
    """Keeps Optuna's own log of a failed trial (a warning with the traceback, then
    "failed with value None") off stderr for the trials whose one line fedplug printed."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers: set[int] = set()
        """Trial numbers already reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(f"Trial {number} failed") for number in self.numbers)


OPTUNA_TRIAL_LOGGER = "optuna.study._optimize"
"""The logger Optuna reports each trial's outcome to (``optuna/study/_optimize.py``)."""


Train = Callable[[Any, Sequence[Callable[[RoundRecord], None]]], RunResult]
"""Trains a config with round observers (the trial's reporter), returning its result."""
OpenTracker = Callable[[Any, int, Mapping[str, Any]], Any]
"""Opens a trial's tracker: (config, trial number, values) -> :class:`fedplug.tracking.observer.Tracker`."""


RecordTrial = Callable[[int, Mapping[str, Any], str, TrialOutcome, Mapping[str, Any]], None]
"""Keeps a finished trial: (number, values, state, outcome, details: ``score``, ``reason``,
``config``, ``seconds``) -> the trials file's line (:func:`trial_recorder`)."""


def search(tune: TuneSpec, config: Any, registry: Registry | None, train: Train, open_trial_tracker: OpenTracker,
           *, label: str = "", report: Callable[[str], None] = print, record_trial: RecordTrial | None = None,
           restored: Sequence[Any] = ()) -> Any:
    """Run one Optuna study on ``config`` (the tuned run's) and return it, every trial
    trained by ``train`` on each draw of :func:`tuning_draws` and logged by the tracker
    ``open_trial_tracker`` opens (its first draw's rounds), then kept by ``record_trial``.

    A trial's score is the mean over its draws of :func:`objective_value`; the pruner sees
    draw k's round r as step ``k * rounds + r``. ``restored`` (Optuna's ``FrozenTrial`` objects of trial
    0, 1, ... of an interrupted search: :func:`fedplug.study.trials.frozen_trial`) go into the
    study first, and only the trials left of :func:`number_of_trials` run.

    A trial that fails (:func:`trial_failures`: it diverged, or the data or config refuse
    its values) is Optuna's ``TrialState.FAIL`` with its reason in the user attribute
    :data:`FAILURE_ATTR` (and its MLflow run FAILED, tagged ``tune.state: failed`` and
    ``tune.error``), reported in one line, and the search goes on."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    direction = "maximize" if tune.metric == "val_accuracy" else "minimize"
    study = optuna.create_study(direction=direction, sampler=make_sampler(tune), pruner=make_pruner(tune))
    for trial in restored:
        study.add_trial(trial)
    total = number_of_trials(tune)
    if restored:
        report(f"tune {label}: {len(restored)} of {total} trials already recorded; running the rest")
    failures = trial_failures()
    reported = ReportedFailures()
    draws = tuning_draws(tune, config)
    rounds = int(config.train.rounds)

    def objective(trial: Any) -> float:
        values = suggest(trial, tune)
        outcome = TrialOutcome()
        started = time.perf_counter()
        tracker: Any = None  # opened once the trial's config is valid
        configs: list[Any] = []

        def keep(state: str, **details: Any) -> None:
            if record_trial is not None:
                record_trial(trial.number, values, state, outcome,
                             {**details, "config": configs[0] if configs else None,
                              "seconds": time.perf_counter() - started})

        try:
            configs = [trial_config(config, tune, values, registry, draw) for draw in draws]
            tracker = open_trial_tracker(configs[0], trial.number, values)
            for index, draw_config in enumerate(configs):
                outcome.start_draw()
                result = train(draw_config, [*([tracker.log_round] if index == 0 else []),
                                             round_reporter(trial, tune, outcome, index * rounds)])
                outcome.draw_scores.append(objective_value(result.history, tune))
                if index == 0:
                    tracker.log_result(result)
            value = math.fsum(outcome.draw_scores) / len(outcome.draw_scores)
        except optuna.TrialPruned:
            tracker.set_tags({"tune.state": "pruned"})
            tracker.finish()
            keep("pruned")
            report(f"tune {label}: trial {trial.number + 1}/{total} {values} pruned")
            raise
        except failures as error:
            reason = failure_reason(error)
            trial.set_user_attr(FAILURE_ATTR, reason)
            if tracker is not None:
                tracker.set_tags({"tune.state": "failed", "tune.error": reason})
                tracker.fail()
            reported.numbers.add(trial.number)
            keep("failed", reason=reason)
            report(f"tune {label}: trial {trial.number + 1}/{total} {values} failed: {reason}")
            raise
        except BaseException:
            if tracker is not None:
                tracker.fail()
            raise
        tracker.set_tags({"tune.state": "complete", "tune.value": repr(value)})
        tracker.finish()
        keep("complete", score=value)
        report(f"tune {label}: trial {trial.number + 1}/{total} {values} -> {tune.metric} {value:.4f}")
        return value

    optuna_trials = logging.getLogger(OPTUNA_TRIAL_LOGGER)
    optuna_trials.addFilter(reported)
    try:
        study.optimize(objective, n_trials=max(0, total - len(restored)), catch=failures)
    finally:
        optuna_trials.removeFilter(reported)
    return study


def round_reporter(trial: Any, tune: TuneSpec, outcome: TrialOutcome, offset: int) -> Callable[[RoundRecord], None]:
    """The round observer of one draw of a trial: keeps the round's validation metrics in
    ``outcome``, reports the metric to Optuna at step ``offset + round`` and stops the trial
    (``optuna.TrialPruned``) when the pruner says so."""
    import optuna

    def report_round(record: RoundRecord) -> None:
        outcome.add_round(record.metrics)
        trial.report(round_value(record, tune), offset + record.round)
        if trial.should_prune():
            raise optuna.TrialPruned(f"{tune.metric} after round {record.round} behind the median")

    return report_round


def best_choice(study: Any, run_id: str, fingerprint: str, label: str) -> Choice:
    """The values of ``study``'s best finished trial (the first of equals).

    Raises:
        TrainingError: no trial finished (all were pruned or failed); when every one
            failed, the first one's reason.
    """
    import optuna

    finished = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.COMPLETE]
    failed = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.FAIL]
    if not finished and failed and len(failed) == len(study.trials):
        first = failed[0]
        raise TrainingError(f"tune {label}: all {len(failed)} trials failed, the first (trial {first.number + 1}, "
                            f"{first.params}) with: {first.user_attrs.get(FAILURE_ATTR, 'see the log above')}; "
                            "change tune.params so that its values can train")
    if not finished:
        raise TrainingError(f"tune {label}: no trial finished ({len(study.trials)} pruned or failed); widen the "
                            "ranges, add trials or turn the pruner off")
    best = study.best_trial
    pruned = sum(trial.state == optuna.trial.TrialState.PRUNED for trial in study.trials)
    return Choice(dict(best.params), float(best.value), len(study.trials), pruned, run_id, fingerprint)


def failed_trials(study: Any) -> int:
    """How many of ``study``'s trials failed (their reasons: :data:`FAILURE_ATTR`)."""
    import optuna

    return sum(trial.state == optuna.trial.TrialState.FAIL for trial in study.trials)


# ---------------------------------------------------------------------- the hook


def apply_tuning(
    spec: StudySpec,
    runs: Sequence[StudyRun],
    out: Path,
    registry: Registry | None,
    *,
    mlflow_root: Path | None,
    fingerprint: str,
    legacy: Any = None,
    search_allowed: bool = True,
    recorded: Sequence[Mapping[str, Any]] = (),
    trials_file: Path | None = None,
    code_version: Mapping[str, Any] | None = None,
) -> list[StudyRun]:
    """The study's runs with the values its ``tune:`` search chose (``runs`` as they are
    without ``tune:``), each a :class:`TunedRun` whose record keeps them.

    Checks the parameter paths first (:func:`check_tune_params`). A search whose
    fingerprint matches its entry in ``out/tuned.json``, or the choice a ``recorded`` run
    of it keeps (:func:`recorded_choice`: the committed results file's records), is
    reused; the others run now
    (unless ``search_allowed`` is False: then one line says so) and are written there,
    under a claim of ``out`` with the study folder's ``fingerprint`` and ``legacy`` rule
    (:func:`fedplug.output_folder.claim`). ``mlflow_root``: the project root whose MLflow
    store the trials are logged to (``base.tracking``, as the runner chooses it); None
    logs nothing.

    ``trials_file`` (the runner's: beside the results file,
    :func:`fedplug.study.trials.trials_path`) gets one line per finished trial, with
    ``code_version`` (``git_commit``, ``git_dirty``); a search that runs first takes back
    the trials it finished there before (:func:`fedplug.study.trials.restorable_lines`).
    None keeps no trials. A choice at an edge of its search space is said in one line and
    kept in ``tuned.json`` (``edge``).

    Raises:
        ConfigError: an unknown parameter path, a value the config refuses, a search
            needed when ``search_allowed`` is False, different budgets with
            ``tune.equal_trials``.
        DataError: the trials file cannot be read.
        OutputError: a trial's line cannot be written.
        TrainingError: every trial of a search was pruned or failed.
    """
    tune = spec.tune
    if tune is None:
        return list(runs)
    check_tune_params(spec, runs, registry)
    saved = read_tuned(out / TUNED_NAME)
    choices: dict[str, Choice] = {}
    tracking: TuningTracking | None = None
    federations: dict[str, Any] = {}
    for planned in searches(spec):
        key, label = planned.key, (planned.key if tune.per_cell else planned.algorithm)
        space = algorithm_space(tune, planned.algorithm)
        run = tuning_run(spec, runs, planned.algorithm, planned.cell)
        wanted = search_fingerprint(space, run.config)
        kept = stored_choice(saved.get(key), wanted) or recorded_choice(spec, runs, recorded, key, wanted)
        if kept is not None:
            choices[key] = kept
            continue
        if not search_allowed:
            raise ConfigError(f"{spec.name}: tune: {out / TUNED_NAME} holds no choice for {label!r} with the "
                              "current tune section and config, nor does a record of the results file; run the "
                              "study without --report-only to tune first")
        if tracking is None and mlflow_root is not None:
            tracking = open_tuning_parent(spec, run.config, out, mlflow_root)
        train = federation_trainer(registry, federations, keep=len(tuning_draws(space, run.config)))
        context = SearchContext(spec.name, key, planned.algorithm, dict(run.cell), wanted, space,
                                tuning_draws(space, run.config), dict(code_version or {}))
        restored = ([frozen_trial(line, space, run.config.train.rounds, FAILURE_ATTR)
                     for line in restorable_lines(load_trials(trials_file), key, wanted)] if trials_file else [])
        started = time.perf_counter()
        study = search(space, run.config, registry, train,
                       trial_tracker_opener(spec, planned.algorithm, tracking, registry), label=label,
                       record_trial=trial_recorder(trials_file, context) if trials_file else None, restored=restored)
        choice = best_choice(study, run.run_id, wanted, label)
        choices[key] = dataclasses.replace(choice, seconds=round(time.perf_counter() - started, 1),
                                           edge=edges(choice.params, space.params))
        failed = failed_trials(study)
        print(f"tune {label}: chose {choices[key].params} ({tune.metric} {choices[key].value:.4f}, "
              f"{choices[key].trials} trials, {choices[key].pruned} pruned, "
              + (f"{failed} failed, " if failed else "") + f"{choices[key].seconds:.0f} s)", flush=True)
        at_edge = edge_message(label, choices[key].params, space.params)
        if at_edge is not None:
            print(at_edge, flush=True)
        saved[key] = choices[key].as_dict()
        write_tuned(out, saved, fingerprint, legacy)
    if tracking is not None:
        log_tuning_summary(tracking, choices, out)
    return [tuned_run(run, choices.get(search_key(spec, run) or ""), registry) for run in runs]


def trial_recorder(path: Path, context: SearchContext) -> RecordTrial:
    """Appends each finished trial of the search ``context`` describes to the trials file
    at ``path`` (:func:`fedplug.study.trials.append_trial`)."""

    def record(number: int, values: Mapping[str, Any], state: str, outcome: TrialOutcome,
               details: Mapping[str, Any]) -> None:
        append_trial(path, trial_line(context, number, values, state, outcome, finished_at=utc_now(), **details))

    return record


def utc_now() -> str:
    """The time now, UTC, to the second (ISO 8601), as run records write it."""
    from datetime import UTC, datetime

    return datetime.now(UTC).replace(microsecond=0).isoformat()


def tuned_run(run: StudyRun, choice: Choice | None, registry: Registry | None) -> StudyRun:
    """``run`` with ``choice``'s values in its config, as a :class:`TunedRun`."""
    if choice is None:
        return run
    config = with_values(run.config, choice.params, registry)
    fields = {name: getattr(run, name) for name in StudyRun.__dataclass_fields__}
    return TunedRun(**{**fields, "config": config}, tuned=dict(choice.params), tuning=choice.summary())


def federation_trainer(registry: Registry | None, federations: dict[str, Any], keep: int = 1) -> Train:
    """Trains a trial config in memory (no run folder), building each data config's
    federation once (``federations`` caches them by data config, at most ``keep``: one per
    tuning draw, so that trials on several draws do not build them again)."""
    from fedplug.experiment import run_experiment

    def train(config: Any, observers: Sequence[Callable[[RoundRecord], None]]) -> RunResult:
        key = json.dumps(config.data.model_dump(mode="json"), sort_keys=True)
        if key not in federations:
            while len(federations) >= max(1, keep):  # the oldest goes first: at most `keep` in memory
                del federations[next(iter(federations))]
            federations[key] = build_federation(config.data, registry_or_default(registry),
                                                resolve_device(config.train.device))
        result, _ = run_experiment(config, None, registry=registry, observers=observers, federation=federations[key])
        return result

    return train


def registry_or_default(registry: Registry | None) -> Registry:
    from fedplug.plugins import default_registry

    return registry if registry is not None else default_registry()
