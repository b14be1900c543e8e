"""Which Flower nodes a :class:`~.strategy.FedplugStrategy` run and each of its rounds use.

:class:`NodeRule` holds the constructor's node arguments together: K fixed
(``num_clients``, the simulator's way) or the connected nodes sampled Flower's way
(``fraction_train``, ``min_train_nodes``, ``min_available_nodes``), and how long to wait
for them. It waits for the run's population before setup and, Flower's way, plans a
round among the nodes still connected; the round core does the seeded sampling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.serverapp import Grid

from fedplug.components import RoundPlan
from fedplug.errors import TrainingError
from fedplug.run.federated_round import RoundCore

from .priors import NodeDirectory

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers


@dataclass(frozen=True)
class NodeRule:
    """How many nodes a run and each round need, and how long to wait for them."""

    num_clients: int | None
    """K, one client per node; ``None``: the nodes connected when the run starts (or the
    ``num-partitions`` they report when queried, :func:`.priors.gather_class_counts`)."""
    fraction_train: float
    min_train_nodes: int
    min_available_nodes: int
    wait_seconds: float

    def wait_for_population(self, grid: Grid) -> list[int]:
        """The sorted ids of the connected nodes, once enough are connected: K with
        ``num_clients``, else Flower's ``max(min_available_nodes, min_train_nodes)``.

        Raises:
            TrainingError: too few nodes connected within ``node_wait_seconds``.
        """
        if self.num_clients is not None:
            needed, what = self.num_clients, "num_clients"
        else:
            needed = max(self.min_available_nodes, self.min_train_nodes)
            what = "max(min_available_nodes, min_train_nodes)"
        deadline = time.monotonic() + self.wait_seconds
        while len(node_ids := sorted(grid.get_node_ids())) < needed:
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"only {len(node_ids)} of the {needed} nodes needed ({what}) connected "
                    f"within {self.wait_seconds:.0f}s; start more nodes or lower {what}"
                )
            time.sleep(0.1)
        return node_ids

    def plan_among_connected(
        self, core: RoundCore, directory: NodeDirectory, grid: Grid, round_index: int
    ) -> RoundPlan:
        """Flower's sampling (``FedAvg.configure_train``), seeded: of the clients whose
        node is connected (sorted), ``max(int(fraction_train * n), min_train_nodes)``,
        once ``max(min_available_nodes, that)`` are connected; then the grouper's chains.

        Raises:
            TrainingError: too few nodes connected within ``node_wait_seconds``.
        """
        deadline = time.monotonic() + self.wait_seconds
        while True:
            connected = set(grid.get_node_ids())
            candidates = [
                client for client, node in sorted(directory.node_of.items()) if node in connected
            ]
            size = max(int(len(candidates) * self.fraction_train), self.min_train_nodes)
            needed = max(self.min_available_nodes, size)
            if len(candidates) >= needed:
                break
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"round {round_index + 1}: only {len(candidates)} of the run's "
                    f"{directory.num_clients} nodes are connected, {needed} needed "
                    f"(min_available_nodes={self.min_available_nodes}, "
                    f"min_train_nodes={self.min_train_nodes}) within {self.wait_seconds:.0f}s"
                )
            logger.info(
                "waiting for nodes to connect: %d connected (minimum required: %d)",
                len(candidates),
                needed,
            )
            time.sleep(1.0)
        # The core samples (and injects train.faults' dropout) as on every runtime.
        return core.plan(round_index, candidates=np.asarray(candidates), count=size)


@dataclass(frozen=True)
class ScreenedDirectory(NodeDirectory):
    """A run's :class:`~.priors.NodeDirectory` less the clients its setup phase dropped:
    they are not in ``node_of``, so no round samples them and no evaluation asks them;
    the run still has K clients (``num_clients``, the class counts and the checkpoint's
    fingerprint are the directory's before the drop)."""

    dropped: Mapping[int, str] = field(default_factory=dict)
    """client id -> why the setup phase dropped it."""

    @property
    def num_clients(self) -> int:
        return len(self.node_of) + len(self.dropped)


def without_dropped(directory: NodeDirectory, dropped: Mapping[int, str]) -> NodeDirectory:
    """``directory`` less the clients of ``dropped`` (itself when there are none)."""
    if not dropped:
        return directory
    node_of = {client: node for client, node in directory.node_of.items() if client not in dropped}
    return ScreenedDirectory(node_of=node_of, class_counts=directory.class_counts, dropped=dict(dropped))


def evaluation_count(connected: int, fraction_evaluate: float, min_evaluate_nodes: int) -> int:
    """How many of ``connected`` clients evaluate in a round, Flower's way
    (``FedAvg.configure_evaluate``): ``max(int(fraction_evaluate * connected),
    min_evaluate_nodes)``, none at ``fraction_evaluate=0``, and at most the connected
    ones (fedplug evaluates those there are instead of waiting for more)."""
    if fraction_evaluate == 0.0:
        return 0
    return min(connected, max(int(connected * fraction_evaluate), min_evaluate_nodes))
