"""Evaluation on the server side of a :class:`~.strategy.FedplugStrategy` run.

- central, on the server's test set: :func:`central_evaluation` makes an ``evaluate_fn``
  (the simulator's evaluator), :func:`central_metrics` is the round's central metrics,
  and :func:`round_evaluation` turns a round's metric records into the round core's
  :class:`~fedplug.run.federated_round.Evaluation`;
- federated, on the local test split of a seeded sample of the nodes (Flower's
  ``fraction_evaluate`` / ``min_evaluate_nodes``): :func:`nodes_to_evaluate`,
  :func:`evaluate_messages` and :func:`federated_metrics` (the replies averaged, plus the
  per-client accuracy spread).

Both read the user's accuracy under the name the user gave it (:class:`AccuracyKeys`:
``accuracy``, ``eval_acc``, ``acc`` or ``FedplugStrategy(accuracy_key=...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from torch import Tensor, nn

from fedplug.run.evaluation import evaluate_held_out
from fedplug.run.federated_round import Evaluation
from fedplug.run.vectors import vector_to_model

from .messages import MetricsAggregation, client_accuracy, evaluate_message
from .node_sampling import evaluation_count
from .node_setup import NodeMessages
from .priors import NodeDirectory
from .records import (
    ACCURACY,
    LOSS,
    METRICS_KEY,
    NUM_EXAMPLES,
    ROUND,
    number,
    record_to_vector,
    vector_layout,
)
from .reply_matching import answering_replies
from .round_records import log_received, log_sampled

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

CentralEvaluation = Callable[[int, ArrayRecord], "MetricRecord | None"]
EVALUATION_STREAM = 0xE7A1
"""Tag of the generator that samples a round's evaluating clients: ``[seed, round_index,
tag]``, apart from training's stream (:data:`fedplug.run.round_plan.SAMPLING_STREAM`)."""
ACCURACY_KEYS = (ACCURACY, "eval_acc", "acc")
"""The names an accuracy goes by in Flower apps (the quickstart's ClientApp sends
``eval_acc``), looked for in this order when no ``accuracy_key`` is given."""


@dataclass
class AccuracyKeys:
    """Where the user's accuracy is in a MetricRecord: under ``accuracy_key`` when the
    user named it, else under the first of :data:`ACCURACY_KEYS` present. A record of
    metrics without it is named in one warning per source (the clients' evaluate
    replies, the central ``evaluate_fn``), instead of an accuracy silently NaN."""

    accuracy_key: str | None = None
    warned: set[str] = field(default_factory=set)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.accuracy_key,) if self.accuracy_key is not None else ACCURACY_KEYS

    def key_in(self, metrics: Mapping[str, Any], source: str) -> str | None:
        """The accuracy's key in ``metrics`` (``None``: none there, warned once per
        ``source`` when ``metrics`` holds other metrics)."""
        found = next((name for name in self.names if name in metrics), None)
        if found is None and source not in self.warned and set(metrics) - {NUM_EXAMPLES}:
            self.warned.add(source)
            looked_for = " or ".join(repr(name) for name in self.names)
            logger.warning(
                "fedplug: the %s send no accuracy under %s (they send %s); fedplug's "
                "accuracy stays n/a: pass FedplugStrategy(accuracy_key=...) naming yours",
                source,
                looked_for,
                sorted(metrics),
            )
        return found

    def central(self, metrics: MetricRecord | None) -> MetricRecord | None:
        """The central ``evaluate_fn``'s ``metrics`` with the accuracy, wherever the user
        put it, also under ``accuracy`` (the round records read that); a copy."""
        if metrics is None:
            return None
        key = self.key_in(metrics, "central evaluate_fn's metrics")
        if key is None or key == ACCURACY:
            return metrics
        return MetricRecord({**dict(metrics.items()), ACCURACY: metrics[key]})

    def of_reply(self, metrics: Mapping[str, Any]) -> str | None:
        """The accuracy's key in a client's evaluate reply (see :meth:`key_in`)."""
        return self.key_in(metrics, "clients' evaluate replies")


def central_evaluation(
    model: nn.Module, test_x: Tensor, test_y: Tensor, batch_size: int = 1000
) -> CentralEvaluation:
    """An ``evaluate_fn`` for :meth:`FedplugStrategy.start`: accuracy and mean
    cross-entropy on a held-out test set, by the simulator's own evaluation
    (:func:`fedplug.run.evaluation.evaluate_held_out`)."""
    layout = vector_layout(model)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        vector_to_model(record_to_vector(arrays, layout).to(test_x.device), model)
        evaluation = evaluate_held_out(model, test_x, test_y, batch_size)
        return MetricRecord({ACCURACY: evaluation.accuracy, LOSS: evaluation.loss})

    return evaluate


def central_metrics(
    central: MetricRecord | None,
    evaluate_fn: CentralEvaluation | None,
    round_number: int,
    arrays: Callable[[], ArrayRecord],
) -> MetricRecord | None:
    """A round's central metrics: those of the ``evaluate_fn`` Flower's loop called, or,
    when this strategy is driven by another one's ``start`` (a DP wrapper, which keeps
    its ``evaluate_fn`` to itself), the constructor's ``evaluate_fn`` on ``arrays()``."""
    if central is None and evaluate_fn is not None:  # driven by another start()
        central = evaluate_fn(round_number, arrays())
    return central


def round_evaluation(central: MetricRecord | None, federated: MetricRecord | None) -> Evaluation:
    """The round core's :class:`Evaluation` of a round: central ``accuracy`` and ``loss``,
    the clients' accuracy mean and spread; NaN for what was not evaluated."""
    nan = float("nan")
    return Evaluation(
        number(central, ACCURACY, nan) if central is not None else nan,
        number(central, LOSS, nan) if central is not None else nan,
        number(federated, "client-accuracy-mean", nan) if federated is not None else nan,
        number(federated, "client-accuracy-std", nan) if federated is not None else nan,
    )


def nodes_to_evaluate(
    directory: NodeDirectory, grid: Grid, share: tuple[float, int], seed: int, round_index: int
) -> dict[int, int]:
    """node id -> client id of the clients that evaluate round ``round_index`` (0-based):
    :func:`.node_sampling.evaluation_count` (``share``: ``fraction_evaluate``,
    ``min_evaluate_nodes``) of the run's clients whose node is connected, drawn with the
    round's evaluation stream (the same on a rerun), all of them when the count covers
    them. Logs Flower's ``configure_evaluate: Sampled N nodes (out of M)`` line."""
    connected = set(grid.get_node_ids())
    candidates = [(node, client) for client, node in sorted(directory.node_of.items()) if node in connected]
    count = evaluation_count(len(candidates), *share)
    if count < len(candidates):
        rng = np.random.default_rng([seed, round_index, EVALUATION_STREAM])
        picked = np.sort(rng.choice(len(candidates), size=count, replace=False))
        candidates = [candidates[int(index)] for index in picked]
    log_sampled("configure_evaluate", len(candidates), len(connected))
    return dict(candidates)


def evaluate_messages(
    evaluating: Mapping[int, int],
    round_number: int,
    arrays: ArrayRecord,
    config: Mapping[str, Any],
    messages: NodeMessages,
    num_clients: int,
) -> list[Message]:
    """One ``evaluate`` message per node of ``evaluating``, in client order."""
    return [
        evaluate_message(
            node,
            round_number,
            arrays,
            {**messages.for_client(round_number, client, num_clients), **config, ROUND: round_number},
        )
        for node, client in sorted(evaluating.items(), key=lambda item: item[1])
    ]


def federated_metrics(
    replies: Iterable[Message],
    evaluating: Mapping[int, int],
    round_number: int,
    aggregate: MetricsAggregation,
    accuracy: AccuracyKeys,
    sent: Iterable[Message] | None = None,
) -> tuple[MetricRecord | None, MetricRecord | None]:
    """The clients' evaluate metrics averaged by ``aggregate`` (weighted by
    ``num-examples``) with the mean and (population) spread of their accuracy
    (``accuracy`` says under which key) added (:func:`.messages.client_accuracy`), and
    that spread alone (``None``: none). Logs Flower's ``aggregate_evaluate: Received N
    results and M failures`` line when there are replies.

    ``sent`` (the evaluate messages, after the grid pushed them) keeps only the replies
    that answer one of them, once each, from the node it went to
    (:func:`.reply_matching.answering_replies`): a duplicated or forged reply cannot
    count twice or speak for another node. ``None``: every reply from a node of
    ``evaluating``."""
    if sent is not None:
        replies = answering_replies(sent, replies, f"round {round_number}'s evaluate messages")
    replies = list(replies)
    if replies:
        errors = sum(reply.has_error() for reply in replies)
        log_received("aggregate_evaluate", len(replies) - errors, errors)
    # Only the nodes asked: a reply from any other is not one of this run's clients.
    usable = [
        reply.content
        for reply in replies
        if not reply.has_error() and reply.metadata.src_node_id in evaluating
    ]
    metrics = aggregate(usable, NUM_EXAMPLES) if usable else None
    spread = client_accuracy(replies, evaluating, round_number, accuracy.of_reply)
    if spread is not None:
        metrics = metrics if metrics is not None else MetricRecord()
        for key, value in spread.items():
            metrics[key] = value
    if metrics is not None and not len(metrics):
        metrics = None
    return metrics, spread
