"""MLflow tracking: URI resolution, failing fast on an unreachable server, the local
fallback, resuming an interrupted run without duplicates, and a round trip through a real
``mlflow server`` on loopback (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from fedplug.errors import ConfigError, DataError, TrackingError
from fedplug.simulation.results import RoundRecord
from fedplug.tracking import (
    MlflowTracker,
    check_server,
    choose_tracking_uri,
    local_tracking_uri,
    params_payload,
    resolve_tracking_uri,
    round_metrics,
)

REPO = Path(__file__).resolve().parents[1]
QUIET_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DO_NOT_TRACK": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


@pytest.fixture(autouse=True)
def _quiet_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def record(round_number: int, accuracy: float) -> RoundRecord:
    return RoundRecord(
        round=round_number,
        accuracy=accuracy,
        loss=1.0 / round_number,
        client_accuracy_mean=accuracy,
        client_accuracy_std=0.0,
        bytes_up=100,
        bytes_down=200,
        cumulative_bytes=300 * round_number,
        seconds=0.5,
        participants=2,
        failures=0,
        metrics={"cpd_median": float("nan"), "cpd_mean": float("nan")},
    )


# --------------------------------------------------------------------------- pure parts


def test_uri_precedence_is_config_then_environment_then_local_store(tmp_path: Path) -> None:
    local = f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert local_tracking_uri(tmp_path) == local
    assert resolve_tracking_uri(None, tmp_path, environ={}) == local
    assert (
        resolve_tracking_uri(None, tmp_path, environ={"MLFLOW_TRACKING_URI": "http://h:1"})
        == "http://h:1"
    )
    assert (
        resolve_tracking_uri("http://c:2", tmp_path, environ={"MLFLOW_TRACKING_URI": "http://h:1"})
        == "http://c:2"
    )
    assert resolve_tracking_uri(None, tmp_path, environ={"MLFLOW_TRACKING_URI": "  "}) == local


def test_round_metrics_skip_nan_and_keep_every_numeric_field() -> None:
    metrics = round_metrics(record(3, 0.75))
    assert metrics["accuracy"] == 0.75
    assert metrics["cumulative_bytes"] == 900.0
    assert metrics["failures"] == 0.0
    assert "round" not in metrics
    assert "cpd_median" not in metrics and "cpd_mean" not in metrics  # NaN: nothing to plot
    assert all(math.isfinite(value) for value in metrics.values())


def test_round_metrics_log_what_the_components_report_under_their_own_names() -> None:
    reported = record(2, 0.5)
    reported.metrics = {"cpd_median": 0.25, "cpd_mean": 0.5}
    metrics = round_metrics(reported)
    assert metrics["cpd_median"] == 0.25 and metrics["cpd_mean"] == 0.5
    assert "metrics" not in metrics


def test_params_payload_writes_lists_as_json_and_cuts_long_values() -> None:
    payload = params_payload(
        {"train.model.hidden": [200, 200], "tracking.uri": None, "x": "a" * 7000}
    )
    assert payload["train.model.hidden"] == "[200, 200]"
    assert payload["tracking.uri"] == "None"
    assert len(payload["x"]) == 6000


# ---------------------------------------------------------------------- unreachable


def test_refused_connection_raises_tracking_error_quickly() -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    with pytest.raises(TrackingError, match="does not answer.*fallback_to_local"):
        check_server(uri)
    assert time.perf_counter() - started < 3.5


def test_silent_server_times_out_with_tracking_error() -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.perf_counter()
        with pytest.raises(TrackingError, match="does not answer"):
            check_server(uri, timeout=0.5)
        elapsed = time.perf_counter() - started
    assert 0.4 < elapsed < 3.0


def test_fallback_to_local_chooses_the_local_store_and_says_why(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingError):
        choose_tracking_uri(uri, False, tmp_path)
    target = choose_tracking_uri(uri, True, tmp_path)
    assert target.uri == local_tracking_uri(tmp_path)
    assert target.requested_uri == uri
    assert target.fallback_reason is not None and uri in target.fallback_reason


def test_sqlite_store_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match="does not exist"):
        choose_tracking_uri(f"sqlite:///{tmp_path}/missing/m.db", False, tmp_path)


# ----------------------------------------------------------------- pipeline helpers


def load_stage(name: str) -> ModuleType:
    """Import ``pipelines/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"fedplug_stage_{name}", REPO / "pipelines" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_params(rounds: int = 3, tracking: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "study": {"name": "tracking-test", "seeds": [0], "target_accuracy": 0.5},
        "tracking": tracking or {"uri": None, "fallback_to_local": False},
        "data": {
            "dataset": {
                "name": "synthetic",
                "num_train": 400,
                "num_test": 100,
                "num_features": 6,
                "num_classes": 3,
                "class_separation": 3.0,
            },
            "partition": {"name": "iid"},
            "num_clients": 3,
            "local_test_fraction": 0.2,
            "seed": 0,
            "root": "data/raw",
        },
        "train": {
            "model": {"name": "logreg"},
            "loss_transform": {"name": "cross_entropy"},
            "device": "cpu",
            "rounds": rounds,
            "batch_size": 20,
            "optimizer": {"name": "sgd", "lr": 0.5},
        },
        "algorithms": {"fedavg": {}},
    }


def prepare_project(root: Path, params: dict[str, Any]) -> None:
    """params.yaml plus the download and partition stages' outputs, in-process."""
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    load_stage("download").main([])
    load_stage("partition").main([])


def rest(base: str, endpoint: str, **query: Any) -> dict[str, Any]:
    url = f"{base}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def rest_post(base: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


# --------------------------------------------------------------- train stage + MLflow


def test_train_stage_stops_before_loading_data_when_server_is_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No partition file exists: had the stage got past the tracking check, it would have
    # failed with a DataError about the missing partition instead.
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(tiny_params(tracking={"uri": uri, "fallback_to_local": False}))
    )
    train_stage = load_stage("train")
    with pytest.raises(TrackingError, match=uri.replace(".", r"\.")):
        train_stage.main(["--algorithm", "fedavg", "--seed", "0"])
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", uri
    )  # the environment variable is checked the same way
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params()))
    started = time.perf_counter()  # imports are warm now: this is the check itself
    with pytest.raises(TrackingError):
        train_stage.main(["--algorithm", "fedavg", "--seed", "0"])
    assert time.perf_counter() - started < 3
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        train_stage.main(["--algorithm", "nope", "--seed", "0"])


@pytest.mark.slow
def test_fallback_to_local_trains_and_logs_to_the_local_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    unreachable = f"http://127.0.0.1:{free_port()}"
    prepare_project(
        tmp_path, tiny_params(rounds=2, tracking={"uri": unreachable, "fallback_to_local": True})
    )
    assert load_stage("train").main(["--algorithm", "fedavg", "--seed", "0"]) == 0
    assert "logging to the local store" in capsys.readouterr().err
    client = MlflowClient(local_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("tracking-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["fedplug.tracking_fallback_from"] == unreachable
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "accuracy")] == [
        1,
        2,
    ]
    metrics = json.loads((tmp_path / "runs/fedavg/seed-0/metrics.json").read_text())
    assert run.data.metrics["final_accuracy"] == pytest.approx(metrics["final_accuracy"])


class Killed(BaseException):
    """Stands in for the stage being killed in the middle of a run."""


@pytest.mark.slow
def test_killed_train_stage_resumes_its_checkpoint_and_its_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    prepare_project(tmp_path, tiny_params(rounds=4))
    out = tmp_path / "runs/fedavg/seed-0"
    original = MlflowTracker.log_round

    def dies_at_round_three(self: MlflowTracker, round_record: RoundRecord) -> None:
        # The simulator checkpoints a round before observers see it, so round 3 is in
        # the checkpoint but never reaches MLflow: the worst moment to be killed.
        if round_record.round == 3:
            raise Killed()
        original(self, round_record)

    monkeypatch.setattr(MlflowTracker, "log_round", dies_at_round_three)
    with pytest.raises(Killed):
        load_stage("train").main(["--algorithm", "fedavg", "--seed", "0"])
    assert (out / "checkpoint.pt").is_file() and (out / "mlflow_run.json").is_file()
    first_run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(local_tracking_uri(tmp_path))
    assert [m.step for m in client.get_metric_history(first_run_id, "accuracy")] == [1, 2]
    assert client.get_run(first_run_id).info.status == "FAILED"

    monkeypatch.setattr(MlflowTracker, "log_round", original)
    assert load_stage("train").main(["--algorithm", "fedavg", "--seed", "0"]) == 0

    experiment = client.get_experiment_by_name("tracking-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [first_run_id]  # continued, not duplicated
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(first_run_id, "accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # round 3 came from the checkpoint
    metrics = json.loads((out / "metrics.json").read_text())
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [round_record["accuracy"] for round_record in metrics["history"]]
    )
    assert not (out / "checkpoint.pt").exists() and not (out / "mlflow_run.json").exists()


@pytest.mark.slow
def test_tracker_reopens_only_a_run_of_the_same_fingerprint(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = local_tracking_uri(tmp_path)
    state = tmp_path / "run" / "mlflow_run.json"
    first = MlflowTracker.open(uri, "study", "a-seed0", state_path=state, fingerprint="f1")
    first.log_history([record(1, 0.5), record(2, 0.6)])
    again = MlflowTracker.open(uri, "study", "a-seed0", state_path=state, fingerprint="f1")
    assert (again.run_id, again.resumed, again.logged_rounds) == (first.run_id, True, {1, 2})
    again.log_history([record(1, 0.5), record(2, 0.6), record(3, 0.7)])
    client = MlflowClient(uri)
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "accuracy")) == [1, 2, 3]

    other = MlflowTracker.open(uri, "study", "a-seed0", state_path=state, fingerprint="f2")
    assert other.run_id != first.run_id and not other.resumed
    assert client.get_run(first.run_id).info.status == "KILLED"
    other.finish()
    assert not state.exists()
    assert client.get_run(other.run_id).info.status == "FINISHED"


def test_missing_density_weights_stop_a_feddisk_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = tiny_params(rounds=1)
    params["algorithms"] = {"feddisk": {"loss_transform": {"name": "feddisk", "made_hidden": 4}}}
    prepare_project(tmp_path, params)
    with pytest.raises(DataError, match="pretrain_density"):
        load_stage("train").main(["--algorithm", "feddisk", "--seed", "0"])
    assert not (tmp_path / "data/density").exists()  # nothing written into the stage's output


# ------------------------------------------------------------------ real server


@pytest.fixture()
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **QUIET_ENV}
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{tmp_path}/m.db",
        "--artifacts-destination",
        str(tmp_path / "artifacts"),
        "--workers",
        "1",
    ]
    # Its own process group: `mlflow server` starts uvicorn/gunicorn workers, and stopping
    # the group by our child's PID stops exactly what this test started.
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                check_server(base, timeout=1)
                break
            except TrackingError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "mlflow server did not start:\n"
                        + (tmp_path / "server.log").read_text()[-3000:]
                    ) from None
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


@pytest.mark.slow
def test_round_trip_through_an_mlflow_server(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    prepare_project(project, tiny_params(rounds=3))
    assert load_stage("train").main(["--algorithm", "fedavg", "--seed", "0"]) == 0

    experiment = rest(mlflow_server, "experiments/get-by-name", experiment_name="tracking-test")[
        "experiment"
    ]
    runs = rest_post(
        mlflow_server, "runs/search", {"experiment_ids": [experiment["experiment_id"]]}
    )["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert run["info"]["run_name"] == "fedavg-seed0" and run["info"]["status"] == "FINISHED"
    tags = {tag["key"]: tag["value"] for tag in run["data"]["tags"]}
    assert {
        key: tags[key]
        for key in ("dataset", "partition", "sampler", "loss_transform", "aggregator", "grouper")
    } == {
        "dataset": "synthetic",
        "partition": "iid",
        "sampler": "uniform",
        "loss_transform": "cross_entropy",
        "aggregator": "fedavg",
        "grouper": "none",
    }
    params = {param["key"]: param["value"] for param in run["data"]["params"]}
    assert params["train.rounds"] == "3" and params["data.num_clients"] == "3"
    assert params["train.optimizer.lr"] == "0.5" and "derived.model_bytes" in params
    run_id = run["info"]["run_id"]
    metrics = json.loads((project / "runs/fedavg/seed-0/metrics.json").read_text())
    for key in ("accuracy", "loss", "cumulative_bytes", "client_accuracy_mean"):
        history = rest(mlflow_server, "metrics/get-history", run_id=run_id, metric_key=key)[
            "metrics"
        ]
        assert sorted(point["step"] for point in history) == [1, 2, 3], key
        by_step = {point["step"]: point["value"] for point in history}
        assert [by_step[step] for step in (1, 2, 3)] == pytest.approx(
            [round_record[key] for round_record in metrics["history"]]
        ), key
    listed = rest(mlflow_server, "artifacts/list", run_id=run_id)
    assert {item["path"] for item in listed["files"]} >= {
        "config.yaml",
        "curves",
        "model",
        "partition",
        "metrics.json",
    }
    model_files = rest(mlflow_server, "artifacts/list", run_id=run_id, path="model")["files"]
    assert [item["path"] for item in model_files] == ["model/model.pt"]
