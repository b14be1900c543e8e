"""A tracking server that dies mid-run never stops training (issue #29, finding 8; build
item 6).

Before: training blocked 493 s in MLflow's HTTP retries, then stopped with exit 2. Now an
unreachable server costs a bounded wait, one warning, and the metrics are kept and sent
when it answers again, or when the same command runs again (the same MLflow run, every
round); ``tracking.on_error: stop`` ends the run with one line and the checkpoint kept.

The end-to-end tests start a real ``mlflow server`` on 127.0.0.1 and kill it by its PID
(process group) just before a round is logged; :class:`Outbox` is tested on its own for
the recovery inside a run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import SMALL_EXPERIMENT
from mlflow_server import QUIET_ENV, START_SECONDS, _healthy, free_port, server_command

from fedplug.errors import TrackingError
from fedplug.tracking import outage
from fedplug.tracking.mlflow_tracker import MlflowTracker

ROUNDS = 5
KILLED_BEFORE_ROUND = 3
OUTAGE_WARNING = "training goes on"


class MlflowServer:
    """``mlflow server`` on one loopback port with its store in ``folder``: started,
    killed by its PID and started again on the same port and store."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = server_command(self.port, self.folder)
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_ENV}, start_new_session=True
            )
        deadline = time.monotonic() + START_SECONDS
        while not _healthy(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mlflow server did not start:\n" + (self.folder / "server.log").read_text()[-3000:])
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL, as a crashed or unplugged server: nothing is answered any more."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
        self.process = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    running = MlflowServer(folder)
    running.start()
    try:
        yield running
    finally:
        running.kill()


def params(tmp_path: Path, uri: str, on_error: str | None = None) -> None:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = 4
    data["train"].update({"rounds": ROUNDS, "client_fraction": 0.5})
    data["tracking"] = {"enabled": True, "uri": uri, **({"on_error": on_error} if on_error else {})}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))


def kill_before_round(monkeypatch: pytest.MonkeyPatch, server: MlflowServer, round_number: int) -> None:
    """The server dies just before ``round_number``'s metrics are sent."""
    original = MlflowTracker.log_round

    def log_round(self: MlflowTracker, record: Any) -> None:
        if record.round == round_number:
            server.kill()
        original(self, record)

    monkeypatch.setattr(MlflowTracker, "log_round", log_round)


def fedplug_run(tmp_path: Path) -> tuple[int, str, float]:
    """``fedplug run params.yaml --out out --quiet`` in-process: exit code, stderr, seconds."""
    from fedplug.cli import main

    stderr, stdout = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            code = main(["run", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
        except Exception:  # noqa: BLE001 (what the interpreter would print)
            traceback.print_exc(file=stderr)
            code = 1
    return code, stderr.getvalue(), time.perf_counter() - started


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and OUTAGE_WARNING in r.getMessage()]


# ---------------------------------------------------------------------- end to end


def test_a_server_that_dies_mid_run_costs_a_bounded_wait_and_loses_nothing(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    params(tmp_path, server.url)
    kill_before_round(monkeypatch, server, KILLED_BEFORE_ROUND)

    with caplog.at_level(logging.WARNING):
        code, stderr, seconds = fedplug_run(tmp_path)

    # Training finished, within a bounded wait (it used to block 493 s, then exit 2).
    assert code == 0, stderr
    assert seconds < 60, f"blocked {seconds:.0f} s on the dead server"
    assert (tmp_path / "out" / "metrics.json").is_file()
    warnings = outage_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert server.url in warnings[0] and "\n" not in warnings[0]
    assert not [r for r in caplog.records if r.name.startswith("urllib3")]  # no line per retry
    assert (tmp_path / "out" / "mlflow_run.json").is_file()  # what the next run continues

    # The server comes back on the same store; the same command sends what it lacks.
    monkeypatch.undo()
    server.start()
    code, stderr, _ = fedplug_run(tmp_path)

    assert code == 0, stderr
    client = MlflowClient(tracking_uri=server.url)
    # `fedplug run` logs to <study.name>-fedplug-run (fedplug.tracking.naming).
    (experiment,) = [e for e in client.search_experiments() if e.name == "test-fedplug-run"]
    (run,) = client.search_runs([experiment.experiment_id])
    steps = sorted(int(metric.step) for metric in client.get_metric_history(run.info.run_id, "accuracy"))
    assert steps == list(range(1, ROUNDS + 1))
    assert "final_accuracy" in run.data.metrics and run.info.status == "FINISHED"
    assert {item.path for item in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "metrics.json"}
    # Everything sent: the folder remembers the run as finished (the same command logs no more).
    assert json.loads((tmp_path / "out" / "mlflow_run.json").read_text())["finished"] is True


def test_on_error_stop_ends_the_run_with_one_line_and_keeps_the_checkpoint(
    tmp_path: Path, server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedplug.run.checkpoint import read_checkpoint

    params(tmp_path, server.url, on_error="stop")
    kill_before_round(monkeypatch, server, KILLED_BEFORE_ROUND)

    code, stderr, seconds = fedplug_run(tmp_path)

    assert code == 2, stderr
    assert seconds < 60, f"blocked {seconds:.0f} s on the dead server"
    errors = [line for line in stderr.splitlines() if line.startswith("fedplug: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert "tracking.on_error is 'stop'" in errors[0] and "the checkpoint is kept" in errors[0]
    history = read_checkpoint(tmp_path / "out" / "checkpoint.pt")["history"]
    assert len(history) == KILLED_BEFORE_ROUND  # the round was saved before it was logged
    assert (tmp_path / "out" / "mlflow_run.json").is_file()
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_on_error_is_a_config_key_with_continue_as_default() -> None:
    from fedplug.config import TrackingConfig, validate_experiment
    from fedplug.errors import ConfigError

    assert TrackingConfig().on_error == "continue"
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["tracking"]["on_error"] = "retry"
    with pytest.raises(ConfigError) as refused:
        validate_experiment(data)
    assert "tracking.on_error" in str(refused.value)


# ---------------------------------------------------------------------- the outbox


class FlakyStore:
    """A tracking call that fails like an unreachable server while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.received: list[str] = []
        self.environment: list[str | None] = []

    def call(self, name: str) -> str:
        self.environment.append(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES"))
        if self.down:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        self.received.append(name)
        return name


def test_the_outbox_keeps_calls_in_order_and_sends_them_when_the_store_answers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setattr(outage, "PROBE_SECONDS", 0.0)
    store = FlakyStore()
    box = outage.Outbox("sqlite:///unused.db", "run-1")

    with caplog.at_level(logging.WARNING, logger="fedplug.tracking"):
        assert box.send("log round 1", store.call, "round 1") == "round 1"
        store.down = True
        assert box.send("log round 2", store.call, "round 2") is None
        assert box.send("log round 3", store.call, "round 3") is None
        store.down = False
        assert box.send("log round 4", store.call, "round 4") == "round 4"

    assert store.received == ["round 1", "round 2", "round 3", "round 4"]
    assert not box.pending and box.close()
    assert len(outage_warnings(caplog)) == 1
    # MLflow's retries bounded during each call only, not left in the environment.
    assert set(store.environment) == {str(outage.HTTP_MAX_RETRIES)}
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


def test_the_outbox_waits_between_probes_and_says_what_is_unsent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlakyStore()
    store.down = True
    box = outage.Outbox("sqlite:///unused.db", "run-1")

    with caplog.at_level(logging.WARNING, logger="fedplug.tracking"):
        for round_number in range(1, 6):
            box.send(f"log round {round_number}", store.call, f"round {round_number}")
        assert not box.close()

    assert len(store.environment) == 2  # the failed call, and close()'s one last try
    assert len(box.pending) == 5
    unsent = [r.getMessage() for r in caplog.records if "still does not answer" in r.getMessage()]
    assert len(unsent) == 1 and "5 tracking calls" in unsent[0] and "run the same command again" in unsent[0]


def test_a_user_s_own_retry_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    store = FlakyStore()

    outage.Outbox("sqlite:///unused.db", "run-1").send("log", store.call, "x")

    assert store.environment == ["5"] and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"


def test_a_refusal_is_not_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers "invalid value" would answer the same later: one line now."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    def refuse() -> None:
        raise MlflowException("Param value too long", error_code=INVALID_PARAMETER_VALUE)

    with pytest.raises(TrackingError) as refused:
        outage.Outbox("sqlite:///unused.db", "run-1").send("log params", refuse)

    assert str(refused.value) == "MLflow could not log params for run run-1: Param value too long"


def test_on_error_stop_raises_one_line_at_the_first_failure() -> None:
    store = FlakyStore()
    store.down = True
    box = outage.Outbox("http://127.0.0.1:9", "run-1", on_error="stop")

    with pytest.raises(TrackingError) as stopped:
        box.send("log round metrics", store.call, "round 1")

    text = str(stopped.value)
    assert "\n" not in text and "(connection refused)" in text and "tracking.on_error is 'stop'" in text
    assert not box.pending
