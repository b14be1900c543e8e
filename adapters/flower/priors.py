"""Before round 1: which node holds which client, and (when a component asks) every
node's class counts, by a Flower ``query`` message.

FedShift's global prior ``P(y)`` and FedGSP's grouping need the K x C class-count matrix
of all clients (``ClientNeeds.class_counts``). The built-in simulator reads it from the
federation; on Flower the server sends one ``query`` message to each node and every node
answers with its partition id and its C class counts (:meth:`FedplugTrainer.describe`),
never with data. The server then prepares the loss transform and the grouper from the
gathered matrix, exactly as the simulator does from its own.

When nothing needs the counts, no query is sent (a stock ClientApp has no ``query``
handler): clients are numbered in the order of the node ids
(:func:`node_order_directory`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedplug.errors import TrainingError
from fedplug.run.client_text import client_text

from .capabilities import quiet_flower
from .decoding import MAX_NUM_EXAMPLES, MalformedReply, parse_integer
from .records import (
    CLASS_COUNTS,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_CLASSES,
    NUM_CLIENTS,
    NUM_PARTITIONS,
    PARTITION_ID,
    integer,
)
from .reply_matching import answering_replies

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

MAX_NODES = 2**31 - 1
"""Largest ``partition-id`` / ``num-partitions`` a node may report."""


@dataclass(frozen=True)
class ClassCounts:
    """What :meth:`fedplug.components.LossTransform.prepare` receives on a federated
    runtime: the K x C ``class_counts`` and ``num_clients`` (a stand-in for the
    simulator's Federation, which also holds the data that never leaves a Flower node)."""

    class_counts: np.ndarray
    num_clients: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_clients", int(self.class_counts.shape[0]))


NO_QUERY_HANDLER = "No query function registered"
"""What a Flower 1.41 ClientApp without ``@app.query()`` answers a query with."""


@dataclass(frozen=True)
class NodeDirectory:
    """Which node holds which fedplug client, and the clients' class counts."""

    node_of: dict[int, int]
    """client id -> Flower node id."""
    class_counts: np.ndarray | None
    """K x C, or ``None`` when no node was asked (nothing needed them)."""

    @property
    def num_clients(self) -> int:
        return len(self.node_of)

    @property
    def client_sizes(self) -> np.ndarray | None:
        """The clients' training-set sizes (``None`` when the counts are unknown)."""
        if self.class_counts is None:
            return None
        sizes: np.ndarray = self.class_counts.sum(axis=1)
        return sizes

    def counts_or_zeros(self, num_classes: int | None) -> np.ndarray:
        """The class counts, or K x C zeros when none were gathered (what
        :meth:`fedplug.components.Grouper.prepare` receives then)."""
        if self.class_counts is not None:
            return self.class_counts
        return np.zeros((self.num_clients, num_classes or 0), dtype=np.int64)


def node_order_directory(node_ids: Sequence[int], num_clients: int) -> NodeDirectory:
    """Clients 0..K-1 on the first K of the sorted ``node_ids`` (no query sent).

    Extra nodes are ignored with a warning.
    """
    chosen = sorted(node_ids)[:num_clients]
    extra = sorted(node_ids)[num_clients:]
    if extra:
        logger.warning(
            "ignoring %d nodes beyond the %d clients: %s", len(extra), num_clients, extra
        )
    return NodeDirectory(node_of=dict(enumerate(chosen)), class_counts=None)


def wait_for_nodes(
    grid: Grid, count: int, wait_seconds: float, what: str = "data.num_clients"
) -> list[int]:
    """The connected node ids once at least ``count`` (``what``) are connected.

    Raises:
        TrainingError: fewer than ``count`` nodes connected within ``wait_seconds``.
    """
    deadline = time.monotonic() + wait_seconds
    while len(node_ids := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TrainingError(
                f"only {len(node_ids)} of the {count} nodes ({what}) connected within "
                f"{wait_seconds:.0f}s; start one SuperNode per client with --node-config "
                f"'partition-id=<k> num-partitions={count}'"
            )
        time.sleep(0.1)
    return node_ids


Report = tuple[int, int, list[int]]
"""What a node answers the query with: ``(partition-id, num-partitions, class counts)``,
-1 for an id its node config lacks."""


def gather_class_counts(
    grid: Grid,
    num_clients: int | None,
    num_classes: int,
    *,
    config: Mapping[str, Any] | None = None,
    wait_seconds: float = 300.0,
    timeout: float | None = None,
    node_ids: Sequence[int] | None = None,
    requirement: str | None = None,
) -> NodeDirectory:
    """Query every node for its partition id and class counts.

    Nodes name their client by ``partition-id`` in their node config (the Flower
    convention, which the simulation runtime sets too). When no node has one, clients
    are numbered in the order of the node ids. Extra nodes beyond ``num_clients`` are
    ignored with a warning.

    Args:
        grid: the ServerApp's grid.
        num_clients: K, the clients the experiment expects; ``None``: the
            ``num-partitions`` the nodes report (waiting for that many nodes: a
            simulation's nodes connect one by one), else the nodes asked.
        num_classes: C, sent to the nodes (``fedplug.num-classes``).
        config: more entries for the query's ConfigRecord (the ready apps send the
            experiment here).
        wait_seconds: how long to wait for K nodes to connect (default 300).
        timeout: how long to wait for the replies (default: no limit).
        node_ids: the nodes to ask first (default: every connected node, once at least
            ``num_clients`` are connected).
        requirement: the one line that says what the ClientApp must add, raised when a
            node has no query handler (default: a generic hint).

    Raises:
        TrainingError: a node failed to answer or answered malformed (its counts not
            C integers in ``[0, 10**9]``, its ids not integers), the nodes report
            different ``num-partitions``, or the partition ids do not cover 0..K-1 exactly
            once; the message names the node and says what to fix.
    """
    if node_ids is None:
        node_ids = wait_for_nodes(grid, num_clients or 1, wait_seconds)
    node_ids = sorted(node_ids)

    def ask(nodes: Sequence[int], size: int) -> dict[int, Report]:
        entries = {NUM_CLIENTS: size, NUM_CLASSES: num_classes, **(config or {})}
        return _ask_class_counts(grid, nodes, entries, num_classes, timeout, requirement)

    reports = ask(node_ids, num_clients or len(node_ids))
    if num_clients is None:
        num_clients = _declared_size(reports)
        if num_clients > len(reports):
            connected = wait_for_nodes(grid, num_clients, wait_seconds, "num-partitions")
            reports |= ask([node for node in connected if node not in reports], num_clients)
    return _directory(reports, num_clients, num_classes)


def _ask_class_counts(
    grid: Grid,
    node_ids: Sequence[int],
    entries: Mapping[str, Any],
    num_classes: int,
    timeout: float | None,
    requirement: str | None,
) -> dict[int, Report]:
    """Every node's :data:`Report`, by one ``query`` message each (see
    :func:`gather_class_counts`)."""
    messages = [
        Message(
            RecordDict({CONFIG_KEY: ConfigRecord(dict(entries))}),
            dst_node_id=node,
            message_type=MessageType.QUERY,
        )
        for node in node_ids
    ]
    # One node first: a ClientApp without a query handler fails once, not on every node
    # (all SuperNodes of a run execute the same ClientApp).
    with quiet_flower(NO_QUERY_HANDLER):
        replies = list(grid.send_and_receive(messages[:1], timeout=timeout))
    if not (replies and replies[0].has_error() and NO_QUERY_HANDLER in replies[0].error.reason):
        replies += list(grid.send_and_receive(messages[1:], timeout=timeout)) if messages[1:] else []
    # Only a reply to a message of this query, once, from its node: a duplicated or
    # forged reply cannot replace a node's own counts.
    answered = {
        reply.metadata.src_node_id: reply
        for reply in answering_replies(messages, replies, "the class-count query")
    }
    reports: dict[int, Report] = {}
    for node in node_ids:
        reply = answered.get(node)
        if reply is None:
            raise TrainingError(
                f"node {node} did not answer the class-count query within {timeout}s"
            )
        hint = requirement or (
            "its ClientApp needs a query handler: `@app.query()` returning "
            "trainer.describe(data, message, context)"
        )
        if reply.has_error():
            if NO_QUERY_HANDLER in reply.error.reason:
                raise TrainingError(f"node {node} has no @app.query() handler; {hint}")
            raise TrainingError(
                f"node {node} failed to report its class counts: {client_text(reply.error.reason)}"
            )
        metrics = reply.content.metric_records.get(METRICS_KEY)
        if metrics is None or CLASS_COUNTS not in metrics:
            raise TrainingError(
                f"node {node} answered the class-count query without {CLASS_COUNTS!r}; {hint}"
            )
        try:
            counts = _class_counts(metrics[CLASS_COUNTS], num_classes)
            partition = integer(metrics, PARTITION_ID, -1, low=-1, high=MAX_NODES)
            partitions = integer(metrics, NUM_PARTITIONS, -1, low=-1, high=MAX_NODES)
        except ValueError as error:
            raise TrainingError(
                f"node {node} {error} in its class-count reply; the server needs every "
                "client's counts, so the run stops (fix or remove that node)"
            ) from None
        reports[node] = (partition, partitions, counts)
    return reports


def _declared_size(reports: Mapping[int, Report]) -> int:
    """K when the experiment does not fix it: the ``num-partitions`` every node reports,
    else (no node reports one) the number of nodes.

    Raises:
        TrainingError: the nodes report different ``num-partitions``.
    """
    declared = {node: partitions for node, (_, partitions, _) in reports.items() if partitions >= 0}
    sizes = sorted(set(declared.values()))
    if len(sizes) > 1:
        by_size = {size: [node for node, value in declared.items() if value == size] for size in sizes}
        raise TrainingError(
            f"the nodes report different num-partitions ({by_size}); restart them with one "
            "num-partitions, the number of clients"
        )
    return sizes[0] if sizes else len(reports)


def _class_counts(values: Any, num_classes: int) -> list[int]:
    """A node's reported class counts: a list of ``num_classes`` integers, each in
    ``[0, MAX_NUM_EXAMPLES]`` (:mod:`.decoding`).

    Raises:
        ValueError: anything else (a number, a list of another length, ``inf``, ``NaN``,
            a negative or fractional count); the text says which.
    """
    if not isinstance(values, list):
        raise MalformedReply(
            f"sent {CLASS_COUNTS!r} as {type(values).__name__}, not a list of counts"
        )
    if len(values) != num_classes:
        raise MalformedReply(
            f"sent {len(values)} class counts, the experiment has {num_classes} classes"
        )
    return [parse_integer(value, CLASS_COUNTS, 0, MAX_NUM_EXAMPLES) for value in values]


def _directory(
    reports: Mapping[int, Report], num_clients: int, num_classes: int
) -> NodeDirectory:
    partitioned = {node: report for node, report in reports.items() if report[0] >= 0}
    if not partitioned:
        chosen = sorted(reports)[:num_clients]
        node_of = {client: node for client, node in enumerate(chosen)}
    else:
        if len(partitioned) != len(reports):
            missing = sorted(set(reports) - set(partitioned))
            raise TrainingError(
                f"nodes {missing} have no partition-id in their node config while others do; give every node one"
            )
        node_of = {}
        for node, (partition, partitions, _) in sorted(partitioned.items()):
            if partitions not in (-1, num_clients):
                raise TrainingError(
                    f"node {node} has num-partitions={partitions} but the experiment has "
                    f"data.num_clients={num_clients}; restart it with num-partitions={num_clients}"
                )
            if partition >= num_clients:
                logger.warning(
                    "ignoring node %d: partition-id %d is beyond data.num_clients=%d",
                    node,
                    partition,
                    num_clients,
                )
                continue
            if partition in node_of:
                raise TrainingError(
                    f"nodes {node_of[partition]} and {node} both have partition-id={partition}"
                )
            node_of[partition] = node
        missing_clients = sorted(set(range(num_clients)) - set(node_of))
        if missing_clients:
            raise TrainingError(
                f"no connected node has partition-id {missing_clients}; start one per missing id"
            )
    extra = sorted(set(reports) - set(node_of.values()))
    if extra and not partitioned:
        logger.warning(
            "ignoring %d nodes beyond data.num_clients=%d: %s", len(extra), num_clients, extra
        )
    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    for client, node in node_of.items():
        counts[client] = reports[node][2]
    return NodeDirectory(node_of=node_of, class_counts=counts)
