"""FedDisk on Flower: phase 1, its setup phase, over ``train.feddisk`` messages delivered
in-process by LoopbackGrid, against the built-in simulator; its traffic; failures during
it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import (
    FedplugStrategy,
    FedplugTrainer,
    LoopbackGrid,
    make_client_app,
    run_on_grid,
)
from fedplug.adapters.flower.capabilities import (
    ANY_COMPONENT,
    CAPABILITY_QUERY,
    CLIENT_SLOTS,
    declare,
)
from fedplug.adapters.flower.loopback import FIRST_NODE_ID, ensure_task_identity
from fedplug.adapters.flower.nodes import (
    EXPERIMENT_ID,
    experiment_message_config,
    handle_evaluate,
    handle_query,
    handle_setup_phase,
    handle_train,
)
from fedplug.adapters.flower.records import CONFIG_KEY, MODEL_KEY, model_record
from fedplug.adapters.flower.setup_phase import (
    REPORT_KEY,
    STEP,
    TENSORS_KEY,
    VALUES_KEY,
    load_phase_state,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fedplug.algorithms.feddisk import (
    SAMPLE_WEIGHT_KEY,
    FedDiskConfig,
    FedDiskPhase,
    compute_feddisk_weights,
)
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry

NUM_CLIENTS = 3
FEDDISK_ACTION = "feddisk"
FEDDISK_MESSAGE_TYPE = f"train.{FEDDISK_ACTION}"
FEDDISK = {
    "name": "feddisk",
    "made_hidden": 8,
    "made_max_epochs": 10,
    "made_batch_size": 32,
    "classifier_epochs": 20,
    "classifier_lr": 0.5,
}
PHASES: dict[str, dict[str, Any]] = {
    # The global MADE improves in every round: it runs all 3.
    "cap": {"made_lr": 0.05, "global_rounds": 3},
    # The federated validation NLL rises before the cap: the model before the rise is kept.
    "rise": {"made_lr": 0.1, "made_features": "observed", "global_rounds": 6},
}


def node_weights(context: Context, namespace: str) -> torch.Tensor:
    """The sample weights FedDisk's setup phase left on a node."""
    state = load_phase_state(context, namespace, FEDDISK_ACTION)
    return FedDiskPhase(FedDiskConfig()).client_context(state)[SAMPLE_WEIGHT_KEY]


def feddisk_experiment(phase: str, **train: Any) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update(
        {
            "rounds": 2,
            "client_fraction": 1.0,
            "loss_transform": {**FEDDISK, **PHASES[phase]},
            **train,
        }
    )
    return validate_experiment(data)


@dataclass
class FlowerRun:
    phase: str
    """Which entry of PHASES the run used."""
    config: Any
    result: Any
    strategy: Any
    grid: LoopbackGrid
    replies: list[Message]
    """The nodes' replies to phase-1 messages, in delivery order."""

    def node_weights(self, client: int) -> torch.Tensor:
        """The sample weights phase 1 left on client ``client``'s node."""
        namespace = f"fedplug.{experiment_message_config(self.config)[EXPERIMENT_ID]}"
        return node_weights(self.grid.contexts[FIRST_NODE_ID + client], namespace)


def run_recorded(phase: str) -> FlowerRun:
    """``run_on_grid`` of :func:`feddisk_experiment` on a LoopbackGrid running the ready
    ClientApp, recording the phase-1 replies."""
    config = feddisk_experiment(phase)
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    replies: list[Message] = []
    deliver = grid._deliver

    def recording(message: Message) -> Message | None:
        reply = deliver(message)
        if reply is not None and message.metadata.message_type == FEDDISK_MESSAGE_TYPE:
            replies.append(reply)
        return reply

    grid._deliver = recording  # type: ignore[method-assign]
    result, strategy = run_on_grid(grid, config)
    return FlowerRun(phase, config, result, strategy, grid, replies)


@pytest.fixture(scope="module", params=sorted(PHASES))
def runs(request: pytest.FixtureRequest) -> tuple[FlowerRun, Any, Any]:
    """One FedDisk experiment through Flower messages and through the simulator."""
    flower = run_recorded(request.param)
    simulated, simulator = run_experiment(flower.config, None)
    return flower, simulated, simulator


# ----------------------------------------------------------------- equivalence


def test_weights_on_the_nodes_equal_the_simulators(runs: tuple[FlowerRun, Any, Any]) -> None:
    # Prepare / Execute: both runs happened in the fixture.
    flower, _, simulator = runs
    reference = simulator.algorithm.loss_transform.weights
    # Assert: every node holds the weights the simulator computed for its client, and
    # they are not trivially all ones (so the loss below really is weighted).
    for client in range(NUM_CLIENTS):
        torch.testing.assert_close(
            flower.node_weights(client), reference[client], rtol=0, atol=1e-6
        )
    assert max(float((weights - 1).abs().max()) for weights in reference) > 0.01


def test_two_rounds_equal_the_simulator(runs: tuple[FlowerRun, Any, Any]) -> None:
    flower, simulated, simulator = runs
    cost = flower.strategy.setup_cost
    # The two phases end differently: at the cap, and at a rise before it.
    cap = flower.config.train.loss_transform.global_rounds
    assert cost.rounds < cap if flower.phase == "rise" else cost.rounds == cap
    assert cost == simulator.algorithm.loss_transform.cost
    assert (flower.result.setup_rounds, flower.result.setup_bytes) == (
        simulated.setup_rounds,
        simulated.setup_bytes,
    )
    # The setup report, assembled from the clients' reports on both runtimes, is the same
    # and counts every client's samples.
    assert flower.result.setup_report == simulated.setup_report
    counts = flower.result.setup_report["sample_weight.histogram"]["counts"]
    assert sum(counts) == sum(len(weights) for weights in simulator.algorithm.loss_transform.weights)
    torch.testing.assert_close(
        flower.strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-6
    )
    for ours, theirs in zip(flower.result.history, simulated.history, strict=True):
        mine, reference = ours.as_dict(), theirs.as_dict()
        for key in ("seconds", "client_accuracy_mean", "client_accuracy_std"):
            assert mine.pop(key) == pytest.approx(reference.pop(key), abs=1e-9) or key == "seconds"
        assert mine == reference


def test_a_users_client_app_with_a_data_loader_gets_the_same_weights() -> None:
    # Prepare: a user's own ClientApp (FedplugTrainer on DataLoaders, default state
    # namespace) under FedplugStrategy, and the simulator's phase 1 on the same shards.
    config = feddisk_experiment("cap")
    federation = build_federation(config.data, default_registry())
    loss_config = config.train.loss_transform
    reference = compute_feddisk_weights(
        federation, loss_config, np.random.default_rng(loss_config.seed)
    )
    loaders = [
        DataLoader(TensorDataset(client.train_x, client.train_y), batch_size=16)
        for client in federation.clients
    ]
    app = ClientApp()
    trainer = FedplugTrainer(config.train, num_classes=federation.num_classes, app=app)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        loader = loaders[int(context.node_config["partition-id"])]
        return trainer.describe(loader, message, context)

    @app.train(FEDDISK_ACTION)
    def feddisk(message: Message, context: Context) -> Message:
        loader = loaders[int(context.node_config["partition-id"])]
        return trainer.setup_phase(loader, message, context)

    grid = LoopbackGrid(app, NUM_CLIENTS)
    strategy = FedplugStrategy(
        config.train,
        num_clients=NUM_CLIENTS,
        num_classes=federation.num_classes,
        input_shape=federation.input_shape,
    )
    # Execute
    strategy.setup(grid)
    # Assert
    assert strategy.setup_cost == reference.cost
    for client, weights in enumerate(reference.weights):
        held = node_weights(grid.contexts[FIRST_NODE_ID + client], "fedplug")
        torch.testing.assert_close(held, torch.as_tensor(weights), rtol=0, atol=1e-6)


# --------------------------------------------------------------- the messages


def array_bytes(record: ArrayRecord | None) -> int:
    return 0 if record is None else sum(array.numpy().nbytes for array in record.values())


def test_phase_one_messages_carry_only_made_parameters_and_scalars(
    runs: tuple[FlowerRun, Any, Any],
) -> None:
    flower, _, _ = runs
    sent = [
        message
        for message in flower.grid.delivered
        if message.metadata.message_type == FEDDISK_MESSAGE_TYPE
    ]
    rounds = flower.strategy.setup_cost.rounds
    # One message per node per exchange: range, local (round 1), then evaluate / train
    # alternating, the last evaluate showing the stop, then weights.
    steps = ["range", "local", *["evaluate", "train"] * (rounds - 1), "evaluate", "weights"]
    assert [str(message.content[CONFIG_KEY][STEP]) for message in sent] == [
        step for step in steps for _ in range(NUM_CLIENTS)
    ]
    # The traffic reported is the MADE parameters that travelled; each client's report of
    # its weights (9 statistics and 40 counts) rides on its last reply, not counted.
    cost = flower.strategy.setup_cost
    assert sum(array_bytes(m.content.array_records.get(TENSORS_KEY)) for m in sent) == (
        cost.bytes_down
    )
    reports = [r.content.config_records[REPORT_KEY] for r in flower.replies if REPORT_KEY in r.content.config_records]
    assert len(reports) == NUM_CLIENTS
    assert all(len(report["histogram_counts"]) == 40 and len(report) == 10 for report in reports)
    assert sum(array_bytes(r.content.array_records.get(TENSORS_KEY)) for r in flower.replies) == cost.bytes_up
    made_names = {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}
    for reply in flower.replies:
        assert set(reply.content.array_records) <= {TENSORS_KEY}
        assert set(reply.content.array_records.get(TENSORS_KEY, {})) in (set(), made_names)
        assert set(reply.content.config_records[VALUES_KEY]) <= {
            "num-samples",
            "input-dim",
            "input-min",
            "input-max",
            "validation-nll",
            "classifier-epochs",
            "classifier-best-epoch",
        }
    # Later train messages carry no weights: they stay on the nodes.
    trains = [m for m in flower.grid.delivered if m.metadata.message_type == MessageType.TRAIN]
    assert trains and all(set(m.content.array_records) == {MODEL_KEY} for m in trains)


# --------------------------------------------------------------------- failures


def client_app_failing_at(step: str, client: int) -> ClientApp:
    """The ready ClientApp, except that ``client``'s node raises at phase-1 ``step``."""
    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.train()(handle_train)
    app.evaluate()(handle_evaluate)

    @app.train(FEDDISK_ACTION)
    def feddisk(message: Message, context: Context) -> Message:
        if (
            str(message.content[CONFIG_KEY][STEP]) == step
            and int(context.node_config["partition-id"]) == client
        ):
            raise RuntimeError(f"injected failure on client {client}")
        return handle_setup_phase(message, context)

    return app


def test_a_node_failing_in_phase_one_stops_the_run_naming_it() -> None:
    config = feddisk_experiment("cap")
    grid = LoopbackGrid(client_app_failing_at("train", 1), NUM_CLIENTS)
    with pytest.raises(
        TrainingError,
        match=r"setup phase 'feddisk', step 'train': client 1 \(node 1001\) raised: .*injected "
        r"failure on client 1.*needs every client",
    ):
        run_on_grid(grid, config)
    assert not any(m.metadata.message_type == MessageType.TRAIN for m in grid.delivered)


def test_a_node_that_leaves_during_phase_one_stops_the_run() -> None:
    config = feddisk_experiment("cap")
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    deliver = grid._deliver

    def leave_after_local(message: Message) -> Message | None:
        reply = deliver(message)
        leaving = FIRST_NODE_ID + 2
        if message.metadata.message_type != FEDDISK_MESSAGE_TYPE:
            return reply
        step = str(message.content[CONFIG_KEY].get(STEP, ""))
        if message.metadata.dst_node_id == leaving and step == "local":
            grid.connected.discard(leaving)
        return reply

    grid._deliver = leave_after_local  # type: ignore[method-assign]
    with pytest.raises(
        TrainingError, match=r"step 'evaluate': client 2 \(node 1002\) sent no reply"
    ):
        run_on_grid(grid, config)


def test_a_client_app_without_the_feddisk_handler_is_told_how_to_add_it() -> None:
    # The ready ClientApp's handlers, but no @app.train('feddisk'): the capability
    # exchange finds the missing phase handler before phase 1 or any training starts.
    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.train()(handle_train)
    grid = LoopbackGrid(app, NUM_CLIENTS)
    with pytest.raises(
        TrainingError,
        match=r"^[^\n]*the setup phase 'feddisk' runs before round 1: [^\n]*"
        r"@app\.train\('feddisk'\)[^\n]*$",
    ):
        run_on_grid(grid, feddisk_experiment("cap"))
    sent = {message.metadata.message_type for message in grid.delivered}
    assert sent == {CAPABILITY_QUERY}


def test_training_without_phase_one_weights_is_a_config_error() -> None:
    # Prepare: a FedDisk trainer on a node that never took part in phase 1.
    ensure_task_identity()
    trainer = FedplugTrainer.from_config({"loss_transform": {"name": "feddisk"}}, num_classes=2)
    model = torch.nn.Linear(3, 2)
    message = Message(
        RecordDict({MODEL_KEY: model_record(model), CONFIG_KEY: ConfigRecord({})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    context = Context(1, 1, {}, RecordDict(), {})
    data = (torch.zeros(4, 3), torch.tensor([0, 1, 0, 1]))
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"sample weights are not on this node.*train\.feddisk"):
        trainer.fit(model, data, message, context)
