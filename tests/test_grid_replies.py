"""Replies on grids that do not dedupe (issue 44, finding 5).

Flower's grids name, in each reply, the message it answers; a grid that does not dedupe
(the loopback grid, a custom grid) may hand the server two replies to one message, or a
reply whose ``src_node_id`` names another node. The server takes only replies that answer
a message of the exchange, once each, from the node it went to
(:func:`adapters.flower.reply_matching.answering_replies`, used by every exchange): any
other is ignored with one warning line naming it, and the honest nodes' chains go on.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from conftest import SMALL_EXPERIMENT
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
from fedplug.adapters.flower.loopback import FIRST_NODE_ID
from fedplug.adapters.flower.records import ACCURACY, METRICS_KEY
from fedplug.config import validate_experiment

pytestmark = pytest.mark.timeout(120)

NUM_CLIENTS = 3
ROUNDS = 2


def experiment(**train: Any) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update({"rounds": ROUNDS, "client_fraction": 1.0, **train})
    return validate_experiment(data)


class DuplicatingGrid(LoopbackGrid):
    """The loopback grid, handing over every reply twice (a grid that does not dedupe).
    The copy of an evaluate reply says accuracy 0: it must not replace the first."""

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        replies = []
        for reply in super().pull_messages(message_ids):
            second = copy.deepcopy(reply)
            records = second.content.metric_records if second.has_content() else {}
            metrics = records.get(METRICS_KEY)
            if second.metadata.message_type == MessageType.EVALUATE and metrics is not None:
                metrics[ACCURACY] = 0.0
            replies += [reply, second]
        return replies


class ForgingGrid(LoopbackGrid):
    """The loopback grid, except that round 1's train reply of node ``liar`` claims to
    come from node ``victim``."""

    def __init__(self, *args: Any, liar: int, victim: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.liar, self.victim, self.forged = liar, victim, False

    def _deliver(self, message: Message) -> Message | None:
        reply = super()._deliver(message)
        is_train = message.metadata.message_type == MessageType.TRAIN
        from_liar = message.metadata.dst_node_id == self.liar
        if reply is not None and is_train and from_liar and not self.forged:
            reply.metadata.__dict__["_src_node_id"] = self.victim
            self.forged = True
        return reply


@pytest.fixture
def warnings_logged() -> Iterable[list[str]]:
    """Every warning of Flower's logger (fedplug's server lines are its children)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def client_of(grid: LoopbackGrid, node: int) -> int:
    return int(grid.contexts[node].node_config["partition-id"])


def dropped_clients(result: Any) -> list[list[int]]:
    """Per round, the clients dropped from it (sorted)."""
    return [
        sorted(client for entry in record.dropped for client in entry["clients"])
        for record in result.history
    ]


def test_every_reply_twice_trains_every_chain_once(warnings_logged: list[str]) -> None:
    # Prepare: the same run on a plain loopback grid and on one that duplicates replies.
    config = experiment()
    plain, plain_strategy = run_on_grid(LoopbackGrid(make_client_app(), NUM_CLIENTS), config)
    grid = DuplicatingGrid(make_client_app(), NUM_CLIENTS)
    # Execute (was: ValueError: chain [...] has no member left to train)
    result, strategy = run_on_grid(grid, config)
    # Assert: every chain trained once each round, to the plain run's model and records;
    # the copies of evaluate replies (accuracy 0) did not replace the first.
    assert [(r.participants, r.failures) for r in result.history] == [(NUM_CLIENTS, 0)] * ROUNDS
    torch.testing.assert_close(strategy.final_vector, plain_strategy.final_vector, rtol=0, atol=0)
    for ours, theirs in zip(result.history, plain.history, strict=True):
        assert ours.client_accuracy_mean == pytest.approx(theirs.client_accuracy_mean)
        assert ours.accuracy == pytest.approx(theirs.accuracy)
    second = "a second reply to a message already answered"
    ignored = [line for line in warnings_logged if second in line]
    assert any(line.startswith("round 1's train messages: ignored a reply") for line in ignored)
    assert any(line.startswith("round 1's evaluate messages: ignored a reply") for line in ignored)


def test_a_reply_claiming_another_nodes_id_fails_only_the_liar(warnings_logged: list[str]) -> None:
    # Prepare: in round 1, the first node's train reply claims to come from the second.
    liar, victim = FIRST_NODE_ID, FIRST_NODE_ID + 1
    grid = ForgingGrid(make_client_app(), NUM_CLIENTS, liar=liar, victim=victim)
    # Execute
    result, _ = run_on_grid(grid, experiment())
    # Assert: the forged reply was ignored, so only the liar's chain failed in round 1;
    # the victim trained (was: the victim's chain failed, "answered as client 0").
    assert grid.forged
    assert dropped_clients(result) == [[client_of(grid, liar)], []]
    assert [r.participants - r.failures for r in result.history] == [NUM_CLIENTS - 1, NUM_CLIENTS]
    reason = f"that message went to node {liar}, not to node {victim}"
    forged = [line for line in warnings_logged if reason in line]
    assert len(forged) == 1, warnings_logged
    assert forged[0].startswith(f"round 1's train messages: ignored a reply from node {victim}")


def sent_message(node: int, message_id: str) -> Message:
    content = RecordDict({"config": ConfigRecord()})
    message = Message(content, dst_node_id=node, message_type=MessageType.QUERY)
    message.metadata.__dict__["_message_id"] = message_id
    return message


def reply_to(
    message: Message, *, from_node: int | None = None, reply_id: str | None = None
) -> Message:
    reply = Message(RecordDict({METRICS_KEY: MetricRecord({"x": 1.0})}), reply_to=message)
    if from_node is not None:
        reply.metadata.__dict__["_src_node_id"] = from_node
    if reply_id is not None:
        reply.metadata.__dict__["_reply_to_message_id"] = reply_id
    return reply


def test_only_one_reply_per_message_from_its_own_node_is_taken(
    warnings_logged: list[str],
) -> None:
    # Prepare: two messages of one exchange; replies: an honest one, its copy, one from a
    # node answering the other's message, one to a message of no exchange, an honest one.
    first, second = sent_message(1, "m-1"), sent_message(2, "m-2")
    honest_first, honest_second = reply_to(first), reply_to(second)
    replies = [
        honest_first,
        copy.deepcopy(honest_first),
        reply_to(second, from_node=1),
        reply_to(first, reply_id="m-9"),
        honest_second,
    ]
    from fedplug.adapters.flower.round_exchange import answering_replies  # new in issue 44

    # Execute
    taken = answering_replies([first, second], replies, "the test exchange")
    # Assert: each message's own reply, once; one warning line per reply left out.
    assert taken == [honest_first, honest_second]
    assert warnings_logged == [
        "the test exchange: ignored a reply from node 1 to message 'm-1': "
        "a second reply to a message already answered",
        "the test exchange: ignored a reply from node 1 to message 'm-2': "
        "that message went to node 2, not to node 1",
        "the test exchange: ignored a reply from node 1 to message 'm-9': "
        "it answers no message of this exchange",
    ]


FEDDISK = {
    "name": "feddisk",
    "made_hidden": 8,
    "made_max_epochs": 2,
    "made_batch_size": 32,
    "global_rounds": 2,
    "classifier_epochs": 5,
}
"""FedDisk small enough for a second a run: a setup phase of several steps."""


def test_a_setup_phase_takes_each_nodes_reply_once(warnings_logged: list[str]) -> None:
    # Prepare: FedDisk (a setup phase of several steps before round 1) on a plain
    # loopback grid and on one that hands over every reply twice.
    config = experiment(loss_transform=FEDDISK)
    plain, plain_strategy = run_on_grid(LoopbackGrid(make_client_app(), NUM_CLIENTS), config)
    # Execute
    result, strategy = run_on_grid(DuplicatingGrid(make_client_app(), NUM_CLIENTS), config)
    # Assert: the same weights, model and records; every second setup reply named once.
    torch.testing.assert_close(strategy.final_vector, plain_strategy.final_vector, rtol=0, atol=0)
    assert [r.accuracy for r in result.history] == [r.accuracy for r in plain.history]
    ignored = [line for line in warnings_logged if line.startswith("setup phase 'feddisk', step")]
    assert ignored and all("a second reply to a message already answered" in line for line in ignored)
