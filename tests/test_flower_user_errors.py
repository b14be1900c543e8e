"""A documented misconfiguration shows in a Flower user's log as one line, not as
tracebacks (issue 25): a ClientApp's fedplug ConfigError becomes an error reply
(:func:`.capabilities.configuration_errors_as_replies`), the server stops the run at the
first one, and Flower's record of the ServerApp's fedplug error loses its traceback
(:mod:`.flower_log`)."""

from __future__ import annotations

import logging
import sys
import traceback

import pytest
import torch
from fedplug.adapters.flower import FedplugLoss, FedplugStrategy, LoopbackGrid
from fedplug.adapters.flower.capabilities import (
    CONFIGURATION_ERROR,
    configuration_error_in,
    declare,
)
from fedplug.adapters.flower.flower_log import (
    FLOWER_LOGGER,
    FedplugErrorsInOneLine,
    report_fedplug_errors_in_one_line,
)
from fedplug.adapters.flower.loopback import ensure_task_identity
from fedplug.adapters.flower.records import model_record
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from torch import nn

from fedplug.errors import ConfigError, TrainingError

NUM_NODES = 4
LEARNING_RATE = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def task_train(net: nn.Module, lr: float, criterion: nn.Module) -> float:
    """The quickstart's ``task.train``: its own SGD with momentum 0.9, its own loop."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    running_loss = 0.0
    for _ in range(3):
        inputs, labels = torch.rand(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        loss = criterion(net(inputs), labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
    return running_loss / 3


def scaffold_app_with_momentum(trained: list[tuple[dict, dict]]) -> ClientApp:
    """The quickstart shape with SCAFFOLD and the learning rate passed to
    ``finish_round``; each train call appends (received state, state after training)."""
    app = ClientApp()
    scaffold = FedplugLoss(aggregator={"name": "scaffold"}, app=app)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        received = msg.content["arrays"].to_torch_state_dict()
        model.load_state_dict(received)
        lr = LEARNING_RATE
        try:
            train_loss = task_train(model, lr, scaffold.begin_round(msg, context, model))
        finally:
            trained.append((received, {k: v.clone() for k, v in model.state_dict().items()}))
        metrics = MetricRecord({"train_loss": train_loss, "num-examples": 8})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        scaffold.finish_round(content, learning_rate=lr)
        return Message(content=content, reply_to=msg)

    return app


def train_message() -> Message:
    ensure_task_identity()
    return Message(RecordDict({"arrays": model_record(Net())}), dst_node_id=1000, message_type=MessageType.TRAIN)


def node_context() -> Context:
    return Context(run_id=1, node_id=1000, node_config={}, state=RecordDict(), run_config={})


# ------------------------------------------------------------------ the client's mod


def test_a_config_error_in_a_handler_becomes_an_error_reply_and_others_go_through() -> None:
    # Prepare: one handler registered before the fedplug piece declares itself on the
    # app (wrapped then), one after (wrapped by Flower through app._mods).
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise ConfigError("your optimizer\nSGD(momentum=0.9) does not fit")

    declare(app, {"aggregator": "scaffold"})
    declare(app, {"loss_transform": "fedprox"})  # a second piece installs nothing more

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        raise RuntimeError("a bug in the user's code")

    # Execute
    reply = app(train_message(), node_context())
    # Assert: the ConfigError is a reply with the recognisable reason, on one line;
    # the RuntimeError reaches Flower as before.
    assert reply.has_error()
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason == CONFIGURATION_ERROR + "your optimizer SGD(momentum=0.9) does not fit"
    assert configuration_error_in(reply) == "your optimizer SGD(momentum=0.9) does not fit"
    evaluate_message = Message(
        RecordDict({"arrays": model_record(Net())}), dst_node_id=1000, message_type=MessageType.EVALUATE
    )
    with pytest.raises(RuntimeError, match="a bug in the user's code"):
        app(evaluate_message, node_context())
    assert app._mods.count(app._mods[0]) == 1 and len(app._mods) == 1


def test_an_ordinary_error_reply_is_no_configuration_error() -> None:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise ConfigError("not caught: no fedplug piece was given this app")

    grid = LoopbackGrid(app, 1)
    (reply,) = grid.send_and_receive([Message(RecordDict({"arrays": model_record(Net())}), dst_node_id=1000, message_type=MessageType.TRAIN)])
    assert reply.has_error() and configuration_error_in(reply) is None


# ------------------------------------------------------------- the server's one line


def test_scaffold_with_momentum_stops_the_run_at_the_first_reply_before_any_update() -> None:
    # Prepare: the quickstart-shaped SCAFFOLD app with SGD momentum 0.9 on 4 nodes.
    trained: list[tuple[dict, dict]] = []
    grid = LoopbackGrid(scaffold_app_with_momentum(trained), NUM_NODES)
    strategy = FedplugStrategy({"aggregator": {"name": "scaffold"}}, model=Net())
    # Execute
    with pytest.raises(TrainingError) as stopped:
        strategy.start(grid=grid, num_rounds=2)
    # Assert: one line, the client's, naming its node and the momentum; the round's
    # one exchange only (no retry); no node moved a parameter.
    line = str(stopped.value)
    assert "\n" not in line
    assert "refused to train: your optimizer" in line and "momentum=0.9" in line, line
    assert any(f"node {1000 + k} " in line for k in range(NUM_NODES)), line
    sent = [m for m in grid.delivered if m.metadata.message_type == MessageType.TRAIN]
    assert len(sent) == NUM_NODES
    assert len(trained) == NUM_NODES
    for received, after_training in trained:
        for name, value in received.items():
            assert torch.equal(after_training[name], value), name


# ---------------------------------------------------------------- Flower's log


def logged(record_of: logging.LogRecord) -> str:
    """What Flower's handler writes for ``record_of`` after the filter."""
    FedplugErrorsInOneLine().filter(record_of)
    return logging.Formatter("%(levelname)s: %(message)s").format(record_of)


def record(message: str, *args: object, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    return logging.LogRecord(FLOWER_LOGGER, logging.ERROR, __file__, 1, message, args, exc_info)


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001  # to get its traceback
        return caught


def test_a_fedplug_error_record_loses_its_traceback_and_keeps_one_line() -> None:
    error = raised(TrainingError("node 7 refused to train:\nmomentum 0.9"))
    text = logged(record("%s raised an exception", "Simulation", error=error))
    assert text == "ERROR: fedplug stopped the run: node 7 refused to train: momentum 0.9"


def test_flowers_wrapper_of_a_fedplug_error_is_one_line_too() -> None:
    try:
        try:
            raise ConfigError("set momentum to 0")
        except ConfigError as cause:
            raise RuntimeError("An error was encountered. Ending simulation.") from cause
    except RuntimeError as wrapper:
        error = wrapper
    assert logged(record("crashed", error=error)) == "ERROR: fedplug stopped the run: set momentum to 0"


def test_a_formatted_fedplug_traceback_record_becomes_its_last_line() -> None:
    try:
        raise TrainingError("10 of 10 client updates failed")
    except TrainingError:
        formatted = traceback.format_exc()
    assert logged(record(formatted)) == "ERROR: fedplug stopped the run: 10 of 10 client updates failed"


def test_any_other_exception_keeps_its_traceback() -> None:
    error = raised(RuntimeError("a bug"))
    text = logged(record("%s raised an exception", "Simulation", error=error))
    assert text.startswith("ERROR: Simulation raised an exception\nTraceback (most recent call last):")
    assert text.endswith("RuntimeError: a bug")
    try:
        raise ValueError("also a bug")
    except ValueError:
        formatted = traceback.format_exc()
    assert logged(record(formatted)) == "ERROR: " + formatted


def test_the_filter_is_installed_once_on_flowers_logger_and_handlers() -> None:
    flower_log = logging.getLogger(FLOWER_LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    flower_log.addHandler(handler)
    try:
        report_fedplug_errors_in_one_line()
        report_fedplug_errors_in_one_line()
        for holder in (flower_log, handler):
            assert sum(isinstance(each, FedplugErrorsInOneLine) for each in holder.filters) == 1
    finally:
        flower_log.removeHandler(handler)
