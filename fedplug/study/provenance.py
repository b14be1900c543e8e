"""Which code trained a study's runs: each record's code version, and the grid cells whose
runs come from more than one of them (a comparison inside such a cell may measure a
change of the code instead of the algorithms)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fedplug.study.spec import cell_id

UNKNOWN_VERSION = "unknown"
"""The code version of a record without a commit (trained outside a git checkout)."""
SHOWN_RUNS = 10
"""How many run ids :func:`describe_mixed_commits` names per code version."""
SHORT_COMMIT = 10
"""Hex digits of a commit that :func:`describe_mixed_commits` shows."""
CLOCK_KEYS = ("started_at", "finished_at", "host_cores")
"""What a record keeps of the runner's clock: when its run started and finished (UTC,
ISO 8601) and the cores of the machine that trained it."""


def code_version(record: dict[str, Any]) -> str:
    """The code a record's run was trained with: its ``commit``, ``"<commit>+dirty"`` when
    the checkout had uncommitted changes (``dirty`` true: code no commit holds), or
    ``"unknown"`` without a commit."""
    commit = record.get("commit")
    if not commit:
        return UNKNOWN_VERSION
    return f"{commit}+dirty" if record.get("dirty") else str(commit)


def mixed_commit_cells(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """The grid cells whose records come from more than one :func:`code_version`: cell id
    (:func:`~fedplug.study.spec.cell_id`) -> code version -> the run ids trained with it,
    cells and versions in the order they first appear in ``records``, runs in record
    order. Empty when every cell is of one version."""
    cells: dict[str, dict[str, list[str]]] = {}
    for record in records:
        versions = cells.setdefault(cell_id(record["cell"]), {})
        versions.setdefault(code_version(record), []).append(str(record["run"]))
    return {cell: versions for cell, versions in cells.items() if len(versions) > 1}


def describe_mixed_commits(records: Iterable[dict[str, Any]], shown: int = SHOWN_RUNS) -> str | None:
    """One line naming each cell of :func:`mixed_commit_cells`, its code versions (commits
    cut to :data:`SHORT_COMMIT` digits) and which runs have each (the first ``shown``, then
    ``... and N more``); None when no cell mixes versions.

    For example ``cell 0.1 mixes 2 code versions: 1a2b3c4d5e (runs 0.1__fedavg__d0s0),
    9f8e7d6c5b+dirty (runs 0.1__fedprox__d0s0)``; cells are separated by ``"; "``.
    """
    mixed = mixed_commit_cells(records)
    if not mixed:
        return None
    parts = []
    for cell, versions in mixed.items():
        listed = ", ".join(f"{short_version(version)} ({runs_text(runs, shown)})" for version, runs in versions.items())
        parts.append(f"cell {cell} mixes {len(versions)} code versions: {listed}")
    return "; ".join(parts)


def short_version(version: str) -> str:
    """A :func:`code_version` with its commit cut to :data:`SHORT_COMMIT` hex digits."""
    commit, plus, dirty = version.partition("+")
    return commit if version == UNKNOWN_VERSION else commit[:SHORT_COMMIT] + plus + dirty


def runs_text(runs: list[str], shown: int = SHOWN_RUNS) -> str:
    """``"run a"`` or ``"runs a, b"``: the first ``shown`` ids, then ``"... and N more"``."""
    named = ", ".join(runs[:shown]) + (f", ... and {len(runs) - shown} more" if len(runs) > shown else "")
    return ("run " if len(runs) == 1 else "runs ") + named


@dataclass(frozen=True)
class WallTime:
    """How long a study's runs occupied the machine (:func:`wall_time`)."""

    seconds: float
    """The time at least one run was training: the length of the union of the runs'
    ``[started_at, finished_at]`` intervals."""
    most_at_once: int
    """The most runs that trained at the same moment."""
    cores: list[int]
    """The distinct ``host_cores`` of the machines that trained them, ascending."""
    timed: int
    """Records with both times."""
    untimed: int
    """Records without them (trained before the runner kept its clock)."""


def wall_time(records: Iterable[dict[str, Any]]) -> WallTime:
    """The wall time of a study from its records' clocks (:data:`CLOCK_KEYS`): overlapping
    runs (``--jobs``) count once, gaps between runner invocations not at all."""
    intervals, cores, untimed = [], set(), 0
    for record in records:
        if not record.get("started_at") or not record.get("finished_at"):
            untimed += 1
            continue
        start, end = (datetime.fromisoformat(record[key]).timestamp() for key in ("started_at", "finished_at"))
        intervals.append((start, max(start, end)))
        if record.get("host_cores"):
            cores.add(int(record["host_cores"]))
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in events:  # an end sorts before a start at the same second
        running += step
        most = max(most, running)
    return WallTime(total, most, sorted(cores), len(intervals), untimed)
