"""The train messages of a :class:`~.strategy.FedplugStrategy` round: transport only.

:class:`TrainExchange` holds the round in progress (:class:`.chains.RoundInProgress`)
and what its messages carry (the global model or a chain's, the aggregator's server
payload, the loss transform's prepared state, Flower's train config); it builds the
messages of every chain's next member, takes their replies in, and sends hand-offs
through the grid until every chain is done. What a reply means, and whether the round
is accepted, is the round core's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from torch import Tensor

from fedplug.components import MODEL_SHAPE, ClientNeeds, RoundPlan
from fedplug.run.federated_round import AggregatedRound
from fedplug.run.vectors import tensors_num_bytes

from .capabilities import stop_at_configuration_error
from .chains import ReplyDeadlineGrid, RoundInProgress, reply_wait
from .messages import train_message
from .node_setup import NodeMessages
from .priors import NodeDirectory
from .records import CHAIN_POSITION, CLIENT_TIMEOUT, REPLY_METRICS, ROUND, tensors_to_record
from .reply_matching import answering_replies

__all__ = ["TrainExchange", "answering_replies", "reply_bounds"]

Layout = list[tuple[str, tuple[int, ...]]]


@dataclass(eq=False)
class TrainExchange:
    """The train messages and replies of the round in progress."""

    train_config: Any
    """The ``train`` section (its ``failures`` and ``screening``)."""
    needs: ClientNeeds
    """What the components need from the clients."""
    layout: Layout
    """The model's (name, shape) layout."""
    requirement: str | None
    """The line naming what the ClientApp must add (``None``: nothing)."""
    round: RoundInProgress | None = field(default=None, init=False)
    started: float = field(default=0.0, init=False)
    """When the round in progress started (a retry is part of the same round)."""
    grid: Grid | None = field(default=None, init=False)
    timeout: float = field(default=3600.0, init=False)
    """Flower's bound of one exchange (``start``'s ``timeout``); the replies' own bound
    is :func:`.chains.reply_wait` of ``client_timeout_seconds``."""
    config: dict[str, Any] = field(default_factory=dict, init=False)
    payload_record: ArrayRecord | None = field(default=None, init=False)
    payload_bytes: int = field(default=0, init=False)
    received: tuple[int, int] = field(default=(0, 0), init=False)
    """The attempt's replies so far, Flower's way: (with content, with an error)."""
    _waiting: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _node_of_reply: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _sent: list[Message] = field(default_factory=list, init=False, repr=False)
    """The messages of the exchange in flight: only replies to them are taken."""

    @property
    def reply_wait(self) -> float | None:
        return reply_wait(self.train_config.failures.client_timeout_seconds)

    def start_round(
        self,
        round_number: int,
        plan: Callable[[int], RoundPlan],
        global_vector: Tensor,
        config: Mapping[str, Any],
        aggregator: Any,
    ) -> None:
        """Start (or restart, for a retry) round ``round_number`` from ``global_vector``,
        with ``plan(round_number)``'s chains and the aggregator's server payload."""
        if self.round is None or self.round.server_round != round_number:
            self.started = time.perf_counter()  # a retry is part of the same round
        self.round = RoundInProgress(
            round_number,
            plan(round_number),
            global_vector,
            self.layout,
            self.train_config.failures.client_timeout_seconds,
            required_extras=self.needs.reply_extras,
            requirement=self.requirement,
            required_metrics=self.needs.reply_metrics,
            **reply_bounds(self.layout, self.needs, self.train_config.screening),
        )
        self.config = dict(config)
        payload = aggregator.server_payload()
        self.payload_record = tensors_to_record(payload) if payload else None
        self.payload_bytes = tensors_num_bytes(payload)
        self.received = (0, 0)
        self._waiting, self._node_of_reply, self._sent = {}, {}, []

    def require_round(self) -> RoundInProgress:
        if self.round is None:
            raise RuntimeError("configure_train must start the round first")
        return self.round

    def absorb(self, replies: Iterable[Message]) -> None:
        """Take the replies of one exchange into their chains, and count them. Only
        replies that answer a message of the exchange, once each, from the node it went
        to count (:func:`.reply_matching.answering_replies`; any other is ignored with a
        warning): a grid that does not dedupe cannot advance a chain twice, nor a node
        answer for another.

        Raises:
            TrainingError: a node replied with a fedplug configuration error (its
                ClientApp refused to train): the run stops at once, with its line.
        """
        round_number = self.round.server_round if self.round is not None else 0
        replies = answering_replies(self._sent, replies, f"round {round_number}'s train messages")
        stop_at_configuration_error(replies)
        errors = sum(reply.has_error() for reply in replies)
        results, failures = self.received
        self.received = (results + len(replies) - errors, failures + errors)
        if self._waiting:
            self.require_round().absorb(self._waiting, replies, self._node_of_reply)
        self._waiting, self._node_of_reply, self._sent = {}, {}, []

    def next_messages(
        self,
        directory: NodeDirectory,
        messages: NodeMessages,
        vector_record: Callable[[Tensor], ArrayRecord],
        loss_state: tuple[ArrayRecord, ConfigRecord] | None,
    ) -> list[Message]:
        """The train message of every active chain's next member, carrying the chain's
        model; a member whose node is gone fails its chain."""
        round_ = self.require_round()
        grid = self.grid
        connected = (
            set(grid.get_node_ids()) if grid is not None else set(directory.node_of.values())
        )
        records: dict[int, ArrayRecord] = {}
        sent = []
        for chain in round_.active():
            client = chain.next_client
            node = directory.node_of[client]
            if node not in connected:
                chain.fail(f"client {client}'s node {node} is no longer connected")
                continue
            record = records.get(id(chain.vector))
            if record is None:
                record = records[id(chain.vector)] = vector_record(chain.vector)
            config = {
                **messages.for_client(round_.server_round, client, directory.num_clients),
                CHAIN_POSITION: chain.position,
                **self._client_timeout(),
                **self._reply_metrics(),
                **self.config,
                ROUND: round_.server_round,  # fedplug's round, also after a resume
            }
            sent.append(
                train_message(
                    node,
                    round_.server_round,
                    record,
                    config,
                    payload=self.payload_record,
                    loss_state=loss_state,
                )
            )
            self._waiting[client] = chain
            self._node_of_reply[node] = client
        self._sent = sent
        return sent

    def send_until_done(
        self, messages: list[Message], hand_off: Callable[[int, Iterable[Message]], list[Message]]
    ) -> None:
        """Send ``messages`` and every hand-off they lead to (``hand_off(round,
        replies)``), until the round's chains are done; a member that sends nothing
        within the reply bound fails its chain."""
        grid = self.grid
        while messages:
            assert grid is not None  # set by configure_train
            bounded = ReplyDeadlineGrid.around(grid, self.reply_wait)
            replies = bounded.send_and_receive(messages, timeout=self.timeout)
            messages = hand_off(self.require_round().server_round, replies)

    def accepted_replies(self, attempt: AggregatedRound) -> list[Any]:
        """The contents of the replies whose chain the round core accepted: a client it
        dropped (a NaN model, say) must not enter the averaged metrics either."""
        round_ = self.require_round()
        dropped = {client for chain, _ in attempt.tally.dropped for client in chain}
        return [
            content
            for content, client in zip(round_.replies, round_.reply_clients, strict=True)
            if client not in dropped
        ]

    def _client_timeout(self) -> dict[str, Any]:
        """``train.failures.client_timeout_seconds`` for the train message, when set: a
        FedplugTrainer interrupts its training there (:mod:`.chains`)."""
        timeout = self.train_config.failures.client_timeout_seconds
        return {CLIENT_TIMEOUT: float(timeout)} if timeout is not None else {}

    def _reply_metrics(self) -> dict[str, Any]:
        """The metrics a train message asks for (FedplugTrainer and FedplugLoss report
        them when asked; a quickstart ClientApp reports ``train_loss`` on its own)."""
        return {REPLY_METRICS: list(self.needs.reply_metrics)} if self.needs.reply_metrics else {}


def reply_bounds(layout: Layout, needs: ClientNeeds, screening: Any) -> dict[str, Any]:
    """What one reply may hold (:class:`.chains.RoundInProgress`): each required
    extra's declared shape (``"model"``: the flat model's), and the caps of
    ``train.screening`` on ``num-examples`` and ``fedplug.num-steps``."""
    model_size = sum(math.prod(shape) for _, shape in layout)
    shapes = {
        name: (model_size,) if extra.shape == MODEL_SHAPE else tuple(extra.shape)
        for name, extra in needs.reply_extra_shapes.items()
    }
    return {
        "extras_shapes": shapes,
        "max_num_examples": screening.max_num_examples,
        "max_num_steps": screening.max_num_steps,
    }
