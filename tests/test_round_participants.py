"""Each round's record names the clients that trained (``clients``) and, when a grouper
chains them, each chain's members (``chains``): in metrics.json on the simulator and on
Flower's loopback grid, through a resume from a checkpoint written before the fields
existed, and in MLflow as one bounded artifact per round (issue 43, item 2)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

import fedplug.plugins
from fedplug.components import ComponentConfig, Grouper, RoundPlan
from fedplug.config import validate_experiment
from fedplug.errors import TrainingError
from fedplug.experiment import run_experiment
from fedplug.hookspecs import hookimpl
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.checkpoint import read_checkpoint, save_checkpoint
from fedplug.run.results import RoundRecord, split_wall_clock
from fedplug.tracking import local_tracking_uri

NUM_CLIENTS = 6
ROUNDS = 2


def experiment(**train: Any) -> dict[str, Any]:
    """SMALL_EXPERIMENT (6 clients, half of them a round) at ROUNDS rounds."""
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"].update(rounds=ROUNDS, **train)
    return data


def sampled_by_hand(seed: int, round_index: int) -> list[int]:
    """The round's 3 of 6 clients, drawn as fedplug's sampling rule documents
    (fedplug.run.round_plan.sample_clients: the generator ``[seed, round, 0xC11E]``, no
    replacement, ascending)."""
    rng = np.random.default_rng([seed, round_index, 0xC11E])
    return sorted(rng.choice(NUM_CLIENTS, size=3, replace=False).tolist())


class PairsConfig(ComponentConfig):
    """Chains the sampled clients two by two, the higher id first."""

    name: Literal["pairs"]


class Pairs(Grouper):
    def __init__(self, config: PairsConfig) -> None:
        self.config = config

    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        ordered = sorted(clients.tolist())
        return RoundPlan(chains=[ordered[start : start + 2][::-1] for start in range(0, len(ordered), 2)])


def pairs_registry() -> Registry:
    module = types.ModuleType("pairs_plugin")

    @hookimpl
    def fedplug_register_groupers(register: Any) -> None:
        register(PairsConfig, Pairs)

    module.fedplug_register_groupers = fedplug_register_groupers
    manager = new_plugin_manager(autoload=False)
    manager.register(module, name=module.__name__)
    return collect_registry(manager)


def run_on_flower(data: dict[str, Any], registry: Registry, out: Path) -> list[dict[str, Any]]:
    """metrics.json's rounds of ``data`` run on Flower's in-process loopback grid."""
    config = validate_experiment(data, registry)
    run_on_grid(LoopbackGrid(make_client_app(), NUM_CLIENTS), config, out_dir=out, registry=registry, track=False)
    return json.loads((out / "metrics.json").read_text())["history"]


def run_on_simulator(data: dict[str, Any], registry: Registry, out: Path) -> list[dict[str, Any]]:
    run_experiment(validate_experiment(data, registry), out, registry=registry)
    return json.loads((out / "metrics.json").read_text())["history"]


def named(rounds: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    return [(record["participants"], record["clients"], record["chains"]) for record in rounds]


# ------------------------------------------------------------------------ metrics.json


def test_the_simulators_metrics_name_the_clients_it_sampled(tmp_path: Path) -> None:
    rounds = run_on_simulator(experiment(), pairs_registry(), tmp_path / "run")
    expected = [sampled_by_hand(0, index) for index in range(ROUNDS)]
    assert named(rounds) == [(3, clients, None) for clients in expected]
    assert expected[0] != expected[1]  # the rounds differ, so the record is each round's own


def test_flowers_metrics_name_the_same_clients_and_chains_as_the_simulators(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: chains of two, the higher id first, so order and membership both show; the
    # Flower nodes build their components from the installed plugins' registry.
    registry = pairs_registry()
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    data = experiment(grouper={"name": "pairs"})
    # Execute
    simulated = run_on_simulator(data, registry, tmp_path / "simulator")
    flower = run_on_flower(data, registry, tmp_path / "flower")
    # Assert: by hand, then the two runtimes against each other.
    expected = []
    for index in range(ROUNDS):
        low, middle, high = sampled_by_hand(0, index)
        expected.append((3, [middle, low, high], [[middle, low], [high]]))
    assert named(simulated) == expected
    assert named(flower) == expected


def test_a_checkpoint_written_before_rounds_named_their_clients_still_resumes(tmp_path: Path) -> None:
    # Prepare: a run stopped after round 1, its checkpoint's record stripped of the new
    # fields, as an older fedplug wrote it.
    data = experiment()
    registry = pairs_registry()
    config = validate_experiment(data, registry)
    out = tmp_path / "run"

    def stop_after_round_one(record: RoundRecord) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, out, registry=registry, observers=[stop_after_round_one])
    checkpoint = out / "checkpoint.pt"
    state = read_checkpoint(checkpoint)
    state.pop("version")
    for entry in state["history"]:
        del entry["clients"], entry["chains"]
    save_checkpoint(checkpoint, state)
    # Execute
    result, _ = run_experiment(config, out, registry=registry)
    # Assert: round 1 (restored) names nobody, round 2 its own clients.
    assert [record.clients for record in result.history] == [None, sampled_by_hand(0, 1)]
    rounds = json.loads((out / "metrics.json").read_text())["history"]
    assert [record["clients"] for record in rounds] == [None, sampled_by_hand(0, 1)]


def test_a_checkpoint_whose_clients_are_not_ids_is_refused(tmp_path: Path) -> None:
    # Prepare
    registry = pairs_registry()
    config = validate_experiment(experiment(), registry)
    out = tmp_path / "run"

    def stop_after_round_one(record: RoundRecord) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, out, registry=registry, observers=[stop_after_round_one])
    state = read_checkpoint(out / "checkpoint.pt")
    state.pop("version")
    state["history"][0]["clients"] = ["zero", 1]
    save_checkpoint(out / "checkpoint.pt", state)
    # Execute / Assert
    with pytest.raises(TrainingError, match=r"history\[0\]\['clients'\] is not a list of client ids"):
        run_experiment(config, out, registry=registry)


def test_the_pipeline_keeps_the_client_ids_beside_its_hashed_files() -> None:
    """The DVC pipeline's metrics.json keeps the form its committed hashes were taken of;
    the ids go beside it with the measured times."""
    summary = {
        "final_accuracy": 0.5,
        "total_seconds": 3.0,
        "history": [
            {"round": 1, "accuracy": 0.5, "seconds": 1.0, "clients": [2, 0], "chains": [[2, 0]]},
            {"round": 2, "accuracy": 0.6, "seconds": 2.0, "clients": [1], "chains": None},
        ],
    }
    reproducible, beside = split_wall_clock(summary)
    assert reproducible["history"] == [{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.6}]
    assert beside == {
        "total_seconds": 3.0,
        "round_seconds": [1.0, 2.0],
        "round_clients": [[2, 0], [1]],
        "round_chains": [[[2, 0]], None],
    }


# ------------------------------------------------------------------------------ MLflow


def test_mlflow_holds_each_rounds_clients_as_an_artifact(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from fedplug.tracking.mlflow_tracker import MlflowTracker

    # Prepare: a chained run's records.
    registry = pairs_registry()
    result, _ = run_experiment(validate_experiment(experiment(grouper={"name": "pairs"}), registry), None,
                               registry=registry)
    uri = local_tracking_uri(tmp_path)
    state = tmp_path / "run" / "mlflow_run.json"
    # Execute: log round 1, then (as a resumed run) every round.
    tracker = MlflowTracker.open(uri, "study", "pairs-seed0", state_path=state, fingerprint="f")
    tracker.log_history(result.history[:1])
    again = MlflowTracker.open(uri, "study", "pairs-seed0", state_path=state, fingerprint="f")
    again.log_history(result.history)
    again.finish()
    # Assert: one file per round, each naming that round's clients and chains.
    client = MlflowClient(uri)
    listed = [item.path for item in client.list_artifacts(tracker.run_id, "rounds")]
    assert listed == ["rounds/round-0001.json", "rounds/round-0002.json"]
    for record in result.history:
        path = client.download_artifacts(tracker.run_id, f"rounds/round-{record.round:04d}.json", str(tmp_path))
        logged = json.loads(Path(path).read_text())
        assert logged == {"round": record.round, "participants": 3, "clients": record.clients,
                          "chains": record.chains, "truncated": False}
        assert record.chains is not None and len(record.chains) == 2


def test_the_mlflow_artifact_of_a_huge_round_is_cut_and_says_so() -> None:
    from fedplug.tracking.mlflow_tracker import MAX_LOGGED_CLIENT_IDS, round_participants

    clients = list(range(MAX_LOGGED_CLIENT_IDS + 5))
    record = RoundRecord(round=3, accuracy=0.5, loss=1.0, client_accuracy_mean=0.5, client_accuracy_std=0.0,
                         bytes_up=0, bytes_down=0, cumulative_bytes=0, seconds=0.0, participants=len(clients),
                         failures=0, clients=clients, chains=[clients])
    logged = round_participants(record)
    assert logged["participants"] == MAX_LOGGED_CLIENT_IDS + 5
    assert logged["clients"] == clients[:MAX_LOGGED_CLIENT_IDS] and logged["truncated"] is True
    assert logged["chains"] is None
