"""The run a :class:`~.strategy.FedplugStrategy` drives, between Flower's calls.

:class:`ServerRun` sets the run up on the nodes once (:mod:`.node_setup`) and starts the
round core, starts the aggregator from the initial model or resumes from the checkpoint
(:mod:`.server_checkpoint`), and writes the record of every finished round when
:class:`.round_records.RoundRecords` says the round is complete: logged, checkpointed,
told to the observers. :class:`RunSettings` holds the strategy's arguments it reads.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from torch import Tensor

from fedplug.components import PhaseCost, RoundPlan
from fedplug.cost_model import LinkAndDevice
from fedplug.errors import TrainingError
from fedplug.registry import Registry
from fedplug.run.components import Components
from fedplug.run.federated_round import RoundCore, screening_config
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run.state import resume_run

from .capabilities import (
    GUIDE,
    missing_pieces,
    needs_client_pieces,
    probe_client_app,
    provided_line,
    what_to_add,
)
from .node_sampling import NodeRule, ScreenedDirectory, without_dropped
from .node_setup import NodeMessages, find_clients, prepare_components
from .priors import NodeDirectory
from .records import record_to_vector
from .requirements import Component
from .round_records import FinishedRound, RoundRecords, log_round, record_round
from .server_checkpoint import run_fingerprint, save_run
from .server_components import with_aggregator_for_nodes
from .server_evaluation import CentralEvaluation, central_metrics, round_evaluation
from .setup_phase import SetupScreen

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

RoundObserver = Callable[[RoundRecord], None]


@dataclass(frozen=True)
class RunSettings:
    """The strategy's arguments a run reads, as the constructor resolved them."""

    train_config: Any
    registry: Registry
    nodes: NodeRule
    messages: NodeMessages
    query_nodes: bool
    requirement: str | None
    """What the ClientApp must add to the quickstart shape (``None``: nothing)."""
    layout: list[tuple[str, tuple[int, ...]]]
    train_flops: int
    link: LinkAndDevice
    checkpoint_path: Path | None
    target_accuracy: float | None
    observers: list[RoundObserver]
    evaluate_fn: CentralEvaluation | None


class ServerRun:
    """One run: its setup on the nodes, its start, and its record of every round.

    Args:
        settings: the strategy's arguments.
        components: the built components (the aggregator is rebuilt at setup for the
            connected nodes when K is not fixed).
        vector_record: a flat model vector as the ArrayRecord sent to the nodes.
    """

    def __init__(
        self,
        settings: RunSettings,
        components: Components,
        vector_record: Callable[[Tensor], ArrayRecord],
    ) -> None:
        self.settings = settings
        self.components = components
        self._vector_record = vector_record
        # Set by setup(), once the nodes are known.
        self.directory: NodeDirectory | None = None
        self.core: RoundCore | None = None
        self.setup_cost = PhaseCost(0, 0, 0)
        self.setup_seconds = 0.0
        self.fingerprint: str | None = None
        self.loss_records: tuple[ArrayRecord, ConfigRecord] | None = None
        self.began = False
        self.offset = 0
        """Rounds a resumed checkpoint had finished: Flower's round r is fedplug's r + offset."""
        self.total_bytes = 0
        self.history: list[RoundRecord] = []
        """fedplug's record of every round finished so far (1..R, resumed ones included)."""
        self.run_result: RunResult | None = None
        self.final_vector: Tensor | None = None
        self.records = RoundRecords(self.write_record)
        """When the aggregated round is recorded (:mod:`.round_records`)."""

    def setup(self, grid: Grid, timeout: float | None = None) -> NodeDirectory:
        """Find the nodes, gather their class counts when a component needs them,
        prepare the loss transform (and run its setup phase), prepare the grouper, and
        start the round core (see :meth:`.strategy.FedplugStrategy.setup`)."""
        settings, config = self.settings, self.settings.train_config
        started = time.perf_counter()
        node_ids = settings.nodes.wait_for_population(grid)
        self.check_client_app(grid, node_ids, timeout)
        num_clients = settings.nodes.num_clients
        directory = find_clients(
            grid,
            node_ids,
            num_clients,
            query_nodes=settings.query_nodes,
            messages=settings.messages,
            requirement=settings.requirement,
            timeout=timeout,
            wait_seconds=settings.nodes.wait_seconds,
        )
        if num_clients is None:
            self.components = with_aggregator_for_nodes(
                self.components, config, settings.registry, directory.num_clients
            )
        counts = directory.counts_or_zeros(settings.messages.num_classes)
        setup_started = time.perf_counter()
        self.setup_cost, self.loss_records, dropped = prepare_components(
            grid,
            directory,
            counts,
            self.components,
            name=config.loss_transform.name,
            message_config=settings.messages.for_run(directory.num_clients),
            requirement=settings.requirement,
            timeout=timeout,
            screen=SetupScreen(
                screening_config(config), directory.client_sizes, config.failures.max_failed_fraction
            ),
        )
        self.setup_seconds = time.perf_counter() - setup_started
        self.core = RoundCore.for_clients(
            config,
            directory,
            self.components,
            model_bytes=sum(math.prod(shape) for _, shape in settings.layout) * 4,
            train_flops=settings.train_flops,
            link=settings.link,
            runtime="flower",
            checkpoint=settings.checkpoint_path,
        )
        # The run keeps its K clients (ids, counts, fingerprint); the dropped ones are
        # never sampled or asked to evaluate again (on a rerun the phase drops them again).
        self.directory = without_dropped(directory, dropped)
        self.fingerprint = run_fingerprint(
            config,
            settings.messages.message_config,
            settings.messages.num_classes,
            directory,
            settings.layout,
            settings.nodes,
        )
        logger.info(
            "fedplug setup: %d clients on %d nodes%s in %.1fs",
            directory.num_clients,
            len(node_ids),
            " (class counts gathered)" if directory.class_counts is not None else "",
            time.perf_counter() - started,
        )
        return directory

    @property
    def dropped(self) -> dict[int, str]:
        """The clients the setup phase dropped (client id -> reason): left out of the run."""
        directory = self.directory
        return dict(directory.dropped) if isinstance(directory, ScreenedDirectory) else {}

    def plan(self, round_index: int) -> RoundPlan:
        """The round core's plan of round ``round_index`` (0-based) of a run of K fixed
        clients, less the clients the setup phase dropped."""
        core, directory = self.require_core(), self.require_setup()
        if not self.dropped:
            return core.plan(round_index)
        return core.plan(round_index, candidates=np.asarray(sorted(directory.node_of), dtype=np.int64))

    def check_client_app(self, grid: Grid, node_ids: list[int], timeout: float | None) -> None:
        """Before any query, setup phase or train message: when the config needs fedplug
        pieces in the ClientApp, ask one node what its app provides
        (:mod:`.capabilities`; every SuperNode of a run executes the same ClientApp) and
        stop with one line naming what is missing; nothing is sent otherwise.

        Raises:
            TrainingError: the ClientApp lacks a piece the config needs.
        """
        settings, config = self.settings, self.settings.train_config
        if settings.requirement is None:
            return
        components = [
            Component(slot, getattr(config, slot).name, component)
            for slot, component in self.components.by_slot().items()
        ]
        phases = [phase.name for _, phase in self.components.setup_phases()]
        if not needs_client_pieces(components, phases):
            return
        capabilities = probe_client_app(
            grid, node_ids, what_to_add(components, phases), timeout
        )
        missing = missing_pieces(
            capabilities, components, phases, class_counts=settings.query_nodes
        )
        if missing:
            raise TrainingError(
                f"the ClientApp lacks what the server's config needs: {'; '.join(missing)} "
                f"({GUIDE})"
            )
        logger.info(provided_line(capabilities))

    def begin(self, arrays: ArrayRecord) -> ArrayRecord:
        """Start the aggregator from ``arrays``, or resume from the checkpoint when it
        holds a run of this config; return the global model to train round 1 (or the
        first round after the checkpoint's) from.

        Raises:
            TrainingError: the checkpoint belongs to another config (one line saying so).
        """
        settings = self.settings
        self.began = True
        self.total_bytes = self.setup_cost.bytes_up + self.setup_cost.bytes_down
        initial = record_to_vector(arrays, settings.layout)
        restored = None
        if settings.checkpoint_path is not None:
            assert self.fingerprint is not None  # set by setup()
            restored = resume_run(
                settings.checkpoint_path,
                self.fingerprint,
                initial_vector=initial,
                num_clients=self.require_setup().num_clients,
                rounds=settings.train_config.rounds,
                components=self.checkpointed_components(),
            )
        if restored is None:
            self.aggregator.initialize(initial)
            return arrays
        vector = restored.global_vector
        self.history = restored.history
        self.setup_cost, self.setup_seconds = restored.setup_cost, restored.setup_seconds
        self.offset = len(self.history)
        if self.history:
            self.total_bytes = self.history[-1].cumulative_bytes
        self.final_vector = vector
        self.run_result = self.result()
        logger.info(
            "fedplug: resuming from %s after round %d", settings.checkpoint_path, self.offset
        )
        return self._vector_record(vector)

    def require_core(self) -> RoundCore:
        if self.core is None:
            raise RuntimeError(
                "call FedplugStrategy.setup(grid) (the first configure_train does) first"
            )
        return self.core

    def require_setup(self) -> NodeDirectory:
        self.require_core()
        assert self.directory is not None  # set with the core
        return self.directory

    def write_record(self, finished: FinishedRound) -> None:
        """Write a finished round's record (:class:`.round_records.RoundRecords` says
        when), log it, save the checkpoint, tell the observers."""
        settings = self.settings
        central = central_metrics(
            finished.central,
            settings.evaluate_fn,
            finished.round_number,
            lambda: self._vector_record(finished.attempt.vector),
        )
        evaluation = round_evaluation(central, finished.federated)
        record = record_round(self.require_core(), finished, evaluation, self.total_bytes)
        self.total_bytes = record.cumulative_bytes
        self.history.append(record)
        self.final_vector = finished.attempt.vector
        self.run_result = self.result()
        log_round(record, finished)
        if settings.checkpoint_path is not None:
            assert self.fingerprint is not None  # set by setup()
            save_run(
                settings.checkpoint_path,
                self.fingerprint,
                finished.attempt.vector,
                self.history,
                self.setup_cost,
                self.setup_seconds,
                self.checkpointed_components(),
            )
        for observer in settings.observers:
            observer(record)

    @property
    def aggregator(self) -> Any:
        """The run's aggregator (rebuilt at setup when K is not fixed)."""
        return self.components.aggregator

    def checkpointed_components(self) -> dict[str, Any]:
        return self.components.checkpointed()

    def result(self) -> RunResult:
        """fedplug's :class:`RunResult` of the rounds recorded so far."""
        return self.require_core().run_result(
            list(self.history),
            self.components,
            target_accuracy=self.settings.target_accuracy,
            engine="flower",
            setup_cost=self.setup_cost,
            setup_seconds=self.setup_seconds,
        )
