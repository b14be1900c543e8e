"""The messages :class:`~.strategy.FedplugStrategy` sends each round, and the summaries
of the nodes' replies (see :mod:`.records` for the layout): Flower's weighted mean of
their metrics, and the simulator's per-client accuracy spread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from .records import (
    ACCURACY,
    CONFIG_KEY,
    LOSS_INFO_KEY,
    LOSS_STATE_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_EXAMPLES,
    PAYLOAD_KEY,
    integer,
    number,
)

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]
"""Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` signature: the
replies' contents and the weighting key -> one MetricRecord."""
FEDPLUG_PREFIX = "fedplug."
"""fedplug's own bookkeeping entries (client id, steps, seconds), never averaged."""


def train_message(
    node: int,
    server_round: int,
    model: ArrayRecord,
    config: Mapping[str, Any],
    *,
    payload: ArrayRecord | None,
    loss_state: tuple[ArrayRecord, ConfigRecord] | None,
) -> Message:
    """A ``train`` message: the model, its config, the aggregator's server payload and
    the loss transform's prepared state (each only when there is one)."""
    content = RecordDict({MODEL_KEY: model, CONFIG_KEY: ConfigRecord(dict(config))})
    if payload is not None:
        content[PAYLOAD_KEY] = payload
    if loss_state is not None:
        content[LOSS_STATE_KEY], content[LOSS_INFO_KEY] = loss_state
    return Message(
        content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(server_round)
    )


def evaluate_message(
    node: int, server_round: int, model: ArrayRecord, config: Mapping[str, Any]
) -> Message:
    """An ``evaluate`` message: the global model, for the node's local test split."""
    return Message(
        RecordDict({MODEL_KEY: model, CONFIG_KEY: ConfigRecord(dict(config))}),
        dst_node_id=node,
        message_type=MessageType.EVALUATE,
        group_id=str(server_round),
    )


def weighted_metrics(
    contents: Sequence[RecordDict], weighted_by_key: str = NUM_EXAMPLES
) -> MetricRecord:
    """Every metric of the replies averaged, weighted by ``weighted_by_key``, as Flower's
    ``FedAvg`` does (``aggregate_metricrecords``): the weighting key itself and fedplug's
    ``fedplug.*`` entries are left out, lists are averaged element-wise. Unlike Flower's,
    a reply without the weight, or a metric that only some replies carry, is tolerated:
    each metric is averaged over the replies that carry it and a positive weight."""
    sums: dict[str, Any] = {}
    totals: dict[str, float] = {}
    for content in contents:
        weight = _weight(content, weighted_by_key)
        if weight <= 0:
            continue
        for record in content.metric_records.values():
            for key, value in record.items():
                if key == weighted_by_key or key.startswith(FEDPLUG_PREFIX):
                    continue
                if isinstance(value, list):
                    scaled: Any = [float(item) * weight for item in value]
                    current = sums.get(key)
                    if isinstance(current, list) and len(current) == len(scaled):
                        scaled = [a + b for a, b in zip(current, scaled, strict=True)]
                    elif current is not None:
                        continue  # a shape that disagrees with the other replies'
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    scaled = float(value) * weight + float(sums.get(key, 0.0))
                else:
                    continue
                sums[key] = scaled
                totals[key] = totals.get(key, 0.0) + weight
    return MetricRecord(
        {
            key: [item / totals[key] for item in value]
            if isinstance(value, list)
            else value / totals[key]
            for key, value in sums.items()
        }
    )


def _weight(content: RecordDict, weighted_by_key: str) -> float:
    for record in content.metric_records.values():
        value = record.get(weighted_by_key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def client_accuracy(
    replies: Iterable[Message], client_of_node: Mapping[int, int], server_round: int
) -> MetricRecord | None:
    """Mean and (population) spread of the per-client accuracies, over the clients with
    a non-empty local test split that report ``accuracy`` (the simulator's definition);
    ``None`` when none does."""
    accuracies: dict[int, float] = {}
    for reply in replies:
        client = client_of_node.get(reply.metadata.src_node_id)
        if reply.has_error():
            reason = reply.error.reason
            logger.warning(
                "round %d: client %s failed to evaluate: %s", server_round, client, reason
            )
            continue
        metrics = reply.content.metric_records.get(METRICS_KEY)
        if client is None or metrics is None or ACCURACY not in metrics:
            continue  # a ClientApp of its own may name its metrics otherwise
        try:
            if integer(metrics, NUM_EXAMPLES, 0) > 0:
                accuracies[client] = number(metrics, ACCURACY)
        except ValueError as error:
            logger.warning("round %d: client %s %s", server_round, client, error)
    if not accuracies:
        return None
    values = np.array([accuracies[client] for client in sorted(accuracies)])
    return MetricRecord(
        {
            "client-accuracy-mean": float(values.mean()),
            "client-accuracy-std": float(values.std()),
            "clients-evaluated": len(values),
        }
    )
