"""One round in progress on the server: each chain of the round's plan, how far it got,
and what its last member sent back.

The stepping itself is :mod:`fedplug.run.chains`'; this module decodes and screens
Flower's replies into it, and :class:`ReplyDeadlineGrid` stops waiting for replies once
none has come for T plus a margin.
Design: docs/flower.md, 'Design notes: chains'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from torch import Tensor

from fedplug.components import RoundPlan
from fedplug.deadline import REPLY_MARGIN_SECONDS, grace_period
from fedplug.errors import TrainingError
from fedplug.run.chains import ChainProgress, RoundChains
from fedplug.run.client_text import client_text
from fedplug.run.round_screen import Outcome

from .decoding import MAX_NUM_EXAMPLES, MAX_NUM_STEPS, MAX_SECONDS, decode_array, finite_number
from .records import (
    CLIENT_ID,
    EXTRAS_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_EXAMPLES,
    NUM_STEPS,
    SECONDS,
    integer,
    number,
    record_to_vector,
)

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

Layout = list[tuple[str, tuple[int, ...]]]

DEFAULT_PULL_INTERVAL = 0.5
"""Seconds between two pulls of a grid that sets no ``pull_interval`` of its own."""


def reply_wait(client_timeout: float | None) -> float | None:
    """How long the server waits without any reply before it gives up on the replies
    still missing: T plus ``max(2 s, 10% of T)`` (``None``: no bound, T is unset)."""
    if client_timeout is None:
        return None
    return client_timeout + grace_period(client_timeout, REPLY_MARGIN_SECONDS)


def no_reply_reason(client_timeout: float | None) -> str:
    """Why a chain whose member sent nothing failed (without the client's name)."""
    wait = reply_wait(client_timeout)
    if wait is None:
        return "sent no reply within the exchange's timeout"
    return (
        f"sent no reply within {wait:g}s (train.failures.client_timeout_seconds={client_timeout:g} "
        f"plus a {wait - client_timeout:g}s margin)"
    )


class ReplyDeadlineGrid(Grid):
    """``grid`` with a bounded wait: :meth:`send_and_receive` returns the replies it has
    once none has arrived for ``idle_seconds`` (or after ``timeout`` in all, Flower's
    bound), instead of waiting ``timeout`` for a node that hangs. Everything else is
    ``grid``'s own; replies are matched to this call's messages by id, so a late reply to
    an earlier exchange is never taken for one of this exchange.

    Args:
        grid: the ServerApp's grid.
        idle_seconds: :func:`reply_wait` of the run's T (``None``: Flower's own wait).
    """

    def __init__(self, grid: Grid, idle_seconds: float | None) -> None:
        self.grid = grid
        self.idle_seconds = idle_seconds

    @classmethod
    def around(cls, grid: Grid, idle_seconds: float | None) -> ReplyDeadlineGrid:
        """``grid`` itself when it already is one with this bound, else a new wrapper."""
        if isinstance(grid, cls) and grid.idle_seconds == idle_seconds:
            return grid
        return cls(grid.grid if isinstance(grid, cls) else grid, idle_seconds)

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        if self.idle_seconds is None:
            return self.grid.send_and_receive(messages, timeout=timeout)
        waiting = set(self.grid.push_messages(messages))
        pull_interval = float(getattr(self.grid, "pull_interval", DEFAULT_PULL_INTERVAL))
        interval = min(pull_interval, self.idle_seconds / 4)
        started = last_reply = time.monotonic()
        replies: list[Message] = []
        while waiting:
            arrived = [
                reply
                for reply in self.grid.pull_messages(list(waiting))
                if reply.metadata.reply_to_message_id in waiting
            ]
            now = time.monotonic()
            if arrived:
                last_reply = now
                replies.extend(arrived)
                waiting.difference_update(reply.metadata.reply_to_message_id for reply in arrived)
                continue
            silent_too_long = now - last_reply >= self.idle_seconds
            if silent_too_long or (timeout is not None and now - started >= timeout):
                break
            time.sleep(interval)
        return replies


@dataclass
class RoundInProgress:
    """The chains of one round, advanced one exchange at a time.

    ``layout`` is the model's (name, shape) layout, to decode replies; ``timeout`` is
    ``train.failures.client_timeout_seconds``, checked on intermediate members too;
    ``required_extras`` the keys every reply's extras must hold, ``required_metrics`` the
    numbers every reply's metrics must hold (``ClientNeeds.reply_metrics``), and
    ``requirement`` the line raised when one lacks them.
    """

    server_round: int
    plan: RoundPlan
    global_vector: Tensor
    layout: Layout
    timeout: float | None = None
    required_extras: tuple[str, ...] = ()
    requirement: str | None = None
    required_metrics: tuple[str, ...] = ()
    extras_shapes: Mapping[str, tuple[int, ...] | None] = field(default_factory=dict)
    """The shape each required extra must have (absent or ``None``: any shape of at most
    the model's size)."""
    max_num_examples: int = MAX_NUM_EXAMPLES
    """The largest ``num-examples`` one reply may state (``train.screening``)."""
    max_num_steps: int = MAX_NUM_STEPS
    """The largest ``fedplug.num-steps`` one reply may state (``train.screening``)."""
    round_chains: RoundChains = field(init=False)
    """Each chain's progress (the runtime-neutral stepper, :mod:`fedplug.run.chains`)."""
    replies: list[RecordDict] = field(default_factory=list)
    """The content of every member's usable reply, for the clients' metrics."""
    reply_clients: list[int] = field(default_factory=list)
    """The client of each entry of :attr:`replies`."""
    provided: bool = False
    """Whether some reply carried every required extra and metric."""
    unprovided: list[str] = field(default_factory=list)
    """Which replies lacked a required extra or metric (one line each)."""

    def __post_init__(self) -> None:
        self.round_chains = RoundChains(self.plan, self.global_vector)

    @property
    def chains(self) -> list[ChainProgress]:
        """Every chain of the plan, in plan order."""
        return self.round_chains.chains

    def active(self) -> list[ChainProgress]:
        """The chains with a member still to train, in plan order."""
        return self.round_chains.active()

    @property
    def complete(self) -> bool:
        return self.round_chains.complete

    def absorb(
        self,
        waiting: dict[int, ChainProgress],
        replies: list[Message],
        node_of_reply: dict[int, int],
    ) -> None:
        """Advance every chain of ``waiting`` (client id -> chain) with its reply.

        ``node_of_reply`` maps a replying node id to the client id it was asked to train.
        A chain with no reply (the exchange timed out, or the node left) fails.
        """
        answered: set[int] = set()
        for reply in replies:
            client_id = node_of_reply.get(reply.metadata.src_node_id)
            if client_id is None or client_id not in waiting:
                logger.warning(
                    "round %d: ignored a reply from unexpected node %s",
                    self.server_round,
                    reply.metadata.src_node_id,
                )
                continue
            answered.add(client_id)
            chain = waiting[client_id]
            reason = self._advance(chain, client_id, reply)
            if reason is not None:
                chain.fail(f"client {client_id} {reason}")
            else:
                self.replies.append(reply.content)
                self.reply_clients.append(client_id)
        for client_id, chain in waiting.items():
            if client_id not in answered:
                chain.fail(f"client {client_id} {no_reply_reason(self.timeout)}")

    def _advance(self, chain: ChainProgress, client_id: int, reply: Message) -> str | None:
        """Take one member's reply into the chain; return why it is unusable, or None.

        Every field is decoded defensively (:mod:`.decoding`): a malformed one is the
        reason, never an exception. A reply without the extras or metrics a component
        needs is unusable too; :meth:`outcomes` stops the run only when no reply of the
        round carried them (a ClientApp that cannot provide them, not one bad node).
        """
        if reply.has_error():
            return f"raised during training: {client_text(reply.error.reason)}"
        content = reply.content
        model = _single(content.array_records, MODEL_KEY, exclude=EXTRAS_KEY)
        metrics = _single(content.metric_records, METRICS_KEY)
        if model is None or metrics is None:
            return f"replied without {MODEL_KEY!r} and {METRICS_KEY!r} records"
        try:
            answered_as = integer(metrics, CLIENT_ID, client_id, low=0, high=2**31 - 1)
            samples = self._samples(metrics)
            steps = integer(metrics, NUM_STEPS, 0, low=0, high=self.max_num_steps)
            seconds = finite_number(metrics.get(SECONDS, 0.0), SECONDS, 0.0, MAX_SECONDS)
            reported = {
                name: number(metrics, name) for name in self.required_metrics if name in metrics
            }
        except ValueError as error:
            return f"sent malformed metrics: {error}"
        if samples is None:
            return f"sent no {NUM_EXAMPLES!r} in its metrics (the weight of its model)"
        if answered_as != client_id:
            return f"answered as client {answered_as}, not as client {client_id}"
        try:
            vector = record_to_vector(model, self.layout)
            extras = self._extras(content.array_records.get(EXTRAS_KEY), vector.numel(), client_id)
        except ValueError as error:
            return str(error)
        lacking = self._lacking(extras, reported)
        if lacking is not None:
            self.unprovided.append(
                f"round {self.server_round}: client {client_id} "
                f"(node {reply.metadata.src_node_id}) replied without {lacking}"
            )
            return f"replied without {lacking}"
        self.provided = True
        chain.advance(vector, samples, steps, seconds, extras, reported)
        return chain.handed_on_problem(self.plan, self.timeout)

    def _samples(self, metrics: Mapping[str, Any]) -> int | None:
        """The reply's ``num-examples`` in ``[0, max_num_examples]``; ``None`` when absent
        under sample weighting (0 when absent under uniform weighting, which ignores it)."""
        if NUM_EXAMPLES not in metrics:
            return None if self.plan.weighting == "samples" else 0
        return integer(metrics, NUM_EXAMPLES, low=0, high=self.max_num_examples)

    def _extras(self, record: Any, model_size: int, client_id: int) -> dict[str, Tensor]:
        """The reply's extras the components need, decoded (:func:`.decoding.decode_array`):
        each of its declared shape (``extras_shapes``), or else of at most the model's
        size. Other keys are never decoded: no component reads them."""
        if record is None:
            return {}
        ignored = sorted(str(key) for key in record.keys() if key not in self.required_extras)
        if ignored:
            logger.warning(
                "round %d: client %d sent %s %s, which no component reads; ignored",
                self.server_round,
                client_id,
                EXTRAS_KEY,
                client_text(ignored),  # the client's names: bounded and escaped
            )
        extras: dict[str, Tensor] = {}
        for key in self.required_extras:
            if key in record:
                array = decode_array(
                    record[key],
                    key,
                    shape=self.extras_shapes.get(key),
                    max_elements=max(model_size, 1),
                )
                extras[key] = torch.from_numpy(np.array(array, dtype=np.float32))
        return extras

    def _lacking(self, extras: Mapping[str, Tensor], reported: Mapping[str, float]) -> str | None:
        """What of the components' needs the reply lacks, in words (``None``: nothing)."""
        missing = [key for key in self.required_extras if key not in extras]
        if missing:
            return f"{EXTRAS_KEY!r} {missing}"
        unreported = [name for name in self.required_metrics if name not in reported]
        if unreported:
            return f"{unreported} in its {METRICS_KEY!r}"
        return None

    def outcomes(self) -> list[Outcome]:
        """One outcome per chain, in plan order (the simulator's order, so a running sum
        adds the same numbers in the same order).

        Raises:
            TrainingError: replies lacked the extras or metrics a component needs and no
                reply of the round carried them: the ClientApp cannot provide them, and
                every retry would fail alike, so the run stops with the fix.
        """
        if self.unprovided and not self.provided:
            raise TrainingError(f"{self.unprovided[0]}; {self.requirement}")
        return self.round_chains.outcomes()


def _single(records: Mapping[str, Any], key: str, exclude: str | None = None) -> Any:
    """``records[key]``, else the only record when there is exactly one (besides
    ``exclude``), as Flower's strategies read a reply; ``None`` otherwise."""
    if key in records:
        return records[key]
    others = [value for name, value in records.items() if name != exclude]
    return others[0] if len(others) == 1 else None
