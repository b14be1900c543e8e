"""Flower's server side tracked in MLflow: the ready ServerApp through a real ``mlflow
server`` on 127.0.0.1, ``run_on_grid`` into the sqlite store, and a resumed ServerApp that
continues its MLflow run without logging a round twice. (FedML's tracking is tested in
tests/test_fedml.py, in ``.venv-fedml``.)

Every run is a real in-process Flower run (:class:`LoopbackGrid`); the model logged as an
MLflow model is loaded back with ``mlflow.pytorch.load_model`` and scored on the test set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("flwr", reason="the Flower adapter needs flwr")
pytest.importorskip("mlflow", reason="tracking needs mlflow")

from fedplug.adapters.flower import make_client_app  # noqa: E402
from fedplug.adapters.flower.apps import run_on_grid, server_app  # noqa: E402
from fedplug.adapters.flower.loopback import LoopbackGrid  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402
from mlflow_server import QUIET_ENV, mlflow_server  # noqa: E402, F401

from fedplug.config import validate_experiment  # noqa: E402
from fedplug.data.build import load_dataset  # noqa: E402
from fedplug.plugins import default_registry  # noqa: E402

STUDY = "flower-tracking"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    # MLflow resolves a relative artifact location against the working folder.
    monkeypatch.chdir(tmp_path)


def tracked(experiment: dict[str, Any], uri: str | None = None) -> dict[str, Any]:
    experiment["study"]["name"] = STUDY
    experiment["tracking"] = {"enabled": True, "uri": uri}
    return experiment


def test_accuracy(model_uri: str, tracking_uri: str, config: Any) -> float:
    """Load the logged MLflow model and score it on the experiment's test set."""
    import mlflow
    import mlflow.pytorch

    # set_tracking_uri also sets $MLFLOW_TRACKING_URI: put both back, or every later test in
    # this process (another file's, under make test's workers) would log to this server.
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri)
    try:
        model = mlflow.pytorch.load_model(model_uri, map_location="cpu")
    finally:
        mlflow.set_tracking_uri(None)
        if previous is not None:
            os.environ["MLFLOW_TRACKING_URI"] = previous
    dataset = load_dataset(config.data, default_registry())
    with torch.no_grad():
        logits = model(torch.as_tensor(dataset.test_x, dtype=torch.float32))
    labels = torch.as_tensor(dataset.test_y, dtype=torch.long)
    return float((logits.argmax(1) == labels).float().mean())


test_accuracy.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def only_run(client: Any) -> Any:
    experiment = client.get_experiment_by_name(STUDY)
    assert experiment is not None, f"no MLflow experiment {STUDY!r}"
    # Flower's runs, too, open as model training in MLflow's UI (not as a GenAI app).
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return runs[0]


def steps(client: Any, run_id: str, key: str = "accuracy") -> list[int]:
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


# ------------------------------------------------------------------ off by default here


def test_a_run_with_tracking_off_logs_nothing(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    small_experiment["train"]["rounds"] = 1
    run_on_grid(
        LoopbackGrid(make_client_app(), 6),
        small_experiment,
        out_dir=tmp_path / "run",
        federated_evaluation=False,
    )
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "run" / "mlflow_run.json").exists()
    assert (tmp_path / "run" / "metrics.json").exists()


# ------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_the_ready_server_app_round_trips_through_an_mlflow_server(
    mlflow_server: str, tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    from mlflow.tracking import MlflowClient

    # Prepare: a project with params.yaml naming the server and one labelled algorithm;
    # the ready ServerApp reads it from the run config, as `flwr run` would give it.
    project = tmp_path / "project"
    project.mkdir()
    experiment = tracked(small_experiment, mlflow_server)
    experiment["algorithms"] = {"momentum": {"aggregator": {"name": "fedavgm", "momentum": 0.9}}}
    (project / "params.yaml").write_text(yaml.safe_dump(experiment, sort_keys=False))
    out = project / "run"
    run_config = {
        "fedplug-config": str(project / "params.yaml"),
        "fedplug-algorithm": "momentum",
        "fedplug-out": str(out),
    }
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    # Execute
    server_app(LoopbackGrid(make_client_app(), 6), context)
    # Assert: one finished run holding the params, tags, every round and the model.
    metrics = json.loads((out / "metrics.json").read_text())
    client = MlflowClient(mlflow_server)
    run = only_run(client)
    run_id = run.info.run_id
    name = run.info.run_name  # <algorithm>-seed<seed>-<config hash>-<dataset>, as fedplug run's
    assert name.startswith("momentum-seed0-") and name.endswith("-synthetic") and len(name.split("-")[2]) == 8
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert {key: tags[key] for key in ("fedplug.runtime", "fedplug.algorithm", "fedplug.seed")} == {
        "fedplug.runtime": "flower",
        "fedplug.algorithm": "momentum",
        "fedplug.seed": "0",
    }
    assert {key: tags[key] for key in ("dataset", "partition", "aggregator", "sampler")} == {
        "dataset": "synthetic",
        "partition": "dirichlet_class",
        "aggregator": "fedavgm",
        "sampler": "uniform",
    }
    assert tags["fedplug.version"]
    params = run.data.params
    assert params["train.rounds"] == "3" and params["data.num_clients"] == "6"
    assert params["train.aggregator.momentum"] == "0.9"
    for key in ("accuracy", "loss", "client_accuracy_mean", "cumulative_bytes"):
        history = client.get_metric_history(run_id, key)
        assert sorted(point.step for point in history) == [1, 2, 3], key
        by_step = {point.step: point.value for point in history}
        assert [by_step[step] for step in (1, 2, 3)] == pytest.approx(
            [record[key] for record in metrics["history"]]
        ), key
    assert run.data.metrics["final_accuracy"] == pytest.approx(metrics["final_accuracy"])
    listed = {item.path for item in client.list_artifacts(run_id)}
    assert {"config.yaml", "metrics.json", "run_info.json"} <= listed  # MLflow 3: the model
    # is a LoggedModel of the run, not a run artifact; runs:/<id>/model resolves it.
    config = validate_experiment(
        {**experiment, "train": {**experiment["train"], **experiment["algorithms"]["momentum"]}}
    )
    accuracy = test_accuracy(f"runs:/{run_id}/model", mlflow_server, config)
    assert accuracy == pytest.approx(run.data.metrics["final_accuracy"], abs=1e-6)


# ----------------------------------------------------------------- sqlite store, resume


class Killed(Exception):
    """Stands for the ServerApp process dying after a round."""


@pytest.mark.slow
def test_a_resumed_server_run_continues_its_mlflow_run_without_duplicate_steps(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.tracking import local_tracking_uri

    # Prepare: a tracked run into the project's sqlite store, killed in round 2 after the
    # checkpoint was saved but before MLflow saw the round (the observer that dies runs
    # first), the worst moment.
    experiment = validate_experiment(tracked(small_experiment))
    out = tmp_path / "run"

    def killed_in_round_2(record: Any) -> None:
        if record.round == 2:
            raise Killed

    with pytest.raises(Killed):
        run_on_grid(
            LoopbackGrid(make_client_app(), 6),
            experiment,
            out_dir=out,
            observers=[killed_in_round_2],
            project_root=tmp_path,
        )
    uri = local_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    first = only_run(client)
    assert first.info.status == "FAILED"
    assert steps(client, first.info.run_id) == [1]
    assert (out / "checkpoint.pt").exists() and (out / "mlflow_run.json").exists()
    # Execute: the same ServerApp again (fresh nodes, as a restarted deployment).
    trained: list[int] = []
    result, _ = run_on_grid(
        LoopbackGrid(make_client_app(), 6),
        experiment,
        out_dir=out,
        observers=[lambda record: trained.append(record.round)],
        project_root=tmp_path,
    )
    # Assert: round 3 trained; the same MLflow run now holds rounds 1-3 once each (round
    # 2 from the checkpoint), finished, and its model scores the final accuracy.
    assert trained == [3]
    run = only_run(client)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    for key in ("accuracy", "loss", "bytes_up"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [point.step for point in sorted(history, key=lambda p: p.step)] == [1, 2, 3], key
        assert [point.value for point in sorted(history, key=lambda p: p.step)] == pytest.approx(
            [getattr(record, key) for record in result.history]
        ), key
    assert run.data.metrics["final_accuracy"] == pytest.approx(result.final_accuracy)
    assert run.data.tags["fedplug.runtime"] == "flower"
    assert not (out / "mlflow_run.json").exists()  # a finished run forgets its resume state
    accuracy = test_accuracy(f"runs:/{run.info.run_id}/model", uri, experiment)
    assert accuracy == pytest.approx(result.final_accuracy, abs=1e-6)
