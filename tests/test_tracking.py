"""MLflow tracking: URI resolution, failing fast on an unreachable server, the local
fallback, resuming an interrupted run without duplicates, and a round trip through a real
``mlflow server`` on loopback (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from mlflow_server import QUIET_ENV, free_port, mlflow_server  # noqa: F401  (mlflow_server: a fixture)

from fedplug.errors import ConfigError, DataError, TrackingError
from fedplug.run.results import RoundRecord
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
CLI_EXPERIMENT = "tracking-test-fedplug-run"
"""Where ``fedplug run`` logs the runs of study ``tracking-test`` (fedplug.tracking.naming)."""


@pytest.fixture(autouse=True)
def _quiet_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


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
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`fedplug.algorithm` = 'fedavg'")  # the child, not the parent
    assert run.data.tags["fedplug.tracking_fallback_from"] == unreachable
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "accuracy")] == [
        1,
        2,
    ]
    metrics = json.loads((tmp_path / "reports/runs/fedavg/seed-0/metrics.json").read_text())
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
    out = tmp_path / "reports/runs/fedavg/seed-0"
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
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`fedplug.algorithm` = 'fedavg'")
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


@pytest.mark.slow
def test_a_finished_run_its_folder_keeps_is_reopened_complete_and_logged_no_more(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    # Prepare: a run opened as `fedplug run` opens it (keep_finished), two rounds, finished.
    uri = local_tracking_uri(tmp_path)
    state = tmp_path / "run" / "mlflow_run.json"
    client = MlflowClient(uri)

    def reopen(fingerprint: str, resume: bool = True) -> MlflowTracker:
        return MlflowTracker.open(uri, "study", "a", state_path=state, fingerprint=fingerprint, resume=resume,
                                  keep_finished=True)

    first = reopen("f1")
    first.log_history([record(1, 0.5), record(2, 0.6)])
    first.finish()
    assert json.loads(state.read_text()) == {
        "run_id": first.run_id, "fingerprint": "f1", "tracking_uri": uri, "finished": True
    }
    # Execute: the same run again, logging everything once more.
    again = reopen("f1")
    again.log_params({"late": 1})
    again.log_history([record(1, 0.9), record(2, 0.9), record(3, 0.9)])
    again.set_tags({"late": "1"})
    again.finish()
    # Assert: the finished run, untouched; no second run.
    assert (again.run_id, again.complete, again.resumed) == (first.run_id, True, False)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and "late" not in run.data.params and "late" not in run.data.tags
    history = sorted(client.get_metric_history(first.run_id, "accuracy"), key=lambda metric: metric.step)
    assert [(metric.step, metric.value) for metric in history] == [(1, 0.5), (2, 0.6)]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # Another config, then --no-resume: new runs; a finished run is never marked KILLED.
    other = reopen("f2")
    assert other.run_id != first.run_id and not other.complete
    other.finish()
    fresh = reopen("f2", resume=False)
    assert fresh.run_id != other.run_id and not fresh.complete
    fresh.finish()
    assert {client.get_run(run_id).info.status for run_id in (first.run_id, other.run_id)} == {"FINISHED"}
    # A finished run deleted in the UI is logged again.
    client.delete_run(fresh.run_id)
    anew = reopen("f2")
    assert anew.run_id != fresh.run_id and not anew.complete


@pytest.mark.slow
def test_every_experiment_fedplug_logs_into_is_marked_model_training(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.tracking.mlflow_tracker import EXPERIMENT_KIND_TAG

    uri = local_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    client.create_experiment("older")  # as an earlier fedplug left it: no kind
    chosen = client.create_experiment("chosen")
    client.set_experiment_tag(chosen, EXPERIMENT_KIND_TAG, "genai_development")  # chosen in the UI
    for name in ("new", "older", "chosen"):
        MlflowTracker.open(uri, name, "a").finish()
    kinds = {name: client.get_experiment_by_name(name).tags.get(EXPERIMENT_KIND_TAG) for name in ("new", "older", "chosen")}
    assert kinds == {
        "new": "custom_model_development", "older": "custom_model_development", "chosen": "genai_development"
    }


@pytest.mark.slow
def test_runs_tagging_a_new_experiment_at_once_both_start(tmp_path: Path) -> None:
    """Two Ray tasks open their runs on one sqlite store at once: both read the new
    experiment without its kind, both tag it, and the store refuses the second insert
    (``UNIQUE constraint failed: experiment_tags``). The tag is there all the same, so
    the run starts; a refusal that left no tag still stops it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from fedplug.tracking.mlflow_tracker import EXPERIMENT_KIND_TAG, mark_training_experiment

    uri = local_tracking_uri(tmp_path)
    store = MlflowClient(uri)
    experiment_id = store.create_experiment("study")

    class Racing:
        """A client whose tag insert loses the race to ``rival`` (when given)."""

        def __init__(self, rival: Any) -> None:
            self.rival = rival

        def get_experiment(self, key: str) -> Any:
            return store.get_experiment(key)

        def set_experiment_tag(self, key: str, name: str, value: str) -> None:
            if self.rival is not None:
                self.rival.set_experiment_tag(key, name, value)
            raise MlflowException("UNIQUE constraint failed: experiment_tags.key")

    with pytest.raises(MlflowException, match="UNIQUE"):
        mark_training_experiment(Racing(rival=None), experiment_id)
    assert EXPERIMENT_KIND_TAG not in store.get_experiment(experiment_id).tags
    mark_training_experiment(Racing(rival=store), experiment_id)
    assert store.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_a_missing_setup_file_stops_a_feddisk_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    params = tiny_params(rounds=1)
    params["algorithms"] = {"feddisk": {"loss_transform": {"name": "feddisk", "made_hidden": 4}}}
    prepare_project(tmp_path, params)
    with pytest.raises(DataError, match=r"feddisk setup file data/setup/feddisk/.*\.npz is missing.*dvc repro setup"):
        load_stage("train").main(["--algorithm", "feddisk", "--seed", "0"])
    assert not (tmp_path / "data/setup").exists()  # nothing written into the stage's output


# ------------------------------------------------------------------ real server


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
    # The pipeline's experiment opens as model training in MLflow's UI.
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    runs = rest_post(
        mlflow_server, "runs/search", {"experiment_ids": [experiment["experiment_id"]]}
    )["runs"]
    # The train stage nests its run under its DVC experiment's (or repro's) parent run.
    (run,) = [
        run for run in runs
        if any(tag["key"] == "mlflow.parentRunId" for tag in run["data"].get("tags", []))
    ]
    assert len(runs) == 2
    assert run["info"]["run_name"].startswith("fedavg-seed0@") and run["info"]["status"] == "FINISHED"
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
    metrics = json.loads((project / "reports/runs/fedavg/seed-0/metrics.json").read_text())
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
        "partition",
        "metrics.json",
        "run_info.json",
    }
    # MLflow 3 keeps the model with its LoggedModel; runs:/<id>/model resolves to it.
    assert logged_model_accuracy(run_id, mlflow_server, project / "params.yaml") == pytest.approx(
        metrics["final_accuracy"]
    )


# ------------------------------------------- open_tracker: `fedplug run --track` and plugins


def write_config(folder: Path, rounds: int = 3, **tracking: Any) -> Path:
    """A tiny synthetic experiment that learns (logreg, separable classes) in ``folder``."""
    params = tiny_params(rounds=rounds, tracking={"enabled": False, **tracking})
    del params["algorithms"]
    params["data"]["partition"] = {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10}
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def run_cli(config: Path, out: Path, *extra: str) -> int:
    from fedplug.cli import main

    return main(["run", str(config), "--out", str(out), "--quiet", "--track", *extra])


def logged_model_accuracy(run_id: str, uri: str, config_path: Path) -> float:
    """Load ``runs:/<run_id>/model`` with ``mlflow.pytorch.load_model`` and score it on the
    config's global test set."""
    import mlflow
    import mlflow.pytorch
    import torch

    from fedplug.config import load_experiment
    from fedplug.data.build import build_federation
    from fedplug.plugins import default_registry

    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    config = load_experiment(config_path, [], None, check_every_algorithm=False)
    federation = build_federation(config.data, default_registry(), torch.device("cpu"))
    with torch.no_grad():
        predicted = model(federation.test_x).argmax(dim=1)
    return float((predicted == federation.test_y).float().mean())


def check_tracked_run(client: Any, run_id: str, out: Path, config: Path, uri: str) -> None:
    """What every `fedplug run --track` run must hold: steps 1..R, params, tags, model."""
    from fedplug.run_folder import git_commit

    run = client.get_run(run_id)
    metrics = json.loads((out / "metrics.json").read_text())
    rounds = metrics["rounds"]
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run_id, "accuracy"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, rounds + 1))
    assert [m.value for m in history] == pytest.approx([r["accuracy"] for r in metrics["history"]])
    assert run.data.metrics["final_accuracy"] == pytest.approx(metrics["final_accuracy"])
    params = run.data.params
    assert params["train.rounds"] == str(rounds) and params["train.optimizer.lr"] == "0.5"
    assert params["data.partition.alpha"] == "0.5" and "derived.model_bytes" in params
    tags = run.data.tags
    assert tags["fedplug.git_commit"] == git_commit(REPO) and len(tags["fedplug.git_commit"]) == 40
    assert tags["fedplug.version"] not in ("", "unknown")
    assert "mlflow.source.name" in tags  # start_run's context tags, not a bare create_run
    assert {key: tags[key] for key in ("dataset", "partition", "model", "sampler", "loss_transform", "aggregator", "grouper")} == {
        "dataset": "synthetic",
        "partition": "dirichlet_class",
        "model": "logreg",
        "sampler": "uniform",
        "loss_transform": "cross_entropy",
        "aggregator": "fedavg",
        "grouper": "none",
    }
    artifacts = {item.path for item in client.list_artifacts(run_id)}
    assert {"config.yaml", "run_info.json", "metrics.json"} <= artifacts
    # The logged model is a working MLflow model: it scores what metrics.json says.
    assert logged_model_accuracy(run_id, uri, config) == pytest.approx(metrics["final_accuracy"])
    assert metrics["final_accuracy"] > 0.5  # a model that learned, so the match means something


@pytest.mark.slow
def test_fedplug_run_track_logs_a_reloadable_run_to_the_sqlite_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    config = write_config(tmp_path, rounds=3)
    out = tmp_path / "run"
    assert run_cli(config, out) == 0
    printed = capsys.readouterr()
    uri = local_tracking_uri(tmp_path)  # the config's folder is the project
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(CLI_EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert f"MLflow run {run.info.run_id}" in printed.out and "make ui" in printed.out
    # The printed link opens the run's page in the UI's model-training mode.
    link = f"/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert link in printed.out
    check_tracked_run(client, run.info.run_id, out, config, uri)
    # Artifacts lie next to the store, not in the current folder's mlruns/.
    assert (tmp_path / "mlruns").is_dir()
    state = json.loads((out / "mlflow_run.json").read_text())  # finished: kept, marked so
    assert (state["run_id"], state["finished"]) == (run.info.run_id, True)


@pytest.mark.slow
def test_fedplug_run_has_its_own_experiment_names_configs_apart_and_logs_a_finished_run_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.config import load_experiment
    from fedplug.run_folder import output_fingerprint

    # Prepare: one config; the same command twice; another learning rate; another aggregator.
    config = write_config(tmp_path, rounds=2)
    variants = {"a": [], "lr": ["--set", "train.optimizer.lr=0.25"], "momentum": ["--set", "train.aggregator=fedavgm"]}
    # Execute
    assert run_cli(config, tmp_path / "a") == 0
    capsys.readouterr()
    assert run_cli(config, tmp_path / "a") == 0  # the same command again, after it finished
    again = capsys.readouterr()
    for name, extra in variants.items():
        if name != "a":
            assert run_cli(config, tmp_path / name, *extra) == 0
    # Assert: the study's experiment holds none of them; `fedplug run` has its own.
    client = MlflowClient(local_tracking_uri(tmp_path))
    assert client.get_experiment_by_name("tracking-test") is None
    experiment = client.get_experiment_by_name(CLI_EXPERIMENT)
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    expected = {}
    for name, extra in variants.items():
        resolved = load_experiment(config, extra[1::2], None, check_every_algorithm=False)
        label = "fedavgm" if name == "momentum" else "fedavg"
        expected[f"{label}-seed0-{output_fingerprint(resolved)[:8]}-synthetic"] = name
    assert sorted(runs) == sorted(expected)  # three names for three configs, none twice
    first = runs[next(run for run, name in expected.items() if name == "a")]
    assert "nothing new to log" in again.err and f"MLflow run {first.info.run_id}" in again.out
    assert sorted(metric.step for metric in client.get_metric_history(first.info.run_id, "accuracy")) == [1, 2]
    models = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    assert sorted(model.source_run_id for model in models) == sorted(run.info.run_id for run in runs.values())


@pytest.mark.slow
def test_fedplug_run_track_through_an_mlflow_server_and_registers_the_model(
    mlflow_server: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    project = tmp_path / "project"
    project.mkdir()
    config = write_config(project, rounds=3, uri=mlflow_server, register_model="fedplug-test-model")
    out = project / "run"
    assert run_cli(config, out) == 0
    experiment = rest(mlflow_server, "experiments/get-by-name", experiment_name=CLI_EXPERIMENT)["experiment"]
    (run,) = rest_post(mlflow_server, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    client = MlflowClient(mlflow_server)
    check_tracked_run(client, run["info"]["run_id"], out, config, mlflow_server)
    (version,) = client.search_model_versions("name='fedplug-test-model'")
    assert version.run_id == run["info"]["run_id"]
    assert not (project / "mlflow.db").exists()  # nothing went to the local store


@pytest.mark.slow
def test_tensorboard_tracker_writes_every_rounds_scalars(tmp_path: Path) -> None:
    from fedplug.tracking.tensorboard_tracker import logged_steps

    config = write_config(tmp_path, rounds=3, backends=["tensorboard"])
    out = tmp_path / "run"
    assert run_cli(config, out) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("accuracy", "loss", "cumulative_bytes"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in metrics["history"]], rel=1e-6), key
    assert events.Scalars("summary/final_accuracy")[0].value == pytest.approx(metrics["final_accuracy"])
    assert logged_steps(out / "tensorboard") == {1, 2, 3}
    assert not (tmp_path / "mlflow.db").exists()  # tensorboard only: no MLflow store


@pytest.mark.slow
def test_killed_fedplug_run_resumes_its_mlflow_run_and_tensorboard_steps(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.tracking.tensorboard_tracker import logged_steps

    config = write_config(tmp_path, rounds=4, backends=["mlflow", "tensorboard"])
    out = tmp_path / "run"
    original = MlflowTracker.log_round

    def dies_at_round_three(self: MlflowTracker, round_record: RoundRecord) -> None:
        # Round 3 is checkpointed (and in TensorBoard) but never reaches MLflow.
        if round_record.round == 3:
            raise Killed()
        original(self, round_record)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MlflowTracker, "log_round", dies_at_round_three)
        with pytest.raises(Killed):
            run_cli(config, out)
    first_run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(local_tracking_uri(tmp_path))
    assert client.get_run(first_run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(first_run_id, "accuracy")] == [1, 2]

    assert run_cli(config, out) == 0
    runs = client.search_runs([client.get_experiment_by_name(CLI_EXPERIMENT).experiment_id])
    assert [run.info.run_id for run in runs] == [first_run_id]  # continued, not duplicated
    history = client.get_metric_history(first_run_id, "accuracy")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # each step once
    metrics = json.loads((out / "metrics.json").read_text())
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [r["accuracy"] for r in metrics["history"]]
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [s.step for s in events.Scalars("accuracy")] == [1, 2, 3, 4]
    assert logged_steps(out / "tensorboard") == {1, 2, 3, 4}


class MemoryTracker:
    """A third-party tracker backend that keeps what it is sent."""

    def __init__(self) -> None:
        self.logged_rounds: set[int] = set()
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.steps: list[int] = []
        self.result: Any = None
        self.status = "RUNNING"

    def log_params(self, params: Any) -> None:
        self.params.update(params)

    def log_round(self, record: RoundRecord) -> None:
        self.steps.append(record.round)
        self.logged_rounds.add(record.round)

    def log_result(self, result: Any) -> None:
        self.result = result

    def log_model(self, model: Any, input_example: Any, *, registered_model_name: str | None = None) -> None:
        return None

    def log_artifacts(self, paths: Any) -> None:
        pass

    def set_tags(self, tags: Any) -> None:
        self.tags.update(tags)

    def finish(self) -> None:
        self.status = "FINISHED"

    def fail(self) -> None:
        self.status = "FAILED"


def test_a_plugin_registers_a_tracker_through_the_hook(tmp_path: Path) -> None:
    from fedplug.config import load_experiment
    from fedplug.experiment import run_experiment
    from fedplug.hookspecs import hookimpl
    from fedplug.plugins import collect_registry, new_plugin_manager
    from fedplug.tracking import TrackerContext, open_tracker

    opened: list[MemoryTracker] = []
    contexts: list[TrackerContext] = []

    def open_memory(context: TrackerContext) -> MemoryTracker:
        contexts.append(context)
        opened.append(MemoryTracker())
        opened[-1].set_tags(context.tags)
        return opened[-1]

    class MemoryPlugin:
        @hookimpl
        def fedplug_register_trackers(self, register: Any) -> None:
            register("memory", open_memory)

    manager = new_plugin_manager(autoload=False)
    manager.register(MemoryPlugin(), name="memory-plugin")
    registry = collect_registry(manager)
    assert [entry.plugin for entry in registry.tracker_entries() if entry.name == "memory"] == ["memory-plugin"]
    config = load_experiment(write_config(tmp_path, rounds=2, backends=["memory"]), [], None, check_every_algorithm=False)
    environ = {"DVC_EXP_NAME": "crisp-lark", "DVC_EXP_BASELINE_REV": "a" * 40}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environ.items():
            patch.setenv(key, value)
        tracker = open_tracker(config, tmp_path / "run", run_name="r", registry=registry, enabled=True, tags={"extra": "1"})
    with tracker:
        result, _ = run_experiment(config, tmp_path / "run", registry=registry, observers=[tracker.log_round])
        tracker.log_result(result)
    (memory,) = opened
    assert memory.steps == [1, 2] and memory.result is result and memory.status == "FINISHED"
    assert memory.params["train.rounds"] == 2 and memory.params["data.num_clients"] == 3
    assert memory.tags["dvc.exp_name"] == "crisp-lark" and memory.tags["dvc.baseline_rev"] == "a" * 40
    assert memory.tags["extra"] == "1" and memory.tags["aggregator"] == "fedavg"
    assert tracker.run_id is None  # no MLflow backend
    assert not (tmp_path / "mlflow.db").exists()

    with pytest.raises(ConfigError, match="unknown tracker 'nope'.*memory"):
        open_tracker(config, None, run_name="r", registry=registry, enabled=True, backends=["nope"])


def test_tracking_switched_off_opens_nothing(tmp_path: Path) -> None:
    from fedplug.config import load_experiment
    from fedplug.tracking import open_tracker

    config = load_experiment(write_config(tmp_path), [], None, check_every_algorithm=False)
    tracker = open_tracker(config, tmp_path / "run", run_name="r")  # tracking.enabled: false
    assert not tracker.enabled and tracker.run_id is None and tracker.uri is None
    tracker.log_round(record(1, 0.5))
    tracker.finish()
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()
