"""When a :class:`~.strategy.FedplugStrategy` round is recorded.

Flower's loop trains and aggregates a round (``aggregate_train``), then evaluates it on
the nodes (``aggregate_evaluate``) and centrally (``evaluate_fn``), in an order the
strategy does not choose, and a strategy driven by another one's ``start`` may see no
central evaluation at all. :class:`RoundRecords` holds the aggregated round until the
evaluations it waits for have come, or the next round or the run's end says no more
will; :meth:`RoundRecords.finish` is the one place a round's record is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import MetricRecord

from fedplug.components import RoundPlan
from fedplug.run.federated_round import AggregatedRound, Evaluation, RoundCore
from fedplug.run.results import RoundRecord

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers


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
    """One log line per recorded round."""
    tally = finished.attempt.tally
    logger.info(
        "fedplug round %d: %d/%d chains accepted, %d failed, %d attempt(s), "
        "accuracy %.4f, client accuracy %.4f, %.2fs",
        record.round,
        tally.accepted,
        len(finished.plan.chains),
        tally.failures,
        finished.attempt.attempts,
        record.accuracy,
        record.client_accuracy_mean,
        record.seconds,
    )
