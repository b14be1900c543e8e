"""A tuning search survives trials the data or config refuse (issue 44, finding 10; build
item 8).

Before: a ``tune:`` range that passes config validation but not the data
(``data.num_clients`` above the dataset's 600 training samples) raised ``DataError`` in
its trial, which stopped the whole study with an Optuna traceback (only ``TrainingError``
was caught). Now such a trial is Optuna's ``TrialState.FAIL`` with its reason kept (user
attribute, MLflow tags), one line says so, and the search goes on; only a search whose
every trial fails stops, in one line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from test_study_tuning import FINGERPRINT, spec_dict

from fedplug.errors import TrainingError
from fedplug.study import tuning
from fedplug.study.expansion import expand_study
from fedplug.study.spec import parse_study
from fedplug.study.tuning import TUNED_NAME, apply_tuning

TOO_MANY = "data.num_clients is {} but dataset 'synthetic' has only 600 training samples"
"""The DataError the federation raises for more clients than the synthetic set's samples."""


class OptunaLog(logging.Handler):
    """What Optuna logs (its logger does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage() + (" [with a traceback]" if record.exc_info else ""))


@pytest.fixture
def optuna_log() -> Iterator[OptunaLog]:
    handler = OptunaLog()
    root = logging.getLogger("optuna")
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every Optuna study :func:`fedplug.study.tuning.search` returns, in order."""
    studies: list[Any] = []
    search = tuning.search

    def recording(*args: Any, **kwargs: Any) -> Any:
        studies.append(search(*args, **kwargs))
        return studies[-1]

    monkeypatch.setattr(tuning, "search", recording)
    return studies


def tune_clients(tmp_path: Path, clients: list[int], **apply: Any) -> list[Any]:
    spec = parse_study(spec_dict({"sampler": "grid", "params": {"data.num_clients": clients}, "seed": 0}))
    return apply_tuning(spec, expand_study(spec), tmp_path / "out", None, fingerprint=FINGERPRINT,
                        **{"mlflow_root": None, **apply})


def test_trials_the_data_refuses_fail_with_their_reason_and_a_good_trial_is_chosen(
    tmp_path: Path, searches: list[Any], optuna_log: OptunaLog, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tune_clients(tmp_path, [1000, 4, 2000])

    # The search finished and chose the only value the data takes.
    chosen = json.loads((tmp_path / "out" / TUNED_NAME).read_text())["fedavg"]
    assert chosen["params"] == {"data.num_clients": 4} and chosen["trials"] == 3
    assert all(run.tuned == {"data.num_clients": 4} for run in runs)
    # The bad trials are Optuna's failed trials, each with the DataError's text.
    (study,) = searches
    failed = {trial.params["data.num_clients"]: trial.user_attrs[tuning.FAILURE_ATTR]
              for trial in study.trials if trial.state == optuna.trial.TrialState.FAIL}
    assert set(failed) == {1000, 2000}
    for clients, reason in failed.items():
        assert reason.startswith(TOO_MANY.format(clients)) and "\n" not in reason
    # One line each, and no Optuna traceback beside it.
    out = capsys.readouterr().out
    for clients in (1000, 2000):
        (line,) = [line for line in out.splitlines() if f"{{'data.num_clients': {clients}}} failed:" in line]
        assert TOO_MANY.format(clients) in line
    assert "2 failed" in out
    assert not [line for line in optuna_log.lines if "failed" in line], optuna_log.lines


def test_a_search_whose_every_trial_fails_stops_with_one_line(
    tmp_path: Path, optuna_log: OptunaLog
) -> None:
    with pytest.raises(TrainingError) as stopped:
        tune_clients(tmp_path, [1000, 2000])

    message = str(stopped.value)
    assert "\n" not in message and message.startswith("tune fedavg: all 2 trials failed")
    assert TOO_MANY.format(1000) in message or TOO_MANY.format(2000) in message
    assert not (tmp_path / "out" / TUNED_NAME).exists()
    assert not [line for line in optuna_log.lines if "failed" in line], optuna_log.lines


def test_a_failed_trial_s_mlflow_run_is_failed_and_tagged_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    tune_clients(tmp_path, [1000, 4], mlflow_root=tmp_path)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("study-tiny")
    trials = {run.data.params["data.num_clients"]: run for run in client.search_runs([experiment.experiment_id])
              if "mlflow.parentRunId" in run.data.tags}
    assert set(trials) == {"1000", "4"}
    bad, good = trials["1000"], trials["4"]
    assert bad.info.status == "FAILED" and bad.data.tags["tune.state"] == "failed"
    assert bad.data.tags["tune.error"].startswith(TOO_MANY.format(1000))
    assert good.info.status == "FINISHED" and good.data.tags["tune.state"] == "complete"
