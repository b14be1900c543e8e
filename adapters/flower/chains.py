"""One round in progress on the server: each chain of the round's plan, how far it got,
and what its last member sent back.

A :class:`~fedplug.components.RoundPlan` chain of length L costs L message exchanges:
position 0 of every chain trains in the first exchange (from the global model),
position 1 in the second (from the model position 0 returned), and so on; chains of
different lengths simply drop out of later exchanges. Plain FedAvg-style plans (chains
of one) take one exchange, as any Flower strategy does. Every reply is checked at once;
a chain whose member failed, or sent a model of the wrong shape or with non-finite
values, stops there with a logged reason and is counted as one failure of the round.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from flwr.app import Message
from torch import Tensor

from fedplug.components import ClientUpdate, RoundPlan

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
    record_to_tensors,
    record_to_vector,
)

logger = logging.getLogger("fedplug.adapters.flower")


@dataclass
class ChainProgress:
    """One chain: the model to hand to its next member, and what it has done so far."""

    chain: list[int]
    vector: Tensor
    position: int = 0
    samples: int = 0
    steps: int = 0
    seconds: float = 0.0
    extras: dict[str, Tensor] = field(default_factory=dict)
    failure: str | None = None

    @property
    def done(self) -> bool:
        return self.failure is not None or self.position == len(self.chain)

    @property
    def next_client(self) -> int:
        return self.chain[self.position]

    def fail(self, reason: str) -> None:
        self.failure = reason


@dataclass
class RoundInProgress:
    """The chains of one round, advanced one exchange at a time."""

    server_round: int
    plan: RoundPlan
    global_vector: Tensor
    chains: list[ChainProgress] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chains = [ChainProgress(list(chain), self.global_vector) for chain in self.plan.chains]

    def active(self) -> list[ChainProgress]:
        """The chains with a member still to train, in plan order."""
        return [chain for chain in self.chains if not chain.done]

    @property
    def complete(self) -> bool:
        return not self.active()

    def absorb(
        self,
        waiting: dict[int, ChainProgress],
        replies: list[Message],
        layout: list[tuple[str, tuple[int, ...]]],
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
            reason = self._advance(chain, client_id, reply, layout)
            if reason is not None:
                chain.fail(reason)
                logger.warning(
                    "round %d: dropped client(s) %s: client %d %s",
                    self.server_round,
                    chain.chain,
                    client_id,
                    reason,
                )
        for client_id, chain in waiting.items():
            if client_id not in answered:
                chain.fail("sent no reply in time")
                logger.warning(
                    "round %d: dropped client(s) %s: client %d sent no reply in time",
                    self.server_round,
                    chain.chain,
                    client_id,
                )

    @staticmethod
    def _advance(
        chain: ChainProgress,
        client_id: int,
        reply: Message,
        layout: list[tuple[str, tuple[int, ...]]],
    ) -> str | None:
        """Take one member's reply into the chain; return why it is unusable, or None."""
        if reply.has_error():
            return f"raised during training: {reply.error.reason}"
        content = reply.content
        if MODEL_KEY not in content.array_records or METRICS_KEY not in content.metric_records:
            return f"replied without {MODEL_KEY!r} and {METRICS_KEY!r} records"
        metrics = content.metric_records[METRICS_KEY]
        try:
            answered_as = integer(metrics, CLIENT_ID, client_id)
            samples = integer(metrics, NUM_EXAMPLES, 0)
            steps = integer(metrics, NUM_STEPS, 0)
            seconds = number(metrics, SECONDS, 0.0)
        except ValueError as error:
            return f"sent malformed metrics: {error}"
        if answered_as != client_id:
            return f"answered as client {answered_as}, not as client {client_id}"
        try:
            vector = record_to_vector(content.array_records[MODEL_KEY], layout)
        except ValueError as error:
            return str(error)
        if not torch.isfinite(vector).all():
            return "returned non-finite (NaN/Inf) parameters"
        extras = record_to_tensors(content.array_records.get(EXTRAS_KEY))
        if any(not torch.isfinite(extra).all() for extra in extras.values()):
            return "returned non-finite extras"
        chain.vector = vector
        chain.extras = extras
        chain.samples += samples
        chain.steps += steps
        chain.seconds += seconds
        chain.position += 1
        return None

    def updates(self, timeout_seconds: float | None) -> Iterator[ClientUpdate]:
        """The finished chains' updates, in plan order (the simulator's order, so a
        running sum adds the same numbers in the same order)."""
        for chain in self.chains:
            if chain.failure is not None:
                continue
            if timeout_seconds is not None and chain.seconds > timeout_seconds:
                chain.fail(
                    f"took {chain.seconds:.1f}s, over train.failures.client_timeout_seconds={timeout_seconds}"
                )
                logger.warning(
                    "round %d: dropped client(s) %s: %s",
                    self.server_round,
                    chain.chain,
                    chain.failure,
                )
                continue
            yield ClientUpdate(
                client_id=chain.chain[-1],
                vector=chain.vector,
                weight=float(chain.samples) if self.plan.weighting == "samples" else 1.0,
                num_steps=chain.steps,
                extras=chain.extras,
                chain=list(chain.chain),
                seconds=chain.seconds,
            )

    @property
    def failures(self) -> int:
        return sum(chain.failure is not None for chain in self.chains)
