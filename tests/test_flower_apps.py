"""The ready Flower apps: reading the experiment from a run config, the example app's
pyproject, and the node side's checks."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from fedplug.adapters.flower import make_client_app
from fedplug.adapters.flower.apps import experiment_from_run_config, run_on_grid
from fedplug.adapters.flower.loopback import LoopbackGrid, ensure_task_identity
from fedplug.adapters.flower.nodes import (
    EXPERIMENT,
    EXPERIMENT_ID,
    experiment_message_config,
    handle_query,
)
from fedplug.adapters.flower.records import CONFIG_KEY
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.config import validate_config

from fedplug.config import validate_experiment
from fedplug.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_app"


def example_run_config() -> dict[str, Any]:
    return tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_example_app_is_a_valid_flower_app_pointing_at_the_ready_apps() -> None:
    config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    valid, errors, _ = validate_config(config, check_module=True, project_dir=EXAMPLE)
    assert valid, errors
    assert config["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedplug.adapters.flower.apps:server_app",
        "clientapp": "fedplug.adapters.flower.apps:client_app",
    }


@pytest.mark.parametrize(
    "algorithm", ["", "fedavg", "fedprox", "iwds", "fedshift", "fedavgm", "scaffold"]
)
def test_example_run_config_names_a_valid_experiment(algorithm: str) -> None:
    experiment = experiment_from_run_config(
        {**example_run_config(), "fedplug-algorithm": algorithm}
    )
    assert experiment.data.num_clients == 2
    if algorithm == "fedshift":
        assert experiment.train.loss_transform.name == "fedshift"


def test_path_wins_over_inline_yaml_and_overrides_apply(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    path = tmp_path / "params.yaml"
    small_experiment["algorithms"] = {"shifted": {"loss_transform": {"name": "fedshift"}}}
    path.write_text(yaml.safe_dump(small_experiment))
    run_config = {
        **example_run_config(),
        "fedplug-config": str(path),
        "fedplug-set": "train.rounds=7; data.seed=3",
        "fedplug-algorithm": "shifted",
    }
    experiment = experiment_from_run_config(run_config)
    assert experiment.data.num_clients == 6  # the file's, not the inline YAML's 2
    assert (experiment.train.rounds, experiment.data.seed) == (7, 3)
    assert experiment.train.loss_transform.name == "fedshift"


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({}, "names no experiment"),
        ({"fedplug-config-yaml": "data: ["}, "not valid YAML"),
        ({"fedplug-config-yaml": "- a list"}, "must be a YAML mapping"),
        ({"fedplug-config": "/nonexistent/params.yaml"}, "does not exist"),
        (
            {"fedplug-config-yaml": "data: {}\ntrain: {}\n", "fedplug-algorithm": "nope"},
            "unknown algorithm 'nope'",
        ),
    ],
)
def test_bad_run_configs_say_what_to_fix(run_config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        experiment_from_run_config(run_config)


def query_with(config: dict[str, Any]) -> Message:
    ensure_task_identity()
    return Message(
        RecordDict({CONFIG_KEY: ConfigRecord(config)}),
        dst_node_id=1,
        message_type=MessageType.QUERY,
    )


def test_a_node_needs_the_experiment_and_its_partition(small_experiment: dict[str, Any]) -> None:
    experiment = validate_experiment(small_experiment)
    with pytest.raises(ConfigError, match="carries no fedplug experiment"):
        handle_query(
            query_with({}),
            Context(1, 1, {"partition-id": 0, "num-partitions": 6}, RecordDict(), {}),
        )
    with pytest.raises(ConfigError, match="--node-config 'partition-id=<k> num-partitions=<K>'"):
        handle_query(
            query_with(experiment_message_config(experiment)), Context(1, 1, {}, RecordDict(), {})
        )


def test_the_experiment_travels_with_its_digest(small_experiment: dict[str, Any]) -> None:
    first = experiment_message_config(validate_experiment(small_experiment))
    small_experiment["train"]["seed"] = 1
    second = experiment_message_config(validate_experiment(small_experiment))
    assert set(first) == {EXPERIMENT, EXPERIMENT_ID}
    assert first[EXPERIMENT_ID] != second[EXPERIMENT_ID]


def test_run_on_grid_writes_what_fedplug_run_writes(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    small_experiment["train"]["rounds"] = 1
    experiment = validate_experiment(small_experiment)
    result, _ = run_on_grid(LoopbackGrid(make_client_app(), 6), experiment, out_dir=tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "config.yaml",
        "metrics.json",
        "model.pt",
        "run_info.json",
    ]
    assert result.summary()["derived"]["engine"] == "flower"
