"""The messages :class:`~.strategy.FedplugStrategy` sends each round, and the summary of
the nodes' evaluation replies (see :mod:`.records` for the layout)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
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

logger = logging.getLogger("fedplug.adapters.flower")


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


def client_accuracy(
    replies: Iterable[Message], client_of_node: Mapping[int, int], server_round: int
) -> MetricRecord | None:
    """Mean and (population) spread of the per-client accuracies, over the clients with
    a non-empty local test split (the simulator's definition); ``None`` when none."""
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
