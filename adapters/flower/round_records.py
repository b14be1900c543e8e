"""When a :class:`~.strategy.FedplugStrategy` round is recorded.

Flower's loop trains and aggregates a round (``aggregate_train``), then evaluates it on
the nodes (``aggregate_evaluate``) and centrally (``evaluate_fn``), in an order the
strategy does not choose, and a strategy driven by another one's ``start`` may see no
central evaluation at all. :class:`RoundRecords` holds the aggregated round until the
evaluations it waits for have come, or the next round or the run's end says no more
will; :meth:`RoundRecords.finish` is the one place a round's record is written.

It also holds what a round tells the user: Flower's own log lines in Flower's wording
(:func:`log_sampled`, :func:`log_received`), the server-side counters kept apart from
the clients' metrics (:func:`server_counters`, :class:`FedplugResult`), the grouper's
line (:func:`grouping_line`) and fedplug's round line (:func:`log_round`).
"""

from __future__ import annotations

import logging
import math
import pprint
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import MetricRecord
from flwr.serverapp.strategy import Result

from fedplug.components import RoundPlan
from fedplug.run.federated_round import AggregatedRound, Evaluation, RoundCore
from fedplug.run.results import RoundRecord

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers
flower_logger = logging.getLogger("flwr")
"""Flower's own logger (``flwr.common.logger.log`` logs to it), for Flower's lines."""


@dataclass
class FinishedRound:
    """A round trained and aggregated, waiting for its evaluation before it is recorded."""

    round_number: int
    plan: RoundPlan
    attempt: AggregatedRound
    payload_bytes: int
    started: float
    central: MetricRecord | None = None
    federated: MetricRecord | None = None


class RoundRecords:
    """The aggregated round waiting for its evaluations, recorded by ``write`` once they
    have come (or no more will)."""

    def __init__(self, write: Callable[[FinishedRound], None]) -> None:
        self._write = write
        self.pending: FinishedRound | None = None
        self.central_expected = False
        """Whether Flower's loop calls an ``evaluate_fn`` after each round (set by
        ``start``): the record then waits for it after the nodes' evaluation."""

    def trained(self, finished: FinishedRound) -> None:
        """A round was aggregated: hold it for its evaluations."""
        self.pending = finished

    def round_starting(self, round_number: int) -> None:
        """Round ``round_number`` starts: an earlier round still held is recorded as it is."""
        if self.pending is not None and self.pending.round_number != round_number:
            self.finish()

    def evaluated_on_nodes(self, round_number: int, spread: MetricRecord | None) -> None:
        """The nodes evaluated round ``round_number`` (``spread``: their accuracy's mean
        and spread); recorded now unless a central evaluation is still to come."""
        if self.pending is not None and self.pending.round_number == round_number:
            self.pending.federated = spread
            if not self.central_expected:
                self.finish()

    def evaluated_centrally(self, metrics: MetricRecord | None) -> None:
        """Flower's ``evaluate_fn`` evaluated the round held: record it."""
        if self.pending is not None:
            self.pending.central = metrics
            self.finish()

    def finish(self) -> None:
        """Record the round held, if any (the run's end calls this too)."""
        finished, self.pending = self.pending, None
        if finished is None:
            return
        self._write(finished)


def record_round(
    core: RoundCore, finished: FinishedRound, evaluation: Evaluation, bytes_so_far: int
) -> RoundRecord:
    """The round core's record of a finished round, evaluated as ``evaluation``."""
    return core.record(
        finished.round_number - 1,
        finished.plan,
        finished.attempt,
        evaluation,
        payload_bytes=finished.payload_bytes,
        bytes_so_far=bytes_so_far,
        started=finished.started,
    )


def log_round(record: RoundRecord, finished: FinishedRound) -> None:
    """One log line per recorded round (an accuracy not evaluated reads ``n/a``)."""
    tally = finished.attempt.tally
    logger.info(
        "fedplug round %d: %d/%d chains accepted, %d failed, %d attempt(s), "
        "accuracy %s, client accuracy %s, %.2fs",
        record.round,
        tally.accepted,
        len(finished.plan.chains),
        tally.failures,
        finished.attempt.attempts,
        _shown(record.accuracy),
        _shown(record.client_accuracy_mean),
        record.seconds,
    )


def _shown(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}"


# ------------------------------------------------------------ Flower's own log lines


def log_sampled(stage: str, sampled: int, connected: int) -> None:
    """Flower's ``FedAvg`` line for a round's sample (``stage``: ``configure_train`` or
    ``configure_evaluate``), in its wording and through its logger."""
    flower_logger.info("%s: Sampled %s nodes (out of %s)", stage, sampled, connected)


def log_received(stage: str, results: int, failures: int) -> None:
    """Flower's ``FedAvg`` line for a round's replies (``stage``: ``aggregate_train``
    or ``aggregate_evaluate``): replies with content, and error replies."""
    flower_logger.info("%s: Received %s results and %s failures", stage, results, failures)


# -------------------------------------------------------- server-side counters


def server_counters(attempt: AggregatedRound) -> MetricRecord:
    """What the server counted in a round, kept out of the clients' own metrics: the
    chains accepted and failed, the bytes the accepted ones sent up, and the attempts
    ``train.failures`` allowed."""
    tally = attempt.tally
    return MetricRecord(
        {
            "accepted": tally.accepted,
            "failures": tally.failures,
            "bytes-up": tally.bytes_up,
            "attempts": attempt.attempts,
        }
    )


@dataclass
class FedplugResult(Result):
    """Flower's :class:`Result` plus :attr:`train_metrics_serverapp`: per round, what
    the server counted while training (:func:`server_counters`), next to the clients'
    own metrics in ``train_metrics_clientapp`` as Flower's naming pairs them."""

    train_metrics_serverapp: dict[int, MetricRecord] = field(default_factory=dict)

    def __repr__(self) -> str:
        counters = {
            server_round: dict(metrics.items())
            for server_round, metrics in self.train_metrics_serverapp.items()
        }
        return (
            super().__repr__()
            + "ServerApp-side Train Metrics:\n"
            + pprint.pformat(counters, indent=2)
            + "\n"
        )


# ------------------------------------------------------------------- the grouper


def grouping_line(grouper: str, plan: RoundPlan) -> str | None:
    """What grouper ``grouper`` does with a round's sampled nodes, in one plain
    sentence read from ``plan`` alone: how many groups it formed of how many sampled
    nodes, how many groups train and of what size (each group's nodes one after
    another), and how many sampled nodes sit idle (``None``: a round nobody trains)."""
    if not plan.chains:
        return None
    groups = plan.groups if plan.groups is not None else plan.chains
    sampled = sum(len(group) for group in groups)
    training = sum(len(chain) for chain in plan.chains)
    sizes = "/".join(str(size) for size in sorted({len(chain) for chain in plan.chains}))
    in_turn = ", each group's nodes one after another" if any(len(c) > 1 for c in plan.chains) else ""
    return (
        f"fedplug grouper {grouper}: the {sampled} sampled nodes form {len(groups)} group(s); "
        f"{len(plan.chains)} group(s) of {sizes} node(s) train{in_turn}; "
        f"{sampled - training} sampled node(s) sit idle"
    )
