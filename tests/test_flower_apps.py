"""The ready Flower apps: reading the experiment from a run config, the example app's
pyproject, and the node side's checks."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fedplug.adapters.flower import make_client_app
from fedplug.adapters.flower.apps import (
    experiment_from_run_config,
    load_experiment_source,
    resolve_data_root,
    run_on_grid,
)
from fedplug.adapters.flower.flower_log import (
    FedplugErrorsInOneLine,
    report_fedplug_errors_in_one_line,
)
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
from fedplug.errors import ConfigError, TrainingError

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
        ({"fedplug-config-yaml": "- a list"}, "expected a mapping of sections"),
        ({"fedplug-config-yaml": "train: " + "[" * 5000 + "]" * 5000}, "nested more than 50 levels deep"),
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
        ".fedplug-output.json",
        ".fedplug-output.lock",
        "checkpoint.pt",
        "config.yaml",
        "metrics.json",
        "model.pt",
        "run_info.json",
    ]
    assert result.summary()["derived"]["engine"] == "flower"


def test_a_relative_data_root_is_read_against_the_experiment_file(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    # Prepare: the file in a sub-folder, data.root relative, absolute and absent.
    folder = tmp_path / "study"
    folder.mkdir()
    path = folder / "params.yaml"
    roots = {}
    for root in ("data/raw", str(tmp_path / "elsewhere"), None):
        data = {**small_experiment, "data": dict(small_experiment["data"])}
        if root is not None:
            data["data"]["root"] = root
        path.write_text(yaml.safe_dump(data))
        # Execute
        roots[root] = experiment_from_run_config({"fedplug-config": str(path)}).data.root
    from_loader = load_experiment_source(path).data.root
    overridden = experiment_from_run_config(
        {"fedplug-config": str(path), "fedplug-set": "data.root=../shared"}
    ).data.root
    inline = experiment_from_run_config(
        {"fedplug-config-yaml": yaml.safe_dump({**small_experiment, "data": {
            **small_experiment["data"], "root": "data/raw"}})}
    ).data.root
    # Assert: against the file's folder, never the working folder; absolute stays.
    assert roots["data/raw"] == str(folder / "data" / "raw")
    assert roots[str(tmp_path / "elsewhere")] == str(tmp_path / "elsewhere")
    assert roots[None] == str(folder / "data" / "raw")  # the default, data/raw
    assert from_loader == str(folder / "data" / "raw")
    assert overridden == str(tmp_path / "shared")
    assert inline == "data/raw"  # no file: the ServerApp's working folder, as documented


def test_resolve_data_root_leaves_mappings_without_a_data_section() -> None:
    assert resolve_data_root({"train": {}}, "/base") == {"train": {}}
    assert resolve_data_root({"data": {"root": "x"}}, "/base") == {"data": {"root": "/base/x"}}


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_fedplug_error_ending_the_server_app_is_logged_in_one_line() -> None:
    # Prepare: Flower's own call when a ServerApp raises.
    flower_log = logging.getLogger("flwr")
    collect = Collect()
    flower_log.addHandler(collect)
    report_fedplug_errors_in_one_line()
    report_fedplug_errors_in_one_line()  # once per process
    try:
        # Execute
        for error in (TrainingError("only 2 of the 10 nodes connected"), ValueError("bug")):
            try:
                raise error
            except Exception as raised:  # noqa: BLE001
                flower_log.error("%s raised an exception", "ServerApp", exc_info=raised)
    finally:
        flower_log.removeHandler(collect)
    # Assert: ours in one line without traceback; anything else untouched.
    assert sum(isinstance(each, FedplugErrorsInOneLine) for each in flower_log.filters) == 1
    ours, other = collect.records
    assert ours.getMessage() == "fedplug stopped the run: only 2 of the 10 nodes connected"
    assert ours.exc_info is None
    assert other.getMessage() == "ServerApp raised an exception"
    assert other.exc_info is not None


def test_run_on_grid_logs_each_round_through_flowers_logger(
    small_experiment: dict[str, Any],
) -> None:
    small_experiment["train"]["rounds"] = 2
    flower_log = logging.getLogger("flwr")
    collect = Collect()
    flower_log.addHandler(collect)
    previous = flower_log.level
    flower_log.setLevel(logging.INFO)
    try:
        run_on_grid(
            LoopbackGrid(make_client_app(), 6), small_experiment, federated_evaluation=False
        )
    finally:
        flower_log.removeHandler(collect)
        flower_log.setLevel(previous)
    progress = [
        record.getMessage()
        for record in collect.records
        if record.getMessage().startswith("fedplug round")
    ]
    assert [line.split(":")[0] for line in progress] == ["fedplug round 1", "fedplug round 2"]


class Killed(Exception):
    """Stands for the ServerApp process dying after a round."""


def test_a_server_app_run_resumes_from_its_last_round(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    # Prepare: an uninterrupted 3-round run, and one "killed" after round 2.
    small_experiment["train"]["rounds"] = 3
    experiment = validate_experiment(small_experiment)
    whole, whole_strategy = run_on_grid(
        LoopbackGrid(make_client_app(), 6), experiment, federated_evaluation=False
    )

    def kill_after_round_2(record: Any) -> None:
        if record.round == 2:
            raise Killed

    out = tmp_path / "run"
    with pytest.raises(Killed):
        run_on_grid(
            LoopbackGrid(make_client_app(), 6),
            experiment,
            out_dir=out,
            federated_evaluation=False,
            observers=[kill_after_round_2],
        )
    assert (out / "checkpoint.pt").exists() and not (out / "metrics.json").exists()
    # Execute: the same run again, on fresh nodes (a restarted deployment).
    trained: list[int] = []
    resumed, resumed_strategy = run_on_grid(
        LoopbackGrid(make_client_app(), 6),
        experiment,
        out_dir=out,
        federated_evaluation=False,
        observers=[lambda record: trained.append(record.round)],
    )
    # Assert: only round 3 ran, and the result is the uninterrupted run's.
    assert trained == [3]
    assert [record.round for record in resumed.history] == [1, 2, 3]
    assert resumed_strategy.final_vector is not None and whole_strategy.final_vector is not None
    assert torch.allclose(resumed_strategy.final_vector, whole_strategy.final_vector, atol=1e-6)
    assert resumed.final_accuracy == pytest.approx(whole.final_accuracy, abs=1e-9)
    assert (out / "metrics.json").exists()


def test_the_server_apps_out_is_claimed_like_fedplug_runs(
    tmp_path: Path, small_experiment: dict[str, Any]
) -> None:
    # Prepare: a folder of the user's files, and a finished run of another experiment.
    small_experiment["train"]["rounds"] = 1
    experiment = validate_experiment(small_experiment)
    other = validate_experiment({**small_experiment, "train": {**small_experiment["train"], "seed": 1}})
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("mine")
    finished = tmp_path / "finished"
    run_on_grid(LoopbackGrid(make_client_app(), 6), other, out_dir=finished, federated_evaluation=False)
    before = {path.name: path.read_bytes() for path in finished.iterdir() if path.is_file()}
    # Execute / Assert: both are refused in one line and left as they were.
    with pytest.raises(ConfigError, match="fedplug-out .* is not empty and was not written by fedplug"):
        run_on_grid(LoopbackGrid(make_client_app(), 6), experiment, out_dir=notes, federated_evaluation=False)
    assert [path.name for path in notes.iterdir()] == ["thesis.tex"]
    with pytest.raises(ConfigError, match="fedplug-out .* belongs to a different config"):
        run_on_grid(LoopbackGrid(make_client_app(), 6), experiment, out_dir=finished, federated_evaluation=False)
    assert {path.name: path.read_bytes() for path in finished.iterdir() if path.is_file()} == before

