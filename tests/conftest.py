"""Shared fixtures: small, fast experiment configs on the synthetic dataset."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Telemetry off for everything a test starts (subprocesses inherit this).
for _name, _value in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}.items():
    os.environ.setdefault(_name, _value)

# One thread: two threads on two shared cores collapse when another process is busy.
torch.set_num_threads(1)

SMALL_EXPERIMENT: dict[str, Any] = {
    "study": {"name": "test", "target_accuracy": 0.5},
    # tracking.enabled defaults to True: without this, every Flower/FedML test run would
    # log into <cwd>/mlflow.db (the project's own store). Tracking tests switch it on.
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 600, "num_test": 200, "num_features": 12, "num_classes": 4},
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
        "num_clients": 6,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [16]},
        "client_fraction": 0.5,
        "rounds": 3,
        "local_epochs": 1,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.5},
        "seed": 0,
    },
}


@pytest.fixture
def small_experiment() -> dict[str, Any]:
    """A deep copy of a tiny synthetic experiment (6 clients, 3 rounds)."""
    return copy.deepcopy(SMALL_EXPERIMENT)


def in_process(call: Callable[[], int]) -> tuple[int, str]:
    """Exit code and stderr of ``call``, as the shell would see them."""
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            code = call()
        except Exception:  # noqa: BLE001 (what the interpreter would print)
            traceback.print_exc(file=stderr)
            code = 1
    return code, stderr.getvalue()
