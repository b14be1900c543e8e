"""What "the same run" means across runtimes, for every conformance suite (the simulator,
Flower on its loopback grid and under ``flwr run``, the FedML coordinator and the FedML
drop-in aggregator): the whole result summary (``metrics.json``) but the wall times.

Accuracy and loss, and the summary entries computed from them, may differ by
:data:`METRIC_TOLERANCE` (the runtimes sum the same numbers in another order); every other
entry, each round's included, must be equal; the derived params apart from the entries
that name the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedplug.run.results import split_wall_clock

METRIC_TOLERANCE = 1e-5
APPROXIMATE_FIELDS = {"accuracy", "loss", "client_accuracy_mean", "client_accuracy_std"}
"""Round entries computed from the evaluation's sums."""
SUMMARY_APPROXIMATE = {"final_accuracy", "best_accuracy", "final_loss"}
"""Entries of a result summary computed from the rounds' accuracy and loss."""
RUNTIME_ENTRIES = {"engine", "fedml_rounds", "fedml_workers"}
"""Derived params that name the runtime rather than the experiment."""


def close(mine: float | None, theirs: float | None) -> bool:
    """Within METRIC_TOLERANCE; ``None`` is how a record writes NaN."""
    if mine is None or theirs is None:
        return mine is theirs
    return math.isclose(mine, theirs, rel_tol=0.0, abs_tol=METRIC_TOLERANCE)


def without_runtime(derived: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in derived.items() if key not in RUNTIME_ENTRIES}


def assert_same_summary(
    mine: Mapping[str, Any], theirs: Mapping[str, Any], known_differences: frozenset[str] = frozenset()
) -> None:
    """Two :meth:`~fedplug.run.results.RunResult.summary` dicts (or two ``metrics.json``)
    describe the same run; ``known_differences`` (top-level keys, default none) are left
    to the caller, who says why they differ and checks them itself."""
    mine, my_beside = split_wall_clock({key: value for key, value in mine.items() if key not in known_differences})
    theirs, their_beside = split_wall_clock({key: value for key, value in theirs.items() if key not in known_differences})
    # Which clients (and chains) trained each round: kept beside the hashed fields, equal on every runtime.
    for key in ("round_clients", "round_chains"):
        assert my_beside.get(key) == their_beside.get(key), (key, my_beside.get(key), their_beside.get(key))
    assert mine.keys() == theirs.keys()
    assert len(mine["history"]) == len(theirs["history"])
    for my_round, their_round in zip(mine["history"], theirs["history"]):
        assert my_round.keys() == their_round.keys(), their_round["round"]
        for key in their_round:
            same = close if key in APPROXIMATE_FIELDS else _equal
            assert same(my_round[key], their_round[key]), (their_round["round"], key, my_round[key], their_round[key])
    for key in theirs.keys() - {"history", "derived"}:
        same = close if key in SUMMARY_APPROXIMATE else _equal
        assert same(mine[key], theirs[key]), (key, mine[key], theirs[key])
    assert without_runtime(mine["derived"]) == without_runtime(theirs["derived"])


def _equal(mine: Any, theirs: Any) -> bool:
    return mine == theirs


def assert_same_state(ours: Any, theirs: Any, where: str) -> None:
    """Equal nested states: tensors within 1e-5, every other value equal."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=where)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            assert_same_state(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same_state(mine, other, f"{where}[{index}]")
    else:
        assert ours == theirs, where
