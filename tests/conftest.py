"""Shared fixtures: small, fast experiment configs on the synthetic dataset. Hooks that keep
``make test`` (two pytest-xdist workers) short: the slowest files first, and the garbage
collector's work bounded (``gc.freeze`` at each file)."""

from __future__ import annotations

import contextlib
import copy
import gc
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


SLOW_FILES_FIRST = (
    "test_readme_commands.py",  # README's real-MNIST runs: a fifth of the suite's time
    "test_pipeline.py",  # `dvc repro` of the pipeline, then of edits to it: a sixth
    "test_flower_quickstart.py",  # eight `flwr run`s of the quickstart app: about 3.5 min
    "test_dvc_queue.py",  # two queued experiments on two DVC queue workers: about 3 min
    "test_tracking.py",
    "test_flower_deployment.py",
    "test_tracking_outage.py",
    "test_resume.py",
    "test_flower_dropin_client.py",
    "test_tracking_runtimes.py",
    "test_flower_dropin_server.py",
    "test_doc_snippets.py",
    "test_reply_metrics.py",
    "test_flower_hostile_replies.py",
    "test_mlflow_ui.py",
    "test_flower_simulation.py",
    "test_timeouts_flower.py",
)
"""The files that take longest (``--durations``), longest first: ``make test``'s workers
take whole files in collection order, so these start early and the last files to run are
short ones. A stale list costs only time."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``), collect SLOW_FILES_FIRST before the other files;
    a test's place within its file stays as it is. A plain ``pytest`` keeps the usual order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


_FROZEN_AT: dict[str, Any] = {"file": None}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each test file's first test: ``gc.collect()``, then ``gc.freeze()`` what is alive
    (the suite's modules, collected tests, earlier files' caches), so that later full
    collections skip it. Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)``, which
    its strategies call on every reply, runs ``gc.collect()``: in a process holding the
    whole suite, each took about 0.15 s (tests/test_flower_fuzz.py: 16 s of its 18). Frozen
    objects are still freed when their last reference goes; only a cycle among them would
    stay, which the collect before each freeze keeps to what outlives a file."""
    if item.path != _FROZEN_AT["file"]:
        _FROZEN_AT["file"] = item.path
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Unfreeze before the summary: Hypothesis's plugin may import Hypothesis there, whose
    ``register_random`` looks for referrers with ``gc.get_referrers``, which does not see
    frozen objects (a spurious warning about trio's PRNG)."""
    gc.unfreeze()


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
