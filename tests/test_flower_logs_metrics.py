"""Issue 25, build item 4 (server side): a FedplugStrategy run logs Flower's own lines,
keeps the server's counters out of the ClientApp-side train metrics, finds the user's
accuracy under the name the user gave it, and says once what a grouper does with the
nodes.

Runs on the in-process LoopbackGrid with a scripted ClientApp whose replies are known
in advance (node k: ``num-examples`` 2 + k, ``train_loss`` 1 + k, accuracy 0.1 (k + 1)),
so every number below is computed by hand.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from fedplug.adapters.flower import FedplugStrategy, LoopbackGrid
from fedplug.adapters.flower.round_records import FedplugResult, grouping_line
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from test_flower_dropin_server import initial_net

from fedplug.components import RoundPlan

NUM_NODES = 4
SIZES = [2 + k for k in range(NUM_NODES)]
"""num-examples of node k."""
ACCURACIES = [0.1 * (k + 1) for k in range(NUM_NODES)]
"""The accuracy node k reports."""
NUM_PARAMETERS = (6 * 8 + 8) + (8 * 3 + 3)
"""The quickstart Net's parameters (fc1, fc2)."""
SERVER_COUNTERS = {"accepted", "failures", "bytes-up", "attempts"}
NAIVE_GROUPS = {"client_fraction": 1.0, "grouper": {"name": "fedgsp", "mode": "naive", "fixed_groups": 2}}
"""FedGSP with random groups: 2 groups of the 4 nodes, ceil(0.3 x 2) = 1 trains."""


def scripted_app(accuracy_key: str = "eval_acc", failing: int | None = None) -> ClientApp:
    """A quickstart-shaped ClientApp with known replies: the model back unchanged, node
    k's ``train_loss`` 1 + k and ``num-examples`` 2 + k; its accuracy 0.1 (k + 1) under
    ``accuracy_key``; node ``failing`` raises in training."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition == failing:
            raise RuntimeError("this node fails to train")
        metrics = MetricRecord({"train_loss": 1.0 + partition, "num-examples": SIZES[partition]})
        content = RecordDict({"arrays": msg.content["arrays"], "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        metrics = {
            accuracy_key: ACCURACIES[partition],
            "eval_loss": 1.0,
            "num-examples": SIZES[partition],
        }
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def run(strategy: FedplugStrategy, app: ClientApp, **options: Any) -> FedplugResult:
    return strategy.start(
        grid=LoopbackGrid(app, NUM_NODES),
        initial_arrays=ArrayRecord(initial_net().state_dict()),
        num_rounds=2,
        **options,
    )


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def strategy_for(train: dict[str, Any] | None = None, **options: Any) -> FedplugStrategy:
    return FedplugStrategy(train or {"client_fraction": 1.0}, model=initial_net(), **options)


# ------------------------------------------------------------ Flower's own lines


def test_flowers_sampling_and_aggregation_lines_with_the_right_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: half of the 4 nodes train each round, all of them evaluate.
    strategy = strategy_for(fraction_train=0.5, fraction_evaluate=1.0)
    # Execute
    with caplog.at_level(logging.INFO):
        run(strategy, scripted_app())
    lines = messages(caplog)
    # Assert: each line once per round, in Flower's words and logger.
    assert lines.count("configure_train: Sampled 2 nodes (out of 4)") == 2
    assert lines.count("aggregate_train: Received 2 results and 0 failures") == 2
    assert lines.count("configure_evaluate: Sampled 4 nodes (out of 4)") == 2
    assert lines.count("aggregate_evaluate: Received 4 results and 0 failures") == 2
    sampled = [r for r in caplog.records if r.getMessage().startswith("configure_train")]
    assert {record.name for record in sampled} == {"flwr"}


def test_a_failing_node_is_a_failure_in_flowers_line(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: every node trains; node 3 raises.
    strategy = strategy_for(fraction_train=1.0)
    # Execute
    with caplog.at_level(logging.INFO):
        run(strategy, scripted_app(failing=3))
    # Assert
    assert messages(caplog).count("aggregate_train: Received 3 results and 1 failures") == 2


# --------------------------------------------------------- server-side counters


def test_server_counters_are_not_clientapp_metrics(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: every node trains; node 3 raises, so 3 replies are accepted.
    strategy = strategy_for(fraction_train=1.0)
    # Execute
    with caplog.at_level(logging.INFO):
        result = run(strategy, scripted_app(failing=3))
    # Assert: the ClientApp-side train metrics are the clients' own, weighted by
    # num-examples by hand: (1 x 2 + 2 x 3 + 3 x 4) / (2 + 3 + 4).
    for server_round in (1, 2):
        clientapp = result.train_metrics_clientapp[server_round]
        assert set(clientapp.keys()) == {"train_loss"}
        assert clientapp["train_loss"] == pytest.approx(20 / 9)
        counters = result.train_metrics_serverapp[server_round]
        assert dict(counters.items()) == {
            "accepted": 3,
            "failures": 1,
            "bytes-up": 3 * NUM_PARAMETERS * 4,
            "attempts": 1,
        }
    assert strategy.train_metrics_serverapp == result.train_metrics_serverapp
    aggregated = [line for line in messages(caplog) if "Aggregated MetricRecord" in line]
    assert aggregated and not any(key in line for line in aggregated for key in SERVER_COUNTERS)
    assert "ServerApp-side Train Metrics" in repr(result)


# ---------------------------------------------------------------- accuracy keys


@pytest.mark.parametrize(
    ("sent_as", "accuracy_key"),
    [("eval_acc", None), ("accuracy", None), ("acc", None), ("my_acc", "my_acc")],
)
def test_the_client_accuracy_is_found_under_the_users_name(
    sent_as: str, accuracy_key: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    strategy = strategy_for(accuracy_key=accuracy_key)
    # Execute
    with caplog.at_level(logging.WARNING):
        result = run(strategy, scripted_app(accuracy_key=sent_as))
    # Assert: fedplug's client accuracy is the mean over the clients (the simulator's
    # definition) of 0.1, 0.2, 0.3, 0.4, its spread the population one; Flower's
    # aggregated record keeps the user's name only, weighted by num-examples.
    mean = sum(ACCURACIES) / NUM_NODES
    spread = math.sqrt(sum((a - mean) ** 2 for a in ACCURACIES) / NUM_NODES)
    for record in strategy.history:
        assert record.client_accuracy_mean == pytest.approx(0.25)
        assert record.client_accuracy_std == pytest.approx(spread)
    aggregated = result.evaluate_metrics_clientapp[2]
    weighted = sum(a * n for a, n in zip(ACCURACIES, SIZES, strict=True)) / sum(SIZES)
    assert aggregated[sent_as] == pytest.approx(weighted)  # 4.0 / 14
    assert sent_as == "accuracy" or "accuracy" not in aggregated
    assert "accuracy_key" not in caplog.text


def test_an_unknown_accuracy_key_is_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    strategy = strategy_for()
    # Execute
    with caplog.at_level(logging.WARNING):
        run(strategy, scripted_app(accuracy_key="top1"))
    # Assert: NaN, said once over two rounds, naming what was sent and the keyword.
    assert all(math.isnan(record.client_accuracy_mean) for record in strategy.history)
    warnings = [line for line in messages(caplog) if "accuracy_key" in line]
    assert len(warnings) == 1
    assert "'top1'" in warnings[0] and "'eval_acc'" in warnings[0]


@pytest.mark.parametrize(
    ("central", "accuracy_key", "expected"),
    [
        ({"accuracy": 0.75, "loss": 1.0}, None, 0.75),
        ({"acc": 0.75, "loss": 1.0}, None, 0.75),
        ({"top1": 0.5, "loss": 1.0}, "top1", 0.5),
        ({"top1": 0.5, "loss": 1.0}, None, math.nan),
    ],
)
def test_the_central_accuracy_is_found_under_the_users_name(
    central: dict[str, float],
    accuracy_key: str | None,
    expected: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    strategy = strategy_for(accuracy_key=accuracy_key, federated_evaluation=False)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord(central)

    # Execute
    with caplog.at_level(logging.WARNING):
        result = run(strategy, scripted_app(), evaluate_fn=evaluate_fn)
    # Assert: the round records' accuracy; Flower's Result keeps the record as returned.
    accuracies = [record.accuracy for record in strategy.history]
    assert accuracies == pytest.approx([expected] * 2, nan_ok=True)
    assert dict(result.evaluate_metrics_serverapp[1].items()) == central
    warnings = [line for line in messages(caplog) if "accuracy_key" in line]
    assert len(warnings) == (1 if math.isnan(expected) else 0)


# ------------------------------------------------------------------- the grouper


def test_the_grouper_line_says_once_how_many_groups_train_and_how_many_nodes_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: FedGSP's random groups: 2 groups of the 4 nodes, 1 of them trains.
    strategy = strategy_for(NAIVE_GROUPS)
    # Execute
    with caplog.at_level(logging.INFO):
        run(strategy, scripted_app())
    lines = messages(caplog)
    # Assert: one line for the two rounds; Flower's line counts the nodes that train,
    # its replies both exchanges of the chain of two.
    grouper = [line for line in lines if line.startswith("fedplug grouper")]
    assert grouper == [
        (
            "fedplug grouper fedgsp: the 4 sampled nodes form 2 group(s); 1 group(s) of 2 "
            "node(s) train, each group's nodes one after another; 2 sampled node(s) sit idle"
        )
    ]
    assert lines.count("configure_train: Sampled 2 nodes (out of 4)") == 2
    assert lines.count("aggregate_train: Received 2 results and 0 failures") == 2


def test_no_grouper_no_grouper_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        run(strategy_for(), scripted_app())
    assert not any(line.startswith("fedplug grouper") for line in messages(caplog))


def test_grouping_line_reads_the_plan() -> None:
    # Prepare: 10 sampled nodes in groups of 3, 3 and 4; the group of 4 trains.
    plan = RoundPlan(chains=[[9, 6, 7, 8]], groups=[[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]])
    alone = RoundPlan(chains=[[0], [1], [2]])
    # Execute / Assert
    assert grouping_line("g", plan) == (
        "fedplug grouper g: the 10 sampled nodes form 3 group(s); 1 group(s) of 4 node(s) "
        "train, each group's nodes one after another; 6 sampled node(s) sit idle"
    )
    assert grouping_line("g", alone) == (
        "fedplug grouper g: the 3 sampled nodes form 3 group(s); 3 group(s) of 1 node(s) "
        "train; 0 sampled node(s) sit idle"
    )
    assert grouping_line("g", RoundPlan(chains=[])) is None
