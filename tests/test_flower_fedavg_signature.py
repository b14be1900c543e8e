"""Issue 25, build item 1: FedplugStrategy takes every keyword of Flower's ``FedAvg`` with
FedAvg's meaning, so swapping one for the other with the same keywords runs.

(a) the two signatures compared, so a Flower upgrade that adds a keyword fails here naming
it; (b) ``FedplugStrategy(**the keywords a FedAvg gets)`` on the LoopbackGrid with the
quickstart-shaped ClientApp of test_flower_dropin_server; (c) sampled federated evaluation
(``fraction_evaluate`` / ``min_evaluate_nodes``); (d) ``model=`` optional next to
``initial_arrays``, and a mismatch naming the differing keys; the record keys.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import pytest
import torch
from fedplug.adapters.flower import FedplugStrategy, LoopbackGrid
from fedplug.adapters.flower.records import record_to_vector, vector_layout
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from test_flower_dropin_server import NUM_NODES, SERVER_SIDE, initial_net, quickstart_app
from torch import nn

from fedplug.errors import ConfigError

DIFFERENT_DEFAULTS = {
    "fraction_train": "None: the fedplug config's train.client_fraction, so that one "
    "config means the same run on every runtime (FedAvg: 1.0)",
}
"""FedAvg keywords whose FedplugStrategy default differs, and why."""
FEDAVG_KEYWORDS: dict[str, Any] = {
    "fraction_train": 1.0,
    "fraction_evaluate": 0.5,
    "min_train_nodes": 2,
    "min_evaluate_nodes": 2,
    "min_available_nodes": 2,
    "weighted_by_key": "num-examples",
    "arrayrecord_key": "arrays",
    "configrecord_key": "config",
    "train_metrics_aggr_fn": aggregate_metricrecords,
    "evaluate_metrics_aggr_fn": aggregate_metricrecords,
}
"""A FedAvg's keywords, every one of them given."""


def initial_arrays() -> ArrayRecord:
    return ArrayRecord(initial_net().state_dict())


def run(strategy: Any, grid: LoopbackGrid, num_rounds: int = 2) -> Result:
    return strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=num_rounds)


def evaluated_nodes(grid: LoopbackGrid) -> dict[str, list[int]]:
    """round (group id) -> the nodes sent an ``evaluate`` message, in order."""
    by_round: dict[str, list[int]] = defaultdict(list)
    for message in grid.delivered:
        if message.metadata.message_type == MessageType.EVALUATE:
            by_round[message.metadata.group_id].append(message.metadata.dst_node_id)
    return dict(by_round)


# ------------------------------------------------------------------ (a) signatures


def test_every_fedavg_keyword_is_a_fedplug_strategy_keyword_with_fedavgs_default() -> None:
    # Prepare
    flower = {
        name: parameter
        for name, parameter in inspect.signature(FedAvg.__init__).parameters.items()
        if name != "self"
    }
    ours = inspect.signature(FedplugStrategy.__init__).parameters
    # Execute
    missing = sorted(set(flower) - set(ours))
    other_defaults = {
        name: (parameter.default, ours[name].default)
        for name, parameter in flower.items()
        if name in ours and name not in DIFFERENT_DEFAULTS
        and parameter.default != ours[name].default
    }
    # Assert
    assert not missing, f"FedAvg keywords that FedplugStrategy lacks: {missing}"
    assert not other_defaults, f"(FedAvg's default, FedplugStrategy's): {other_defaults}"
    assert set(DIFFERENT_DEFAULTS) <= set(flower), "a reason kept for a keyword FedAvg dropped"


# ------------------------------------------------------------- (b) the one-line swap


def test_fedavgs_keywords_run_fedavg_as_flowers_fedavg_does() -> None:
    # Prepare: the same keywords for both; every node trains (fraction_train=1.0).
    grid_flower = LoopbackGrid(quickstart_app(), NUM_NODES)
    grid_fedplug = LoopbackGrid(quickstart_app(), NUM_NODES)
    # Execute
    flower = run(FedAvg(**FEDAVG_KEYWORDS), grid_flower)
    fedplug = run(FedplugStrategy({}, model=initial_net(), **FEDAVG_KEYWORDS), grid_fedplug)
    # Assert: the same global model (the num-examples-weighted mean), and 2 of 4 nodes
    # evaluated in each round, as Flower's.
    layout = vector_layout(initial_net())
    assert torch.allclose(
        record_to_vector(fedplug.arrays, layout), record_to_vector(flower.arrays, layout), atol=1e-6
    )
    assert [len(nodes) for nodes in evaluated_nodes(grid_fedplug).values()] == [2, 2]
    # (Flower's own messages carry no round as group id: count them all.)
    assert sum(len(nodes) for nodes in evaluated_nodes(grid_flower).values()) == 2 * 2
    assert set(fedplug.evaluate_metrics_clientapp) == {1, 2}
    assert "eval_acc" in fedplug.evaluate_metrics_clientapp[2]


@pytest.mark.parametrize("algorithm", sorted(set(SERVER_SIDE) - {"fedavg"}))
def test_fedavgs_keywords_run_a_server_side_algorithm(algorithm: str) -> None:
    # Prepare
    fedavg = FedplugStrategy({}, model=initial_net(), **FEDAVG_KEYWORDS)
    other = FedplugStrategy(SERVER_SIDE[algorithm], model=initial_net(), **FEDAVG_KEYWORDS)
    # Execute
    plain = run(fedavg, LoopbackGrid(quickstart_app(), NUM_NODES), num_rounds=3)
    result = run(other, LoopbackGrid(quickstart_app(), NUM_NODES), num_rounds=3)
    # Assert: it ran every round, and its server momentum moved the model elsewhere.
    layout = vector_layout(initial_net())
    assert set(result.train_metrics_clientapp) == {1, 2, 3}
    assert not torch.allclose(
        record_to_vector(result.arrays, layout), record_to_vector(plain.arrays, layout)
    )


# --------------------------------------------------------- (c) sampled evaluation


def test_half_of_four_nodes_evaluate_each_round_the_same_ones_on_a_rerun() -> None:
    # Prepare
    grids = [LoopbackGrid(quickstart_app(), NUM_NODES) for _ in range(2)]
    # Execute
    for grid in grids:
        run(FedplugStrategy({"seed": 3}, model=initial_net(), fraction_evaluate=0.5), grid, 3)
    first, rerun = (evaluated_nodes(grid) for grid in grids)
    # Assert: 2 distinct nodes a round, chosen by the seed alone.
    assert sorted(first) == ["1", "2", "3"]
    assert all(len(set(nodes)) == 2 for nodes in first.values())
    assert first == rerun


def test_all_nodes_evaluate_at_fraction_one_none_at_zero_and_min_raises_the_count() -> None:
    # Prepare
    every_node = sorted(LoopbackGrid(quickstart_app(), NUM_NODES).get_node_ids())
    counts: dict[str, list[int]] = {}
    results: dict[str, Result] = {}
    settings = {
        "all": {"fraction_evaluate": 1.0},
        "none": {"fraction_evaluate": 0.0},
        "at least 3": {"fraction_evaluate": 0.5, "min_evaluate_nodes": 3},
        "switched off": {"federated_evaluation": False},
    }
    # Execute
    for name, keywords in settings.items():
        grid = LoopbackGrid(quickstart_app(), NUM_NODES)
        results[name] = run(FedplugStrategy({}, model=initial_net(), **keywords), grid)
        counts[name] = [len(nodes) for nodes in evaluated_nodes(grid).values()]
        if name == "all":
            assert all(sorted(nodes) == every_node for nodes in evaluated_nodes(grid).values())
    # Assert
    assert counts == {"all": [4, 4], "none": [], "at least 3": [3, 3], "switched off": []}
    assert results["none"].evaluate_metrics_clientapp == {}


def test_evaluation_sizes_out_of_range_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"fraction_evaluate \(1.5\) must be in \[0, 1\]"):
        FedplugStrategy({}, model=initial_net(), fraction_evaluate=1.5)
    with pytest.raises(ConfigError, match=r"min_evaluate_nodes \(-1\) must not be negative"):
        FedplugStrategy({}, model=initial_net(), min_evaluate_nodes=-1)


# ------------------------------------------------ (d) model= optional, record keys


def test_without_model_the_initial_arrays_give_the_same_run() -> None:
    # Prepare
    with_model = FedplugStrategy({}, model=initial_net(), fraction_train=1.0)
    without = FedplugStrategy({}, fraction_train=1.0)
    # Execute
    expected = run(with_model, LoopbackGrid(quickstart_app(), NUM_NODES))
    result = run(without, LoopbackGrid(quickstart_app(), NUM_NODES))
    # Assert: the same final model, under the initial arrays' own keys.
    layout = vector_layout(initial_net())
    assert list(result.arrays.keys()) == list(initial_arrays().keys())
    assert torch.equal(record_to_vector(result.arrays, layout), record_to_vector(expected.arrays, layout))
    assert without.run_result is not None and len(without.history) == 2


class OtherNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)


def test_a_model_that_does_not_match_the_initial_arrays_names_the_differing_keys() -> None:
    strategy = FedplugStrategy({}, model=OtherNet())
    with pytest.raises(ConfigError) as raised:
        run(strategy, LoopbackGrid(quickstart_app(), NUM_NODES))
    message = str(raised.value)
    assert "only in model=: ['head.bias', 'head.weight']" in message
    assert "only in initial_arrays: ['fc2.bias', 'fc2.weight']" in message
    assert "fc1" not in message


def test_no_model_and_no_initial_arrays_or_client_side_pieces_say_what_to_pass() -> None:
    with pytest.raises(ConfigError, match="needs initial_arrays= when given no model="):
        FedplugStrategy({}).start(grid=LoopbackGrid(quickstart_app(), NUM_NODES), num_rounds=1)
    with pytest.raises(ConfigError, match="needs model="):
        FedplugStrategy({"loss_transform": {"name": "fedprox", "mu": 0.1}})


def renamed_keys_app() -> ClientApp:
    """A ClientApp that reads the model under ``weights`` and the config under
    ``settings``, and replies with the model it got (halved) and its num-examples."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        assert set(msg.content.config_records) == {"settings"}
        arrays = msg.content["weights"].to_torch_state_dict()
        halved = {name: tensor / 2 for name, tensor in arrays.items()}
        metrics = MetricRecord({"num-examples": 1 + int(context.node_config["partition-id"])})
        return Message(RecordDict({"weights": ArrayRecord(halved), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        assert "weights" in msg.content.array_records and "settings" in msg.content.config_records
        metrics = MetricRecord({"eval_acc": 0.5, "num-examples": 2})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def test_renamed_record_keys_reach_a_clientapp_that_reads_them() -> None:
    # Prepare
    keys = {"arrayrecord_key": "weights", "configrecord_key": "settings"}
    strategy = FedplugStrategy({}, model=initial_net(), fraction_train=1.0, **keys)
    # Execute
    result = run(strategy, LoopbackGrid(renamed_keys_app(), NUM_NODES), num_rounds=1)
    # Assert: every client halved the model, so the weighted mean is half the start.
    layout = vector_layout(initial_net())
    start = record_to_vector(initial_arrays(), layout)
    assert torch.allclose(record_to_vector(result.arrays, layout), start / 2)
    assert result.evaluate_metrics_clientapp[1]["eval_acc"] == pytest.approx(0.5)


def test_record_keys_fedplug_cannot_honour_are_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="weighted_by_key='weight': fedplug weighs"):
        FedplugStrategy({}, model=initial_net(), weighted_by_key="weight")
    with pytest.raises(ConfigError, match="fedplug's client-side pieces read 'arrays'"):
        FedplugStrategy(
            {"loss_transform": {"name": "fedprox", "mu": 0.1}}, model=initial_net(), arrayrecord_key="w"
        )
