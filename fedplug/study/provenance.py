"""Which code trained a study's runs: each record's code version, and the grid cells whose
runs come from more than one of them (a comparison inside such a cell may measure a
change of the code instead of the algorithms)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fedplug.study.spec import cell_id

UNKNOWN_VERSION = "unknown"
"""The code version of a record without a commit (trained outside a git checkout)."""
SHOWN_RUNS = 10
"""How many run ids :func:`describe_mixed_commits` names per code version."""
SHORT_COMMIT = 10
"""Hex digits of a commit that :func:`describe_mixed_commits` shows."""


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
