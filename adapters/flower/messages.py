"""The messages :class:`~.strategy.FedplugStrategy` sends each round, and the summaries
of the nodes' replies (see :mod:`.records` for the layout): Flower's weighted mean of
their metrics, and the simulator's per-client accuracy spread."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedplug.run.client_text import client_text
from fedplug.run.reply_metrics import bounded_metrics

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
MAX_METRIC_RECORDS = 8
"""Most metric records of one reply averaged (Flower's and fedplug's replies carry one)."""
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

    A reply is another party's: its metrics are first bounded in size
    (:func:`fedplug.run.reply_metrics.bounded_metrics`: a 1,000,000-item list or a
    100 KB name is refused with a warning, without its items being read); its weight
    counts only when it is a number in ``(0, MAX_NUM_EXAMPLES]``, and a value only when
    it is finite (an ``accuracy`` also in ``[0, 1]``, a list only when all its items
    are). The mean is each value times its reply's share of the weight (at most 1),
    summed exactly (``math.fsum``): a convex combination of finite values, so it is
    never NaN or infinite (``train_loss = 1.7e308`` stays finite) nor outside the
    values' range; a metric whose sum would still overflow is left out with a warning.
    So one client cannot make the mean NaN, infinite or absurd."""
    weighted: dict[str, list[tuple[float, Any]]] = {}
    for content in contents:
        weight = _weight(content, weighted_by_key)
        if weight is None:
            continue
        for key, value in _bounded_entries(content):
            if key == weighted_by_key or key.startswith(FEDPLUG_PREFIX):
                continue
            usable = _usable_value(key, value)
            if usable is not None and _same_kind(weighted.get(key), usable):
                weighted.setdefault(key, []).append((weight, usable))
    means: dict[str, Any] = {}
    for key, values in weighted.items():
        mean = _weighted_mean(values)
        if mean is None:
            logger.warning("metric %r left out of the average: its weighted sum overflows", key)
        else:
            means[key] = mean
    return MetricRecord(means)


def _bounded_entries(content: RecordDict) -> list[tuple[str, Any]]:
    """The entries of a reply's metric records within the size bounds
    (:func:`~fedplug.run.reply_metrics.bounded_metrics`, each record on its own; at most
    :data:`MAX_METRIC_RECORDS` records), the refused ones named in one warning."""
    entries: list[tuple[str, Any]] = []
    refused: list[str] = []
    records = content.metric_records
    for name, record in itertools.islice(records.items(), MAX_METRIC_RECORDS):
        bounded = bounded_metrics(record)
        entries.extend(bounded.kept.items())
        if bounded.refused:
            refused.append(f"from {client_text(name, 60)!r}: {bounded.refusals()}")
    if len(records) > MAX_METRIC_RECORDS:
        refused.append(f"{len(records) - MAX_METRIC_RECORDS:,} metric records past the first")
    if refused:
        logger.warning("a reply's metrics left out of the average: %s", "; ".join(refused[:3]))
    return entries


def _same_kind(earlier: list[tuple[float, Any]] | None, value: float | list[float]) -> bool:
    """Whether ``value`` is of the kind of the first value kept for its metric (a number,
    or a list of the same length); a reply that disagrees is left out of that metric."""
    if not earlier:
        return True
    first = earlier[0][1]
    if isinstance(first, list):
        return isinstance(value, list) and len(value) == len(first)
    return not isinstance(value, list)


def _weighted_mean(values: list[tuple[float, Any]]) -> float | list[float] | None:
    """The weighted mean of ``(weight, value)`` pairs (values all numbers, or all lists
    of one length): ``fsum(weight / total * value)``, finite for finite values; ``None``
    when it would overflow all the same (rounding at the float range's edge)."""
    total = math.fsum(weight for weight, _ in values)
    shares = [weight / total for weight, _ in values]
    try:
        if isinstance(values[0][1], list):
            columns = zip(*(value for _, value in values), strict=True)
            mean: Any = [
                math.fsum(share * item for share, item in zip(shares, column, strict=True))
                for column in columns
            ]
            finite = all(math.isfinite(item) for item in mean)
        else:
            numbers = (value for _, value in values)
            mean = math.fsum(share * value for share, value in zip(shares, numbers, strict=True))
            finite = math.isfinite(mean)
    except OverflowError:
        return None
    return mean if finite else None


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
            reason = client_text(reply.error.reason)
            logger.warning(
                "round %d: client %s failed to evaluate: %s", server_round, client, reason
            )
            continue
        metrics = reply.content.metric_records.get(METRICS_KEY)
        if client is None or metrics is None:
            continue
        if accuracy_key_of is not None:
            # Only bounded names reach it: it names a reply's metrics in a warning.
            key = accuracy_key_of(bounded_metrics(metrics).kept)
        else:
            key = ACCURACY if ACCURACY in metrics else None
        if key is None or key not in metrics:
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
