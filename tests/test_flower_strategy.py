"""FedplugStrategy and the ready ClientApp, delivered in-process by LoopbackGrid (no Ray):
equivalence with the built-in simulator, FedGSP hand-offs through the server, priors by
query, and failure handling."""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import pytest
import torch
from fedplug.adapters.flower import FedplugStrategy, LoopbackGrid, make_client_app, run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.nodes import (
    experiment_message_config,
    handle_evaluate,
    handle_query,
    handle_train,
)
from fedplug.adapters.flower.records import (
    CHAIN_POSITION,
    CONFIG_KEY,
    LOSS_INFO_KEY,
    LOSS_STATE_KEY,
    MODEL_KEY,
    decode_loss_state,
    model_record,
    record_to_vector,
    vector_layout,
)
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from fedplug.algorithms.fedshift import global_prior
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.local_training import (
    ClientAlgorithm,
    LocalSchedule,
    local_rng,
    train_locally,
)
from fedplug.run.model import build_model
from fedplug.run.vectors import model_to_vector

FEDGSP = {
    "grouper": {
        "name": "fedgsp",
        "mode": "fedgsp",
        "growth": "log",
        "alpha": 2.0,
        "beta": 1.0,
        "group_fraction": 0.5,
    },
    "client_fraction": 1.0,
}
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"loss_transform": {"name": "fedprox", "mu": 0.1}},
    "iwds": {"sampler": {"name": "iwds"}},
    "fedshift": {"loss_transform": {"name": "fedshift"}},
    "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.9}},
    "scaffold": {"aggregator": {"name": "scaffold"}},
    "fednova": {"aggregator": {"name": "fednova"}},
    "fedgsp": FEDGSP,
}
NUM_CLIENTS = 4


def experiment(base: dict[str, Any], train: dict[str, Any]) -> Any:
    data = copy.deepcopy(base)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update({"rounds": 2, **train})
    return validate_experiment(data)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_flower_run_equals_simulator(small_experiment: dict[str, Any], name: str) -> None:
    # Prepare
    config = experiment(small_experiment, ALGORITHMS[name])
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    # Execute: the same experiment through Flower messages and through the simulator.
    flower, strategy = run_on_grid(grid, config)
    simulated, simulator = run_experiment(config, None)
    # Assert: the same global model and the same per-round records.
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-6)
    for ours, theirs in zip(flower.history, simulated.history, strict=True):
        mine, reference = ours.as_dict(), theirs.as_dict()
        for key in ("seconds", "client_accuracy_mean", "client_accuracy_std"):
            assert mine.pop(key) == pytest.approx(reference.pop(key), abs=1e-9) or key == "seconds"
        assert mine == reference


def test_fedgsp_chain_models_travel_through_the_server(small_experiment: dict[str, Any]) -> None:
    # Prepare: round 1 of FedGSP with K = 4, beta = 1 is one group of four: a chain.
    config = experiment(small_experiment, {**FEDGSP, "rounds": 1})
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    replies: list[Message] = []
    deliver = grid._deliver

    def recording(message: Message) -> Message | None:
        reply = deliver(message)
        if reply is not None and message.metadata.message_type == "train":
            replies.append(reply)
        return reply

    grid._deliver = recording  # type: ignore[method-assign]
    # Execute
    _, strategy = run_on_grid(grid, config, federated_evaluation=False)
    # Assert: one exchange per chain position, each handing on the previous reply's model.
    trains = [message for message in grid.delivered if message.metadata.message_type == "train"]
    assert [int(message.content[CONFIG_KEY][CHAIN_POSITION]) for message in trains] == [0, 1, 2, 3]
    assert sorted(int(message.content[CONFIG_KEY]["fedplug.client-id"]) for message in trains) == [
        0,
        1,
        2,
        3,
    ]
    layout = vector_layout(strategy.model)
    for sent, previous_reply in zip(trains[1:], replies[:-1]):
        torch.testing.assert_close(
            record_to_vector(sent.content[MODEL_KEY], layout),
            record_to_vector(previous_reply.content[MODEL_KEY], layout),
        )
    torch.testing.assert_close(
        strategy.final_vector, record_to_vector(replies[-1].content[MODEL_KEY], layout)
    )


def test_flowers_own_start_drives_the_strategy(small_experiment: dict[str, Any]) -> None:
    # Prepare: FedGSP (chains of several members) for two rounds.
    config = experiment(small_experiment, FEDGSP)
    _, reference = run_on_grid(
        LoopbackGrid(make_client_app(), NUM_CLIENTS), config, federated_evaluation=False
    )
    strategy = FedplugStrategy(
        config.train,
        num_clients=NUM_CLIENTS,
        num_classes=4,
        input_shape=(12,),
        message_config=experiment_message_config(config),
        federated_evaluation=False,
    )
    # Execute: Flower's base Strategy.start, which knows nothing of setup or hand-offs.
    result = Strategy.start(
        strategy,
        LoopbackGrid(make_client_app(), NUM_CLIENTS),
        model_record(strategy.model),
        num_rounds=config.train.rounds,
    )
    # Assert: the same final model as fedplug's own start.
    torch.testing.assert_close(
        record_to_vector(result.arrays, vector_layout(strategy.model)),
        reference.final_vector,
        rtol=0,
        atol=0,
    )


def test_priors_come_from_the_query(small_experiment: dict[str, Any]) -> None:
    # Prepare
    config = experiment(small_experiment, {"loss_transform": {"name": "fedshift"}, "rounds": 1})
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    # Execute
    _, strategy = run_on_grid(grid, config, federated_evaluation=False)
    # Assert: the gathered counts are the federation's; the prior sent is FedShift's P(y).
    federation = build_federation(config.data, default_registry())
    assert strategy.directory is not None
    np.testing.assert_array_equal(strategy.directory.class_counts, federation.class_counts)
    queries = [message for message in grid.delivered if message.metadata.message_type == "query"]
    assert len(queries) == NUM_CLIENTS and all(
        MODEL_KEY not in message.content for message in queries
    )
    train = next(message for message in grid.delivered if message.metadata.message_type == "train")
    state = decode_loss_state(
        train.content.array_records[LOSS_STATE_KEY], train.content.config_records[LOSS_INFO_KEY]
    )
    assert state is not None
    np.testing.assert_allclose(state["prior"], global_prior(federation.class_counts))


def faulty_client_app(
    raise_on: set[int] = frozenset(),
    nan_on: set[int] = frozenset(),
    misshapen_on: set[int] = frozenset(),
    raise_first_only: bool = False,
) -> ClientApp:
    """The ready ClientApp, except that some nodes raise or send broken models."""
    raised: set[int] = set()
    app = ClientApp()
    # like make_client_app: it builds whatever the server's config names
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.evaluate()(handle_evaluate)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition in raise_on and not (raise_first_only and partition in raised):
            raised.add(partition)
            raise RuntimeError(f"injected failure on client {partition}")
        reply = handle_train(message, context)
        arrays = reply.content.array_records[MODEL_KEY]
        first = next(iter(arrays))
        if partition in nan_on:
            broken = arrays[first].numpy().copy()
            broken.flat[0] = np.nan
            arrays[first] = Array(broken)
        if partition in misshapen_on:
            arrays[first] = Array(np.zeros(3, dtype=np.float32))
        return reply

    return app


def fedavg_of(config: Any, clients: list[int]) -> torch.Tensor:
    """Round 1 of FedAvg over ``clients``, computed directly with the shared client loop."""
    registry = default_registry()
    federation = build_federation(config.data, registry)
    model = build_model(config.train, registry, federation, torch.device("cpu"))
    start = model_to_vector(model)
    train = config.train
    algorithm = ClientAlgorithm(
        registry.build("samplers", train.sampler),
        registry.build("loss_transforms", train.loss_transform),
        registry.build("aggregators", train.aggregator, NUM_CLIENTS),
    )
    total, weight = torch.zeros_like(start, dtype=torch.float64), 0.0
    for client_id in clients:
        client = federation.clients[client_id]
        result = train_locally(
            model,
            start,
            client.train_x,
            client.train_y,
            client.class_counts,
            algorithm=algorithm,
            loss_context={},
            payload={},
            client_state={},
            schedule=LocalSchedule(train.local_epochs, train.batch_size, train.optimizer),
            round_index=0,
            rng=local_rng(train.seed, 0, client_id),
        )
        total += result.vector.double() * result.num_samples
        weight += result.num_samples
    return (total / weight).float()


def test_a_raising_node_is_counted_and_the_round_completes(
    small_experiment: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: every client trains; client 1's ClientApp raises.
    config = experiment(small_experiment, {"rounds": 1, "client_fraction": 1.0})
    grid = LoopbackGrid(faulty_client_app(raise_on={1}), NUM_CLIENTS)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedplug.adapters.flower"):
        result, strategy = run_on_grid(grid, config)
    # Assert: one failure, logged with its cause; the model is FedAvg of the other three.
    record = result.history[0]
    assert (record.participants, record.failures) == (4, 1)
    assert "dropped client(s) [1]: client 1 raised during training" in caplog.text
    assert "injected failure on client 1" in caplog.text
    torch.testing.assert_close(
        strategy.final_vector, fedavg_of(config, [0, 2, 3]), rtol=0, atol=1e-6
    )


def test_nan_and_misshapen_replies_are_rejected_with_reasons(
    small_experiment: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    config = experiment(small_experiment, {"rounds": 1, "client_fraction": 1.0})
    grid = LoopbackGrid(faulty_client_app(nan_on={2}, misshapen_on={3}), NUM_CLIENTS)
    with caplog.at_level(logging.WARNING, logger="fedplug.adapters.flower"):
        result, strategy = run_on_grid(grid, config)
    assert result.history[0].failures == 2
    # The last member's model is screened by the round core, in the simulator's words.
    assert "dropped client(s) [2]: returned non-finite (NaN/Inf) parameters" in caplog.text
    assert (
        "dropped client(s) [3]: client 3 returned '1.weight' of shape (3,), expected (16, 12)"
        in caplog.text
    )
    torch.testing.assert_close(strategy.final_vector, fedavg_of(config, [0, 1]), rtol=0, atol=1e-6)


def test_too_many_failures_retry_the_round_then_stop(small_experiment: dict[str, Any]) -> None:
    config = experiment(
        small_experiment,
        {
            "rounds": 1,
            "client_fraction": 1.0,
            "failures": {"max_failed_fraction": 0.25, "max_round_retries": 2},
        },
    )
    grid = LoopbackGrid(faulty_client_app(raise_on={0, 1}), NUM_CLIENTS)
    with pytest.raises(
        TrainingError, match=r"round 1: 2 of 4 client updates failed in each of 3 attempts"
    ):
        run_on_grid(grid, config)
    assert (
        sum(message.metadata.message_type == "train" for message in grid.delivered)
        == 3 * NUM_CLIENTS
    )


def test_a_round_where_every_client_fails_is_retried(small_experiment: dict[str, Any]) -> None:
    # Prepare: every ClientApp raises once, so attempt 1 brings the aggregator no update
    # (FedAvg raises TrainingError on none); train.failures allows one retry.
    config = experiment(
        small_experiment,
        {"rounds": 1, "client_fraction": 1.0, "failures": {"max_round_retries": 1}},
    )
    grid = LoopbackGrid(
        faulty_client_app(raise_on=set(range(NUM_CLIENTS)), raise_first_only=True), NUM_CLIENTS
    )
    # Execute
    flower, strategy = run_on_grid(grid, config)
    # Assert: the round ran twice and ended as if nothing had failed.
    assert (
        sum(message.metadata.message_type == "train" for message in grid.delivered)
        == 2 * NUM_CLIENTS
    )
    assert flower.history[0].failures == 0
    torch.testing.assert_close(
        strategy.final_vector, fedavg_of(config, list(range(NUM_CLIENTS))), rtol=0, atol=1e-6
    )


def test_a_bad_chain_member_stops_its_chain(
    small_experiment: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: round 1 of FedGSP is one chain of the four clients; its second member
    # sends NaN. One failed chain of one is tolerated, and never retried.
    config = experiment(
        small_experiment,
        {**FEDGSP, "rounds": 1, "failures": {"max_failed_fraction": 1.0, "max_round_retries": 0}},
    )
    app = ClientApp()
    app.query()(handle_query)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        reply = handle_train(message, context)
        if int(message.content[CONFIG_KEY][CHAIN_POSITION]) == 1:
            arrays = reply.content.array_records[MODEL_KEY]
            first = next(iter(arrays))
            broken = arrays[first].numpy().copy()
            broken.flat[0] = np.nan
            arrays[first] = Array(broken)
        return reply

    grid = LoopbackGrid(app, NUM_CLIENTS)
    # Execute: the only chain fails, so the round has no usable update and stops.
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingError, match=r"1 of 1 client updates failed"):
        run_on_grid(grid, config, federated_evaluation=False)
    # Assert: nobody trained after the bad member, and the reason names it.
    trains = [message for message in grid.delivered if message.metadata.message_type == "train"]
    assert [int(message.content[CONFIG_KEY][CHAIN_POSITION]) for message in trains] == [0, 1]
    bad = int(trains[1].content[CONFIG_KEY]["fedplug.client-id"])
    assert f"client {bad} returned non-finite (NaN/Inf) parameters" in caplog.text


def test_derived_params_are_the_simulators(small_experiment: dict[str, Any]) -> None:
    # Prepare: FedAvgM with momentum 0.9 and server_lr 1.0; the clients' lr is the config's.
    config = experiment(
        small_experiment, {"rounds": 1, "aggregator": {"name": "fedavgm", "momentum": 0.9}}
    )
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    # Execute
    flower, _ = run_on_grid(grid, config, federated_evaluation=False)
    simulated, _ = run_experiment(config, None)
    # Assert: client_lr * server_lr / (1 - momentum), as the simulator logs it.
    expected = config.train.optimizer.lr * 1.0 / (1 - 0.9)
    assert flower.derived_params["effective_learning_rate"] == pytest.approx(expected)
    assert flower.derived_params["engine"] == "flower"
    for key in ("effective_learning_rate", "model_bytes", "train_flops_per_sample"):
        assert flower.derived_params[key] == simulated.derived_params[key]


def test_a_retried_round_restores_scaffold_client_state(small_experiment: dict[str, Any]) -> None:
    # Prepare: client 1 fails once; no failure is tolerated, so round 1 runs twice. The
    # clients that trained in the failed attempt must start the retry from the same c_k.
    train = {
        "aggregator": {"name": "scaffold"},
        "client_fraction": 1.0,
        "failures": {"max_failed_fraction": 0.0, "max_round_retries": 1},
    }
    config = experiment(small_experiment, train)
    grid = LoopbackGrid(faulty_client_app(raise_on={1}, raise_first_only=True), NUM_CLIENTS)
    # Execute
    flower, strategy = run_on_grid(grid, config)
    _, simulator = run_experiment(config, None)
    # Assert: as if nothing had failed.
    assert (
        sum(message.metadata.message_type == "train" for message in grid.delivered)
        == 3 * NUM_CLIENTS
    )
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-6)
    assert flower.history[0].failures == 0


def test_a_node_that_left_is_a_failure(
    small_experiment: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    config = experiment(small_experiment, {"rounds": 1, "client_fraction": 1.0})
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    deliver = grid._deliver

    def leave_after_query(message: Message) -> Message | None:
        reply = deliver(message)
        if message.metadata.message_type == "query" and message.metadata.dst_node_id == max(
            grid.contexts
        ):
            grid.connected.discard(message.metadata.dst_node_id)
        return reply

    grid._deliver = leave_after_query  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="fedplug.adapters.flower"):
        result, strategy = run_on_grid(grid, config)
    assert result.history[0].failures == 1
    assert "is no longer connected" in caplog.text
    torch.testing.assert_close(
        strategy.final_vector, fedavg_of(config, [0, 1, 2]), rtol=0, atol=1e-6
    )


def test_nodes_with_the_wrong_partition_count_are_refused(small_experiment: dict[str, Any]) -> None:
    config = experiment(small_experiment, {"rounds": 1})
    node_configs = [{"partition-id": k, "num-partitions": 3} for k in range(NUM_CLIENTS)]
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS, node_configs=node_configs)
    with pytest.raises(
        TrainingError, match=r"failed to report its class counts: .*num-partitions=4"
    ):
        run_on_grid(grid, config)


def test_feddisk_ab_is_refused_with_its_reason_and_feddisk_is_not(
    small_experiment: dict[str, Any],
) -> None:
    oracle = experiment(small_experiment, {"loss_transform": {"name": "feddisk_ab"}})
    with pytest.raises(
        ConfigError, match=r"'feddisk_ab' cannot run on Flower: .*pools raw client data"
    ):
        FedplugStrategy(oracle.train, num_clients=NUM_CLIENTS, num_classes=4, input_shape=(12,))
    feddisk = experiment(small_experiment, {"loss_transform": {"name": "feddisk"}})
    strategy = FedplugStrategy(
        feddisk.train, num_clients=NUM_CLIENTS, num_classes=4, input_shape=(12,)
    )
    assert strategy.config.loss_transform.name == "feddisk"
