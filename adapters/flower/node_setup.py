"""What :meth:`~.strategy.FedplugStrategy.setup` does once, before round 1, on the nodes:
tell which node holds which client (asking every node for its class counts only when
needed, :mod:`.priors`), and prepare the loss transform from those counts, running its
setup phase over messages when it declares one (:mod:`.setup_phase`).

:class:`NodeMessages` is what every message to a node carries besides its own entries
(the run's size, the number of classes, the strategy's ``message_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from fedplug.components import FederationSummary, PhaseCost
from fedplug.errors import TrainingError
from fedplug.run.components import Components

from .priors import NodeDirectory, gather_class_counts, node_order_directory
from .records import CLIENT_ID, NUM_CLASSES, NUM_CLIENTS, ROUND, encode_loss_state
from .setup_phase import SetupScreen, drive_setup_phase


@dataclass(frozen=True)
class NodeMessages:
    """The entries every message to a node carries: the strategy's ``message_config``
    (the ready apps send the experiment there), the number of clients and, when known,
    the number of classes."""

    message_config: dict[str, Any]
    num_classes: int | None

    def for_run(self, num_clients: int) -> dict[str, Any]:
        """The entries of a message to every node (a query, a setup-phase step)."""
        config = {NUM_CLIENTS: num_clients, **self.message_config}
        if self.num_classes is not None:
            config[NUM_CLASSES] = self.num_classes
        return config

    def for_client(self, round_number: int, client: int, num_clients: int) -> dict[str, Any]:
        """The entries of a train or evaluate message to ``client``'s node."""
        return {ROUND: round_number, CLIENT_ID: client, **self.for_run(num_clients)}


def find_clients(
    grid: Grid,
    node_ids: list[int],
    num_clients: int | None,
    *,
    query_nodes: bool,
    messages: NodeMessages,
    requirement: str | None,
    timeout: float | None,
    wait_seconds: float,
) -> NodeDirectory:
    """Which node holds which client: asked of every node with a ``query`` message
    (with its class counts) when ``query_nodes``, else the node ids' order.

    ``num_clients`` None: as many clients as the nodes' ``num-partitions`` (asked), else
    as ``node_ids``."""
    if not query_nodes:
        return node_order_directory(node_ids, num_clients or len(node_ids))
    return gather_class_counts(
        grid,
        num_clients,
        messages.num_classes or 0,
        config=messages.message_config,
        wait_seconds=wait_seconds,
        timeout=timeout,
        node_ids=node_ids,
        requirement=requirement,
    )


def prepare_components(
    grid: Grid,
    directory: NodeDirectory,
    counts: np.ndarray,
    components: Components,
    *,
    name: str,
    message_config: dict[str, Any],
    requirement: str | None,
    timeout: float | None,
    screen: SetupScreen | None = None,
) -> tuple[PhaseCost, tuple[ArrayRecord, ConfigRecord] | None, dict[int, str]]:
    """Prepare every component from the class counts, then run on the nodes the setup
    phase of every component that declares one (its replies screened by ``screen``,
    :func:`.setup_phase.drive_setup_phase`); return the setup's cost, the loss
    transform's (named ``name``) prepared state to send with every train message (``None``
    when it has none), and the clients a phase dropped (client id -> reason), which the
    run leaves out.

    Raises:
        ConfigError: the sampler or the aggregator declares a setup phase
            (:meth:`~fedplug.run.components.Components.distributed_setup_phases`).
        TrainingError: a node failed in the setup phase; when a node lacks the phase's
            handler, the message names what the ClientApp must add (``requirement``).
    """
    cost = components.prepare(FederationSummary(counts))
    dropped: dict[int, str] = {}
    # after prepare, which may have loaded a result
    for _, phase in components.distributed_setup_phases("Flower"):
        remaining = {client: node for client, node in directory.node_of.items() if client not in dropped}
        try:
            extra, lost = drive_setup_phase(
                grid, remaining, phase, message_config=message_config, timeout=timeout, screen=screen
            )
        except TrainingError as error:
            if "function registered" in str(error) and requirement:
                raise TrainingError(f"{error}; {requirement}") from None
            raise
        cost = cost + extra
        dropped.update(lost)
    state = components.loss_transform.state_dict()
    return cost, encode_loss_state(state, name) if state else None, dropped
