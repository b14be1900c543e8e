"""The capability exchange (issue 25, item 3): a FedplugStrategy whose config needs fedplug
pieces in the ClientApp asks ONE node what its app provides before any query, setup
phase or train message, and stops with one line naming the own-loop piece to add."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from fedplug.adapters.flower import FedplugLoss, FedplugStrategy, LoopbackGrid, RoundSampler
from fedplug.adapters.flower.capabilities import (
    CAPABILITY_QUERY,
    Capabilities,
    missing_pieces,
)
from fedplug.adapters.flower.requirements import Component
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedplug.errors import TrainingError

NUM_NODES = 3
NUM_FEATURES = 4
NUM_CLASSES = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(NUM_FEATURES, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def trainset(context: Context) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
    inputs = torch.randn(6, NUM_FEATURES, generator=generator)
    return [(inputs[index], index % NUM_CLASSES) for index in range(6)]


def stock_app(trained: list[int], loss: FedplugLoss | None = None) -> ClientApp:
    """A quickstart-shaped ClientApp; ``trained`` records every train call's node."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        trained.append(context.node_id)
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = trainset(context)
        criterion = loss.begin_round(msg, context, model, data) if loss else nn.CrossEntropyLoss()
        for inputs, label in data:
            optimizer.zero_grad()
            criterion(model(inputs[None]), torch.tensor([label])).backward()
            optimizer.step()
        metrics = MetricRecord({"num-examples": len(data)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        if loss is not None:
            loss.finish_round(content, optimizer)
        return Message(content, reply_to=msg)

    return app


class CountingGrid(LoopbackGrid):
    """A LoopbackGrid that records the type of every message sent to a node."""

    def __init__(self, app: ClientApp) -> None:
        super().__init__(app, NUM_NODES)
        self.sent: list[str] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.sent.extend(message.metadata.message_type for message in messages)
        return super().push_messages(messages)


def start(train: dict[str, Any], grid: CountingGrid, **options: Any) -> Any:
    strategy = FedplugStrategy(
        {"rounds": 1, **train}, model=Net(), federated_evaluation=False, **options
    )
    return strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1
    )


SCAFFOLD = {"aggregator": {"name": "scaffold"}}
FEDSHIFT = {"loss_transform": {"name": "fedshift"}}


def test_a_stock_client_app_stops_a_scaffold_server_before_any_client_trains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trained: list[int] = []
    grid = CountingGrid(stock_app(trained))
    with pytest.raises(TrainingError) as raised, caplog.at_level(logging.INFO, logger="flwr"):
        start(SCAFFOLD, grid)
    line = str(raised.value)
    assert "\n" not in line
    assert "FedplugLoss(aggregator={'name': 'scaffold'}, app=app)" in line
    assert "finish_round(content)" in line
    assert trained == []
    assert grid.sent == [CAPABILITY_QUERY]
    # the "must add" hint is the error, not a log line before it
    assert not any("must add" in record.getMessage() for record in caplog.records)


def test_a_stock_client_app_stops_a_fedshift_server_after_one_query() -> None:
    trained: list[int] = []
    grid = CountingGrid(stock_app(trained))
    with pytest.raises(TrainingError, match=r"FedplugLoss\(loss_transform=\{'name': 'fedshift'\}"):
        start(FEDSHIFT, grid, num_classes=NUM_CLASSES)
    assert grid.sent == [CAPABILITY_QUERY]  # one node asked, no class-count query
    assert trained == []


def test_a_client_app_with_the_pieces_passes_and_no_hint_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trained: list[int] = []
    app = ClientApp()
    loss = FedplugLoss(aggregator={"name": "scaffold"}, app=app)
    _register_train(app, trained, loss)
    grid = CountingGrid(app)
    with caplog.at_level(logging.INFO, logger="flwr"):
        start(SCAFFOLD, grid)
    messages = [record.getMessage() for record in caplog.records]
    # no "must add" hint anywhere: the ClientApp has the piece
    assert not any("must add" in m for m in messages)
    assert any("the ClientApp provides" in message and "'scaffold'" in message for message in messages)
    assert grid.sent[0] == CAPABILITY_QUERY
    assert grid.sent.count(CAPABILITY_QUERY) == 1
    assert sorted(trained) == sorted(grid.get_node_ids())


def _register_train(app: ClientApp, trained: list[int], loss: FedplugLoss) -> None:
    donor = stock_app(trained, loss)
    app.train()(donor._registered_funcs["train.default"])  # the same train function


def test_a_client_whose_loss_runs_another_aggregator_is_named_with_both() -> None:
    trained: list[int] = []
    app = ClientApp()
    loss = FedplugLoss(aggregator={"name": "fedavg"}, app=app)
    _register_train(app, trained, loss)
    grid = CountingGrid(app)
    with pytest.raises(TrainingError) as raised:
        start(SCAFFOLD, grid)
    line = str(raised.value)
    assert "train.aggregator is 'scaffold' on the server but 'fedavg' in the ClientApp" in line
    assert trained == []
    assert grid.sent == [CAPABILITY_QUERY]


def test_fedshift_needs_the_query_handler_that_data_registers() -> None:
    app = ClientApp()
    FedplugLoss(loss_transform={"name": "fedshift"}, app=app, data=trainset)
    without_data = ClientApp()
    RoundSampler({"name": "iwds"}, app=without_data)
    fedshift = [Component("loss_transform", "fedshift", _component(FEDSHIFT, "loss_transform"))]
    from fedplug.adapters.flower.capabilities import _declared, handlers_of

    provided = Capabilities(frozenset(_declared[app]), frozenset(handlers_of(app)))
    assert missing_pieces(provided, fedshift, [], class_counts=True) == []
    sampler_only = Capabilities(frozenset(_declared[without_data]), frozenset(handlers_of(without_data)))
    missing = missing_pieces(sampler_only, fedshift, [], class_counts=True)
    assert len(missing) == 2
    assert "FedplugLoss(loss_transform={'name': 'fedshift'}, app=app, data=" in missing[0]
    assert "class counts" in missing[1]


def _component(train: dict[str, Any], slot: str) -> Any:
    from fedplug.config import validate_section
    from fedplug.plugins import default_registry
    from fedplug.run.components import Components

    config = validate_section("train", train, default_registry())
    return Components.build(config, default_registry(), num_clients=1).by_slot()[slot]


@pytest.mark.parametrize(
    "train",
    [{}, {"aggregator": {"name": "fedavgm", "momentum": 0.9, "server_lr": 1.0}}],
    ids=["fedavg", "fedavgm"],
)
def test_a_config_that_needs_nothing_from_clients_sends_no_probe(
    train: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    trained: list[int] = []
    grid = CountingGrid(stock_app(trained))
    with caplog.at_level(logging.INFO, logger="flwr"):
        start(train, grid)
    assert CAPABILITY_QUERY not in grid.sent
    assert not any("ClientApp provides" in record.getMessage() for record in caplog.records)
    assert len(trained) == NUM_NODES
