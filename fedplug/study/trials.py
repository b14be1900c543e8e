"""A study's tuning trials as committed records (issue 40): every trial of every search,
complete, pruned or failed, is one JSON line of ``<results>.trials.jsonl`` beside the
study's results file (:func:`trials_path`), appended as the trial ends
(:func:`append_trial`), so that the whole search can be checked, not only its winner, and
an interrupted search resumes without training its finished trials again
(:func:`restorable_lines`, :func:`frozen_trial`).

Also where a chosen value lies in its search space (:func:`edge_side`): a value at an edge
may be bettered beyond it, so the runner says so and records it.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from fedplug.errors import DataError, OutputError
from fedplug.safe_files import open_regular_fd, read_regular_bytes
from fedplug.study.run_folders import config_hash
from fedplug.study.spec import ParamRange, TuneSpec

TRIALS_SUFFIX = ".trials.jsonl"
"""``<study>.jsonl``'s trials file is ``<study>.trials.jsonl``."""
EDGE_SHARE = 0.05
"""A value within this share of a range's width from either end (on the range's own
scale: logarithmic for ``log: true``) is at that edge."""
CURVES = ("val_accuracy", "val_loss")
"""The per-round validation metrics a trial line keeps, one list per draw."""
RESTORE = "restore the file from git, or delete the line (its trial trains again)"
"""What to do about a trials file that cannot be read."""


def trials_path(results: Path) -> Path:
    """The trials file beside results file ``results``: ``fedshift.jsonl`` ->
    ``fedshift.trials.jsonl``."""
    return results.with_name(results.name.removesuffix(".jsonl") + TRIALS_SUFFIX)


# ---------------------------------------------------------------------- the edge rule


def edge_side(value: Any, space: Any) -> Literal["low", "high"] | None:
    """Which edge of its search space ``value`` lies at, or None. A list: its smallest or
    largest number, when it has at least 2 (the rule of
    :func:`fedplug.study.tables.tuned_table`'s "(grid edge)"); a :class:`ParamRange`: within
    :data:`EDGE_SHARE` of either end on its scale. Anything else (a category, a bool) has
    no edge."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(space, list):
        numbers = [item for item in space if isinstance(item, (int, float)) and not isinstance(item, bool)]
        if len(numbers) < 2:
            return None
        return "low" if value == min(numbers) else "high" if value == max(numbers) else None
    if isinstance(space, ParamRange):
        scale = math.log if space.log and value > 0 else float
        low, high, at = scale(space.low), scale(space.high), scale(value)
        margin = EDGE_SHARE * (high - low)
        return "low" if at - low <= margin else "high" if high - at <= margin else None
    return None


def edges(values: Mapping[str, Any], space: Mapping[str, Any]) -> dict[str, bool]:
    """Path -> whether its value is at an edge of its space (:func:`edge_side`)."""
    return {path: edge_side(value, space.get(path)) is not None for path, value in values.items()}


def edge_message(label: str, values: Mapping[str, Any], space: Mapping[str, Any]) -> str | None:
    """One line naming each chosen value at an edge of its space, or None when none is:
    ``tune fedavg: chosen at the edge of the search space: train.optimizer.lr 1.0 (the high
    end of [0.05, 0.1, 1.0]); widen the space at that end and tune again``."""
    found = [f"{path} {value!r} (the {side} end of {describe_space(space[path])})" for path, value in values.items()
             if (side := edge_side(value, space.get(path))) is not None]
    if not found:
        return None
    return (f"tune {label}: chosen at the edge of the search space: {', '.join(found)}; widen the space at that end "
            "and tune again")


def describe_space(space: Any) -> str:
    """``[0.05, 0.1, 1.0]`` for a list, ``[0.01, 1.0] (log)`` for a range."""
    if isinstance(space, ParamRange):
        return f"[{space.low!r}, {space.high!r}]" + (" (log)" if space.log else "")
    return "[" + ", ".join(repr(item) for item in space) + "]"


def space_json(space: Mapping[str, Any]) -> dict[str, Any]:
    """A search space as JSON: lists as they are, ranges as ``{low, high, log, integer}``."""
    return {path: values.model_dump(mode="json") if isinstance(values, ParamRange) else list(values)
            for path, values in space.items()}


# ---------------------------------------------------------------------- one trial's line


@dataclass(frozen=True)
class SearchContext:
    """What every line of one search shares."""

    study: str
    search: str
    """The search's ``tuned.json`` key (:func:`fedplug.study.tuning.choice_key`)."""
    algorithm: str
    cell: dict[str, str]
    fingerprint: str
    """:func:`fedplug.study.tuning.search_fingerprint`: a resumed search takes only its own lines."""
    tune: TuneSpec
    """The search's ``tune:`` with its algorithm's space (:func:`fedplug.study.tuning.algorithm_space`)."""
    draws: list[int]
    """``data.seed`` of each draw a trial trains on."""
    code: dict[str, Any] = field(default_factory=dict)
    """``git_commit`` and ``git_dirty`` of the code that trains (the runner's); empty: unknown."""


@dataclass
class TrialOutcome:
    """What one trial produced so far: each draw's per-round validation metrics and score."""

    curves: dict[str, list[list[float | None]]] = field(default_factory=lambda: {name: [] for name in CURVES})
    draw_scores: list[float] = field(default_factory=list)

    def start_draw(self) -> None:
        for rounds in self.curves.values():
            rounds.append([])

    def add_round(self, metrics: Mapping[str, Any]) -> None:
        for name, rounds in self.curves.items():
            rounds[-1].append(finite_or_none(metrics.get(name)))


def trial_line(context: SearchContext, number: int, values: Mapping[str, Any], state: str, outcome: TrialOutcome, *,
               score: float | None = None, reason: str | None = None, config: Any = None, seconds: float = 0.0,
               finished_at: str | None = None) -> dict[str, Any]:
    """One line of the trials file: the search and trial, the values and whether each is
    at an edge, the ``state`` (``complete``, ``pruned`` or ``failed``) with its ``reason``,
    the ``score`` (the mean of ``draw_scores``, null unless complete or when not finite),
    each draw's per-round ``val_accuracy`` and ``val_loss`` (6 decimals), the trial's
    resolved ``config`` on its first draw (the others differ only in ``data.seed``) with its
    ``config_hash``, and the code version (``fedplug``, ``commit``, ``dirty``)."""
    tune = context.tune
    document = config.model_dump(mode="json") if config is not None else None
    return {
        "study": context.study,
        "search": context.search,
        "cell": dict(context.cell),
        "algorithm": context.algorithm,
        "trial": number,
        "state": state,
        "values": dict(values),
        "edge": edges(values, tune.params),
        "score": finite_or_none(score, digits=None),
        "draw_scores": [finite_or_none(value, digits=None) for value in outcome.draw_scores],
        "draws": list(context.draws),
        "metric": tune.metric,
        "select": tune.select,
        **({"window": tune.window} if tune.window is not None else {}),
        **{name: rounds for name, rounds in outcome.curves.items()
           if any(value is not None for draw in rounds for value in draw)},
        "reason": reason,
        "seconds": round(seconds, 2),
        "space": space_json(tune.params),
        "fingerprint": context.fingerprint,
        "config": document,
        "config_hash": config_hash(document) if document is not None else None,
        "fedplug": fedplug_version(),
        "commit": context.code.get("git_commit"),
        "dirty": context.code.get("git_dirty"),
        "finished_at": finished_at,
    }


def finite_or_none(value: Any, digits: int | None = 6) -> float | None:
    """``value`` as a float (rounded to ``digits``; None keeps every digit), or None when
    it is missing, not a number or not finite (JSON has no NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if digits is None else round(float(value), digits)


def fedplug_version() -> str | None:
    try:
        return metadata.version("fedplug")
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------- the file


def append_trial(path: Path, line: Mapping[str, Any]) -> None:
    """Append ``line`` to the trials file at ``path`` (created with its folder), and flush
    it to disk: a search killed later keeps it. A last line cut off by an earlier kill
    (no newline at the end) is dropped first, so the file stays one JSON object a line.

    Raises:
        OutputError: ``path`` is a symlink, FIFO, socket or device, or cannot be written
            (a full disk); not a failure of the trial: the search stops.
    """
    data = (json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n").encode()
    advice = "remove it (or move it away) and run the study again"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_regular_fd(path, os.O_RDWR | os.O_CREAT, what="tuning trials file", advice=advice,
                             error=OutputError, follow_symlinks=False)
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise OutputError(f"tuning trials file {str(path)!r} is a symlink, which fedplug does not follow "
                              f"here; {advice}") from None
        raise OutputError(f"cannot write the tuning trials file {str(path)!r}: {failure.strerror}") from None
    try:
        end = whole_lines_length(fd)
        os.ftruncate(fd, end)
        os.lseek(fd, end, os.SEEK_SET)
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.fsync(fd)
    except OSError as failure:
        raise OutputError(f"cannot append to the tuning trials file {str(path)!r}: {failure.strerror}; free space "
                          "on that disk and run the study again (its finished trials are kept)") from None
    finally:
        os.close(fd)


def whole_lines_length(fd: int, block: int = 1 << 16) -> int:
    """The length of the file at ``fd`` up to and including its last newline."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - block)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def load_trials(path: Path) -> list[dict[str, Any]]:
    """The lines of the trials file at ``path`` (none when it does not exist). A last line
    without a newline that is not JSON was cut off by a kill and is left out.

    Raises:
        DataError: another line is not a JSON object (the message names the file and
            line); a FIFO, socket or device lies at ``path``.
    """
    try:
        text = read_regular_bytes(path, what="tuning trials file", advice=RESTORE, error=DataError).decode()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    pieces = text.split("\n")
    cut = pieces.pop()  # "" when the file ends with a newline
    lines = []
    for number, piece in enumerate([*pieces, cut], 1):
        if not piece.strip():
            continue
        try:
            line = json.loads(piece)
        except json.JSONDecodeError as error:
            if number == len(pieces) + 1:
                continue  # the line a kill cut off
            raise DataError(f"{path}:{number}: not JSON ({error.msg}); {RESTORE}") from None
        if not isinstance(line, dict):
            raise DataError(f"{path}:{number}: a trial is a JSON object; {RESTORE}")
        lines.append(line)
    return lines


def restorable_lines(lines: Sequence[Mapping[str, Any]], search: str, fingerprint: str) -> list[Mapping[str, Any]]:
    """The lines of search ``search`` with ``fingerprint``, trial 0, 1, 2, ... up to the
    first number missing (the first line of a number counts): the trials an interrupted
    search finished, in the order it ran them."""
    by_number: dict[int, Mapping[str, Any]] = {}
    for line in lines:
        number = line.get("trial")
        if (line.get("search") == search and line.get("fingerprint") == fingerprint and isinstance(number, int)
                and not isinstance(number, bool) and line.get("state") in ("complete", "pruned", "failed")):
            by_number.setdefault(number, line)
    restored = []
    while len(restored) in by_number:
        restored.append(by_number[len(restored)])
    return restored


# ---------------------------------------------------------------------- back into Optuna


def distribution(space: Any) -> Any:
    """Optuna's distribution of one path's space, as :func:`fedplug.study.tuning.suggest`
    draws from it."""
    import optuna

    if isinstance(space, list):
        return optuna.distributions.CategoricalDistribution(space)
    if space.integer:
        return optuna.distributions.IntDistribution(int(space.low), int(space.high), log=space.log)
    return optuna.distributions.FloatDistribution(space.low, space.high, log=space.log)


def grid_attributes(tune: TuneSpec, number: int) -> dict[str, Any]:
    """The system attributes Optuna's GridSampler gives trial ``number`` of a fresh study
    (its ``search_space`` and, for the first grid points, ``grid_id = number``), so that a
    resumed grid search goes on with the points an uninterrupted one would try next."""
    if tune.sampler != "grid":
        return {}
    return {"search_space": {path: list(tune.params[path]) for path in sorted(tune.params)},  # type: ignore[arg-type]
            "grid_id": number}


def frozen_trial(line: Mapping[str, Any], tune: TuneSpec, rounds: int, failure_attr: str) -> Any:
    """A finished trial of the trials file as Optuna's ``FrozenTrial``: its values, its
    state, its score (complete), the round values the pruner compares (step ``k * rounds +
    round`` of draw k), and the failure reason (failed) under ``failure_attr``.

    Raises:
        DataError: the line's values do not fit the search space (the file was edited).
    """
    import optuna

    states = {"complete": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED,
              "failed": optuna.trial.TrialState.FAIL}
    worst = -math.inf if tune.metric == "val_accuracy" else math.inf
    intermediate = {}
    for index, draw in enumerate(line.get(tune.metric) or []):
        for round_number, value in enumerate(draw, 1):
            intermediate[index * rounds + round_number] = worst if value is None else float(value)
    state = states[str(line["state"])]
    score = line.get("score")
    try:
        return optuna.trial.create_trial(
            state=state,
            value=(worst if score is None else float(score)) if state == optuna.trial.TrialState.COMPLETE else None,
            params=dict(line["values"]),
            distributions={path: distribution(tune.params[path]) for path in line["values"]},
            user_attrs={failure_attr: line["reason"]} if line.get("reason") else {},
            system_attrs=grid_attributes(tune, int(line["trial"])),
            intermediate_values=intermediate,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(f"trial {line.get('trial')} of search {line.get('search')!r} in the trials file does not fit "
                        f"its search space ({error}); {RESTORE}") from None
