"""The messages :class:`~.strategy.FedplugStrategy` sends each round, and the summaries
of the nodes' replies (see :mod:`.records` for the layout): Flower's weighted mean of
their metrics, and the simulator's per-client accuracy spread."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from .decoding import MAX_NUM_EXAMPLES, finite_number
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
)

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]
"""Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` signature: the
replies' contents and the weighting key -> one MetricRecord."""
FEDPLUG_PREFIX = "fedplug."
"""fedplug's own bookkeeping entries (client id, steps, seconds), never averaged."""
METRIC_RANGES: dict[str, tuple[float, float]] = {ACCURACY: (0.0, 1.0)}
"""The values a reply's metric may take, where its meaning bounds them; a value outside
is left out of every average (other metrics need only be finite)."""


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
    each metric is averaged over the replies that carry it and a positive weight.

    A reply is another party's: its weight counts only when it is a number in
    ``(0, MAX_NUM_EXAMPLES]``, and a value only when it is finite (an ``accuracy`` also
    in ``[0, 1]``, a list only when all its items are); anything else is left out, so
    one client cannot make the mean NaN, infinite or absurd."""
    sums: dict[str, Any] = {}
    totals: dict[str, float] = {}
    for content in contents:
        weight = _weight(content, weighted_by_key)
        if weight is None:
            continue
        for record in content.metric_records.values():
            for key, value in record.items():
                if key == weighted_by_key or key.startswith(FEDPLUG_PREFIX):
                    continue
                usable = _usable_value(key, value)
                if usable is None:
                    continue
                if isinstance(usable, list):
                    scaled: Any = [item * weight for item in usable]
                    current = sums.get(key)
                    if isinstance(current, list) and len(current) == len(scaled):
                        scaled = [a + b for a, b in zip(current, scaled, strict=True)]
                    elif current is not None:
                        continue  # a shape that disagrees with the other replies'
                else:
                    current = sums.get(key, 0.0)
                    if isinstance(current, list):
                        continue  # a number where the other replies sent a list
                    scaled = usable * weight + float(current)
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


def _weight(content: RecordDict, weighted_by_key: str) -> float | None:
    """The reply's weight when it is a number in ``(0, MAX_NUM_EXAMPLES]``, else ``None``."""
    for record in content.metric_records.values():
        if weighted_by_key not in record:
            continue
        try:
            weight = finite_number(record[weighted_by_key], weighted_by_key, 0.0, MAX_NUM_EXAMPLES)
        except ValueError:
            return None
        return weight if weight > 0 else None
    return None


def _usable_value(key: str, value: Any) -> float | list[float] | None:
    """``value`` as a finite float (or a list of them) within ``key``'s known range, else
    ``None``."""
    low, high = METRIC_RANGES.get(key, (-math.inf, math.inf))
    items = value if isinstance(value, list) else [value]
    try:
        numbers = [finite_number(item, key, low, high) for item in items]
    except ValueError:
        return None
    return numbers if isinstance(value, list) else numbers[0]


def client_accuracy(
    replies: Iterable[Message],
    client_of_node: Mapping[int, int],
    server_round: int,
    accuracy_key_of: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> MetricRecord | None:
    """Mean and (population) spread of the per-client accuracies, over the clients with
    a non-empty local test split that report an accuracy (the simulator's definition);
    ``None`` when none does. ``accuracy_key_of`` says under which key a reply's metrics
    hold it (default: ``accuracy``). A client whose ``num-examples`` is not an integer in
    ``[0, MAX_NUM_EXAMPLES]`` or whose accuracy is not a number in ``[0, 1]`` is left
    out, with a warning."""
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
        if client is None or metrics is None:
            continue
        if accuracy_key_of is not None:
            key = accuracy_key_of(metrics)
        else:
            key = ACCURACY if ACCURACY in metrics else None
        if key is None:
            continue  # a ClientApp of its own may name its metrics otherwise
        try:
            if integer(metrics, NUM_EXAMPLES, 0, low=0, high=MAX_NUM_EXAMPLES) > 0:
                low, high = METRIC_RANGES[ACCURACY]
                accuracies[client] = finite_number(metrics[key], key, low, high)
        except ValueError as error:
            logger.warning(
                "round %d: client %s %s; left out of the client accuracy",
                server_round,
                client,
                error,
            )
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
