"""torch's threads are chosen by fedplug (``--threads``, ``train.threads``,
``$FEDPLUG_TORCH_THREADS``, else 1), never inherited from torch's default of one per core
(issue 41: 30-40x slower on a shared 2-core machine)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from fedplug.cli import main
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.run_folder import output_fingerprint

EXPERIMENT: dict[str, Any] = {
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 600, "num_test": 200, "num_features": 12, "num_classes": 4},
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
        "num_clients": 6,
    },
    "train": {"model": {"name": "mlp", "hidden": [16]}, "rounds": 3, "batch_size": 16},
}
FINGERPRINT_BEFORE_THREADS = "c9ad780632b66d779627eb79d5de9b5476f940da4bcee57bc41fd1e29caaae76"
"""``output_fingerprint`` of :data:`EXPERIMENT` computed by fedplug before ``train.threads``
existed (commit 0e2dd2e: ``validate_experiment(EXPERIMENT)`` then
``fedplug.run_folder.output_fingerprint``, with ``FEDPLUG_DISABLE_PLUGIN_AUTOLOAD=1``)."""


@pytest.fixture
def fresh_threads(monkeypatch: pytest.MonkeyPatch) -> Any:
    """:mod:`fedplug.threads` as in a new process (nothing announced, no cores granted),
    four usable cores, no ``$FEDPLUG_TORCH_THREADS``; torch's threads restored afterwards."""
    import fedplug.threads as threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_state", {**threads._state, "granted_cores": None, "announced": None, "chosen": None})
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv(threads.THREADS_VARIABLE, raising=False)
    yield threads
    torch.set_num_threads(before)


def test_an_explicit_setting_wins_then_the_variable_then_one(fresh_threads: Any) -> None:
    decide = fresh_threads.decide_threads

    assert decide(3, environ={"FEDPLUG_TORCH_THREADS": "2"}, cores=4).threads == 3
    assert decide(None, environ={"FEDPLUG_TORCH_THREADS": "2"}, cores=4) == fresh_threads.ThreadChoice(
        2, "FEDPLUG_TORCH_THREADS"
    )
    assert decide(None, environ={}, cores=64) == fresh_threads.ThreadChoice(1, "default")
    assert decide(0, environ={}, cores=4).threads is None  # torch's own default, left alone


def test_threads_never_exceed_the_cores_shared_among_workers(fresh_threads: Any) -> None:
    decide = fresh_threads.decide_threads

    assert decide(8, environ={}, cores=4) == fresh_threads.ThreadChoice(4, "train.threads", asked=8)
    assert decide(4, workers=2, environ={}, cores=4).threads == 2
    assert decide(4, workers=8, environ={}, cores=4).threads == 1  # never 0
    parallel = SimpleNamespace(engine="parallel", workers=2, threads=4)
    assert fresh_threads.choose_run_threads(parallel, announce=False) == 2
    fresh_threads.limit_cores(1)  # a Ray task given one CPU of the node
    assert fresh_threads.choose_run_threads(SimpleNamespace(engine="auto", threads=4), announce=False) == 1


def test_a_bad_variable_is_one_line_naming_it(fresh_threads: Any) -> None:
    with pytest.raises(ConfigError, match="FEDPLUG_TORCH_THREADS='two': expected a whole number"):
        fresh_threads.decide_threads(None, environ={"FEDPLUG_TORCH_THREADS": "two"})


def test_the_choice_is_applied_and_said_once(fresh_threads: Any, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(3)

    assert fresh_threads.choose_threads(None) == 1
    assert fresh_threads.choose_threads(None) == 1
    assert torch.get_num_threads() == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "fedplug: torch uses 1 thread (default; set --threads N to change)"
    ]
    assert fresh_threads.choose_threads(2, source="--threads") == 2
    assert capsys.readouterr().err == "fedplug: torch uses 2 threads (--threads; set --threads N to change)\n"


@pytest.fixture
def nothing_said_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if no run had said its threads yet (the line is said once per process)."""
    import importlib

    try:
        threads = importlib.import_module("fedplug.threads")
    except ImportError:  # fedplug before threads were chosen
        return
    monkeypatch.setattr(threads, "_state", {**threads._state, "announced": None, "chosen": None})


def write_config(folder: Path, **train: Any) -> Path:
    experiment = copy.deepcopy(EXPERIMENT)
    experiment["train"].update(train)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path


def run_threads(folder: Path, *arguments: str) -> int:
    """torch's threads during a ``fedplug run`` (as its ``run_info.json`` records them)."""
    out = folder / "run"
    assert main(["run", str(folder / "config.yaml"), "--set", "train.rounds=1", "--out", str(out), "--quiet",
                 *arguments]) == 0
    return json.loads((out / "run_info.json").read_text())["torch_threads"]


def test_fedplug_run_uses_one_thread_whatever_torch_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], nothing_said_yet: None
) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("FEDPLUG_TORCH_THREADS", raising=False)
    write_config(tmp_path)
    torch.set_num_threads(3)  # torch's default on a 3-core machine
    try:
        assert run_threads(tmp_path) == 1
    finally:
        torch.set_num_threads(before)
    assert "torch uses 1 thread" in capsys.readouterr().err


def test_threads_and_train_threads_reach_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], nothing_said_yet: None
) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("FEDPLUG_TORCH_THREADS", raising=False)
    from_config, from_option = tmp_path / "config", tmp_path / "option"
    from_config.mkdir()
    from_option.mkdir()
    write_config(from_config, threads=3)
    write_config(from_option)
    try:
        assert run_threads(from_config) == 3
        assert run_threads(from_option, "--threads", "2") == 2
    finally:
        torch.set_num_threads(before)
    assert "torch uses 2 threads (--threads;" in capsys.readouterr().err


def test_threads_leave_the_fingerprint_of_earlier_configs_alone() -> None:
    """At its default ``train.threads`` is left out of the resolved config, so earlier run
    folders, checkpoints and study hashes still match; set, it is part of the config."""
    config = validate_experiment(copy.deepcopy(EXPERIMENT))
    assert output_fingerprint(config) == FINGERPRINT_BEFORE_THREADS
    assert "threads" not in config.train.model_dump(mode="json")

    pinned = copy.deepcopy(EXPERIMENT)
    pinned["train"]["threads"] = 2
    assert validate_experiment(pinned).train.model_dump(mode="json")["threads"] == 2
