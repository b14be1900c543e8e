"""Server side: a Flower strategy (Message API) that runs any fedplug train config.

:class:`FedplugStrategy` is a Flower strategy like ``FedAvg``: Flower's own
``Strategy.start`` drives it (its :meth:`~FedplugStrategy.start` is that one, plus
fedplug's record and checkpoint), and strategies that wrap another (the DP fixed-clipping
wrappers) can wrap it. It moves models and messages; the round itself is
:class:`fedplug.run.federated_round.RoundCore`'s, the same as the simulator's:

1. **setup** (once, inside the first ``configure_train``): the nodes are counted (K
   fixed by ``num_clients``, or the nodes connected, Flower's way); only when a component
   needs them (``ClientNeeds.class_counts``), a ``query`` message asks every node for its
   class counts (:mod:`.priors`), which also tells which node holds which client;
   otherwise clients follow the node ids' order. The loss transform is prepared from the
   counts (FedShift's prior), then its setup phase, if it declares one, runs over
   messages (FedDisk's density models; the result stays on the nodes). The grouper is
   prepared from the counts too (FedGSP's clusters). A config that needs more from the
   clients than ``arrays`` and ``num-examples`` is named in one line
   (:mod:`.requirements`).
2. **each round**: the round is planned (sampling, with the simulator's random
   streams, and the grouper's chains); one exchange per chain position (:mod:`.chains`),
   a chain's model handed to its next member through the server. The aggregator's
   server payload (SCAFFOLD's c) goes down with every model, its client extras
   (SCAFFOLD's delta_c, FedNova's a_k) come back in the reply, ``fedplug.num-steps``
   carries the local step count.
3. **screen, aggregate or retry**: every chain becomes a ``ClientUpdate`` or a
   ``ClientFailure``, and :meth:`RoundCore.run` screens them, aggregates, and retries
   the round under ``train.failures``; clients that trained in a failed attempt start
   again from the state they had (see :func:`.trainer.load_client_state`). The clients'
   own metrics are averaged weighted by ``num-examples``, as Flower's strategies do,
   over the clients the core accepted; every reply field is decoded defensively first
   (:mod:`.decoding`), so a malformed reply drops its client, never the server.
4. **evaluate and record**: ``evaluate_fn`` (central, on the server's test set; also at
   round 0, as Flower calls it) and, optionally, an ``evaluate`` message to every node
   for its local test split; the core writes the round's record, and with
   ``checkpoint_path`` the run is saved after every round and resumed from there.

A component that needs every client's raw data in one place (``ClientNeeds.pooled_data``,
FedDiskAb) is refused with the component's own reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor, nn

from fedplug.components import MODEL_SHAPE, PhaseCost, RoundPlan
from fedplug.config import validate_section
from fedplug.cost_model import LinkAndDevice
from fedplug.errors import ConfigError, TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.run.checkpoint import save_checkpoint
from fedplug.run.federated_round import (
    Attempt,
    Evaluation,
    Outcome,
    RoundCore,
    client_needs,
)
from fedplug.run.model import build_model, resolve_device
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run.state import RunState, resume_run
from fedplug.run.vectors import tensors_num_bytes, vector_to_model

from .chains import ReplyDeadlineGrid, RoundInProgress, reply_wait
from .messages import (
    MetricsAggregation,
    client_accuracy,
    evaluate_message,
    train_message,
    weighted_metrics,
)
from .priors import ClassCounts, NodeDirectory, gather_class_counts, node_order_directory
from .records import (
    ACCURACY,
    CHAIN_POSITION,
    CLIENT_ID,
    CLIENT_TIMEOUT,
    LOSS,
    NUM_CLASSES,
    NUM_CLIENTS,
    NUM_EXAMPLES,
    REPLY_METRICS,
    ROUND,
    encode_loss_state,
    model_record,
    number,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)
from .requirements import Component, client_requirements
from .setup_phase import run_setup_phase

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

RoundObserver = Callable[[RoundRecord], None]
CentralEvaluation = Callable[[int, ArrayRecord], "MetricRecord | None"]


@dataclass(frozen=True)
class _ModelShape:
    """What :func:`fedplug.run.model.build_model` reads from a federation."""

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass
class _FinishedRound:
    """A round trained and aggregated, waiting for its evaluation before it is recorded."""

    round_number: int
    plan: RoundPlan
    attempt: Attempt
    payload_bytes: int
    started: float
    central: MetricRecord | None = None
    federated: MetricRecord | None = None


class FedplugStrategy(Strategy):
    """A Flower strategy driven by a fedplug ``train`` config.

    Two ways to choose the round's nodes:

    - ``num_clients=K`` (the simulator's way): the run has K clients, one per node; each
      round samples ``train.client_fraction`` of them with the simulator's seeded
      streams, so a Flower run with fedplug's client loop equals ``fedplug run``.
    - ``num_clients=None`` (Flower's way, as ``FedAvg``): the clients are the nodes
      connected when the run starts (once ``max(min_available_nodes, min_train_nodes)``
      are); each round samples ``max(int(fraction_train * connected), min_train_nodes)``
      of those still connected, waiting for ``max(min_available_nodes, that)`` as Flower
      does, seeded (node ids sorted, the round core's sampling stream).

    Args:
        train_config: the ``train`` section, validated or as a dict.
        num_clients: K, the number of nodes (one fedplug client each); ``None``: sample
            among the connected nodes, Flower's way (default).
        num_classes: C; needed when ``model`` is not given or a component needs the
            clients' class counts (default: unknown).
        model: the global model (default: ``train.model`` built for ``input_shape`` and
            ``num_classes``, initialised from ``train.seed`` like the simulator's). The
            strategy loads every global model into it; after a run it holds the final one.
        input_shape: the shape of one input; needed when ``model`` is not given, and
            for the FLOP count of the cost model (0 FLOPs without it).
        fraction_train: the fraction of connected nodes that train each round when
            ``num_clients`` is ``None`` (default: ``train.client_fraction``); Flower's
            meaning (``int(fraction * connected)``, at least ``min_train_nodes``).
        min_train_nodes: the fewest nodes that train in a round (default 2, Flower's).
        min_available_nodes: the fewest connected nodes a round waits for (default 2,
            Flower's).
        train_metrics_aggr_fn: Flower's ``(list[RecordDict], weighting key) ->
            MetricRecord`` for the clients' train metrics (default: the mean weighted by
            ``num-examples``, as Flower's ``FedAvg``).
        evaluate_metrics_aggr_fn: the same for the clients' evaluate metrics.
        query_nodes: ask every node for its partition id and class counts before round 1
            even when no component needs the counts, so that client k is the node with
            ``partition-id=k`` (the ready ClientApp answers the query; default: only when
            a component needs the counts, as a stock ClientApp has no query handler).
        checkpoint_path: save the run after every round there and, when the file holds
            a run of this very config, resume after its last round (default: none).
        registry: the component registry (default: the installed plugins).
        message_config: entries added to the ConfigRecord of every message this
            strategy sends (the ready apps send the experiment here).
        federated_evaluation: send an ``evaluate`` message to every node after each
            round for its local test metrics (default True).
        node_wait_seconds: how long to wait for the nodes a run or a round needs
            (default 300).
        link: the cost model's link and device rates (default: the FedGSP paper's).
        target_accuracy: for ``rounds_to_target`` in :attr:`run_result`.
        observers: called with every round's :class:`RoundRecord`.
        evaluate_fn: ``(round, arrays) -> MetricRecord`` for the round records' central
            ``accuracy`` and ``loss`` when this strategy is driven by another one's
            ``start`` (a DP wrapper), which keeps its own ``evaluate_fn`` to itself
            (default: the one :meth:`start` receives).

    Raises:
        ConfigError: a component needs every client's raw data in one place
            (``ClientNeeds.pooled_data``), which a Flower deployment must not do; or a
            size is out of range.
    """

    def __init__(
        self,
        train_config: Mapping[str, Any] | Any,
        *,
        num_clients: int | None = None,
        num_classes: int | None = None,
        model: nn.Module | None = None,
        input_shape: Sequence[int] | None = None,
        fraction_train: float | None = None,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
        query_nodes: bool = False,
        checkpoint_path: str | Path | None = None,
        registry: Registry | None = None,
        message_config: Mapping[str, Any] | None = None,
        federated_evaluation: bool = True,
        node_wait_seconds: float = 300.0,
        link: LinkAndDevice | None = None,
        target_accuracy: float | None = None,
        observers: Iterable[RoundObserver] = (),
        evaluate_fn: CentralEvaluation | None = None,
    ) -> None:
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        if isinstance(train_config, Mapping):
            train_config = validate_section("train", dict(train_config), registry)
        if num_clients is not None and num_clients < 1:
            raise ConfigError(f"num_clients ({num_clients}) must be positive")
        if num_classes is not None and num_classes < 1:
            raise ConfigError(f"num_classes ({num_classes}) must be positive")
        fraction = train_config.client_fraction if fraction_train is None else fraction_train
        if not 0 < fraction <= 1:
            raise ConfigError(f"fraction_train ({fraction}) must be in (0, 1]")
        if min_train_nodes < 1 or min_available_nodes < 1:
            raise ConfigError(
                f"min_train_nodes ({min_train_nodes}) and min_available_nodes "
                f"({min_available_nodes}) must be positive"
            )
        self.config = train_config
        self.registry = registry
        self.num_clients = num_clients
        self.num_classes = num_classes
        self.fraction_train = fraction
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or weighted_metrics
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or weighted_metrics
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.loss_transform = registry.build("loss_transforms", train_config.loss_transform)
        # Rebuilt for the number of connected nodes when that is only known at setup.
        self.aggregator = registry.build("aggregators", train_config.aggregator, num_clients or 1)
        self.grouper = registry.build("groupers", train_config.grouper)
        self.sampler = registry.build("samplers", train_config.sampler)
        self.needs = client_needs(self.sampler, self.loss_transform, self.aggregator, self.grouper)
        name = train_config.loss_transform.name
        if self.needs.pooled_data is not None:
            raise ConfigError(
                f"train.loss_transform {name!r} cannot run on Flower: {self.needs.pooled_data}"
            )
        if self.needs.class_counts and num_classes is None:
            raise ConfigError(
                "FedplugStrategy needs num_classes= here: "
                f"{self._requirement_line() or 'a component needs the class counts'}"
            )
        self.query_nodes = query_nodes or self.needs.class_counts
        self.client_requirements = self._requirement_line()
        """What the ClientApp must add to the quickstart shape (``None``: nothing)."""
        self.device = resolve_device(train_config.device)
        if model is None:
            if input_shape is None or num_classes is None:
                raise ConfigError(
                    "FedplugStrategy needs model=, or input_shape= and num_classes= to build "
                    "train.model"
                )
            shape: Any = _ModelShape(tuple(input_shape), num_classes)
            model = build_model(train_config, registry, shape, self.device)
        self.model = model
        self.layout = vector_layout(model)
        self.train_flops = (
            training_flops_per_sample(model, tuple(input_shape)) if input_shape is not None else 0
        )
        self.message_config = dict(message_config or {})
        self.federated_evaluation = federated_evaluation
        self.node_wait_seconds = node_wait_seconds
        self.link = link or LinkAndDevice()
        self.target_accuracy = target_accuracy
        self.observers = list(observers)
        self.evaluate_fn = evaluate_fn
        # Set by setup(), once the nodes are known.
        self.directory: NodeDirectory | None = None
        self.core: RoundCore | None = None
        self.setup_cost = PhaseCost(0, 0, 0)
        self.setup_seconds = 0.0
        self.fingerprint: str | None = None
        self._loss_records: tuple[ArrayRecord, ConfigRecord] | None = None
        self._began = False
        self._offset = 0
        """Rounds a resumed checkpoint had finished: Flower's round r is fedplug's r + offset."""
        # The round in progress (configure_train .. aggregate_evaluate / evaluate_fn).
        self._plans: dict[int, RoundPlan] = {}
        self._round: RoundInProgress | None = None
        self._round_started = 0.0
        self._grid: Grid | None = None
        self._exchange_timeout = 3600.0
        """Flower's bound of one exchange (``start``'s ``timeout``); the replies' own
        bound is :func:`.chains.reply_wait` of ``client_timeout_seconds``."""
        self._exchange_config: dict[str, Any] = {}
        self._payload_record: ArrayRecord | None = None
        self._payload_bytes = 0
        self._waiting: dict[int, Any] = {}
        self._node_of_reply: dict[int, int] = {}
        self._attempt: Attempt | None = None
        self._finished: _FinishedRound | None = None
        self._central_expected = False
        self._evaluating: dict[int, int] = {}
        self._total_bytes = 0
        self.history: list[RoundRecord] = []
        """fedplug's record of every round finished so far (1..R, resumed ones included)."""
        self.run_result: RunResult | None = None
        self.final_vector: Tensor | None = None

    def _components(self) -> list[Component]:
        config = self.config
        return [
            Component("sampler", config.sampler.name, self.sampler),
            Component("loss_transform", config.loss_transform.name, self.loss_transform),
            Component("aggregator", config.aggregator.name, self.aggregator),
            Component("grouper", config.grouper.name, self.grouper),
        ]

    def _requirement_line(self) -> str | None:
        phase = self.loss_transform.setup_phase()
        return client_requirements(self._components(), phase.name if phase is not None else None)

    # ------------------------------------------------------------------------ setup

    def summary(self) -> None:
        """Log what this strategy runs (Flower's ``Strategy.start`` calls this)."""
        config = self.config
        log = logger.info
        log("\t├──> fedplug train config:")
        log(
            "\t│\t├── sampler=%s loss_transform=%s aggregator=%s grouper=%s",
            config.sampler.name,
            config.loss_transform.name,
            config.aggregator.name,
            config.grouper.name,
        )
        if self.num_clients is not None:
            log(
                "\t│\t└── clients: %d fixed, fraction %.2f per round (seed %d)",
                self.num_clients,
                config.client_fraction,
                config.seed,
            )
        else:
            log(
                "\t│\t└── clients: the connected nodes, fraction_train %.2f, "
                "min_train_nodes %d, "
                "min_available_nodes %d (seed %d)",
                self.fraction_train,
                self.min_train_nodes,
                self.min_available_nodes,
                config.seed,
            )
        log(
            "\t└──> from each ClientApp: %s",
            self.client_requirements or "arrays and metrics with num-examples (nothing more)",
        )

    def setup(self, grid: Grid, timeout: float | None = None) -> NodeDirectory:
        """Find the nodes, gather their class counts when a component needs them (see
        :mod:`.priors`), prepare the loss transform, run its setup phase over messages
        when it declares one, prepare the grouper, and start the round core.

        Raises:
            TrainingError: the nodes did not connect or did not all report, or a node
                failed in the setup phase; the message says what to fix.
        """
        started = time.perf_counter()
        if self.client_requirements is not None:
            logger.info("fedplug: %s", self.client_requirements)
        node_ids = self._wait_for_population(grid)
        num_clients = self.num_clients if self.num_clients is not None else len(node_ids)
        if self.query_nodes:
            directory = gather_class_counts(
                grid,
                num_clients,
                self.num_classes or 0,
                config=self.message_config,
                timeout=timeout,
                node_ids=node_ids,
                requirement=self.client_requirements,
            )
        else:
            directory = node_order_directory(node_ids, num_clients)
        if self.num_clients is None:
            self.aggregator = self.registry.build(
                "aggregators", self.config.aggregator, directory.num_clients
            )
        counts = directory.counts_or_zeros(self.num_classes)
        setup_started = time.perf_counter()
        self.setup_cost = self._prepare_loss_transform(grid, directory, counts, timeout)
        self.setup_seconds = time.perf_counter() - setup_started
        self.grouper.prepare(counts)
        self.core = RoundCore(
            self.config,
            aggregator=self.aggregator,
            grouper=self.grouper,
            num_clients=directory.num_clients,
            class_counts=directory.class_counts,
            client_sizes=directory.sizes,
            model_bytes=self._model_bytes(),
            train_flops=self.train_flops,
            link=self.link,
            runtime="flower",
            checkpoint=self.checkpoint_path,
        )
        self.directory = directory
        self.fingerprint = self._fingerprint(directory)
        logger.info(
            "fedplug setup: %d clients on %d nodes%s in %.1fs",
            directory.num_clients,
            len(node_ids),
            " (class counts gathered)" if directory.class_counts is not None else "",
            time.perf_counter() - started,
        )
        return directory

    def _wait_for_population(self, grid: Grid) -> list[int]:
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
        deadline = time.monotonic() + self.node_wait_seconds
        while len(node_ids := sorted(grid.get_node_ids())) < needed:
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"only {len(node_ids)} of the {needed} nodes needed ({what}) connected "
                    f"within {self.node_wait_seconds:.0f}s; start more nodes or lower {what}"
                )
            time.sleep(0.1)
        return node_ids

    def _prepare_loss_transform(
        self, grid: Grid, directory: NodeDirectory, counts: np.ndarray, timeout: float | None
    ) -> PhaseCost:
        """Prepare the loss transform from the class counts, then run its setup phase on
        the nodes; keep the prepared state to send with every train message."""
        message_config = {NUM_CLIENTS: directory.num_clients, **self.message_config}
        if self.num_classes is not None:
            message_config[NUM_CLASSES] = self.num_classes
        transform = self.loss_transform
        cost = transform.prepare(ClassCounts(counts)) or PhaseCost(0, 0, 0)
        phase = transform.setup_phase()  # after prepare, which may have loaded its result
        if phase is not None:
            try:
                extra = run_setup_phase(
                    grid, directory.node_of, phase, message_config=message_config, timeout=timeout
                )
            except TrainingError as error:
                if "function registered" in str(error) and self.client_requirements:
                    raise TrainingError(f"{error}; {self.client_requirements}") from None
                raise
            cost = PhaseCost(
                cost.rounds + extra.rounds,
                cost.bytes_up + extra.bytes_up,
                cost.bytes_down + extra.bytes_down,
            )
        state = transform.state_dict()
        name = self.config.loss_transform.name
        self._loss_records = encode_loss_state(state, name) if state else None
        return cost

    def _fingerprint(self, directory: NodeDirectory) -> str:
        """Identifies a run: the train config, what the nodes are told, the clients and
        their counts, the model's layout and the sampling rule."""
        counts = directory.class_counts
        identity = {
            "train": self.config.model_dump(mode="json"),
            "message_config": {key: str(value) for key, value in self.message_config.items()},
            "num_classes": self.num_classes,
            "num_clients": directory.num_clients,
            "class_counts": counts.tolist() if counts is not None else None,
            "layout": [[name, list(shape)] for name, shape in self.layout],
            "sampling": None
            if self.num_clients is not None
            else [self.fraction_train, self.min_train_nodes, self.min_available_nodes],
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def _begin(self, arrays: ArrayRecord) -> ArrayRecord:
        """Start the aggregator from ``arrays``, or resume from the checkpoint when it
        holds a run of this config; return the global model to train round 1 (or the
        first round after the checkpoint's) from.

        Raises:
            TrainingError: the checkpoint belongs to another config (one line saying so).
        """
        self._began = True
        self._total_bytes = self.setup_cost.bytes_up + self.setup_cost.bytes_down
        initial = record_to_vector(arrays, self.layout)
        restored = None
        if self.checkpoint_path is not None:
            assert self.fingerprint is not None  # set by setup()
            restored = resume_run(
                self.checkpoint_path,
                self.fingerprint,
                initial_vector=initial,
                num_clients=self._require_setup().num_clients,
                rounds=self.config.rounds,
                components=self._checkpointed_components(),
            )
        if restored is None:
            self.aggregator.initialize(initial)
            return arrays
        vector = restored.global_vector
        self.history = restored.history
        self.setup_cost, self.setup_seconds = restored.setup_cost, restored.setup_seconds
        self._offset = len(self.history)
        if self.history:
            self._total_bytes = self.history[-1].cumulative_bytes
        self.final_vector = vector
        self.run_result = self._run_result()
        logger.info("fedplug: resuming from %s after round %d", self.checkpoint_path, self._offset)
        return self._vector_record(vector)

    def _ensure_started(
        self, grid: Grid, arrays: ArrayRecord, timeout: float | None
    ) -> ArrayRecord:
        if self.core is None:
            self.setup(grid, timeout)
        if not self._began:
            arrays = self._begin(arrays)
        return arrays

    def _require_core(self) -> RoundCore:
        if self.core is None:
            raise RuntimeError(
                "call FedplugStrategy.setup(grid) (the first configure_train does) first"
            )
        return self.core

    def _require_setup(self) -> NodeDirectory:
        self._require_core()
        assert self.directory is not None  # set with the core
        return self.directory

    # ------------------------------------------------------------------------ train

    def plan(self, round_number: int) -> RoundPlan:
        """The plan of fedplug round ``round_number`` (1-based), computed once per round
        (a retried round trains the same plan)."""
        if round_number not in self._plans:
            if self.num_clients is not None:
                plan = self._require_core().plan(round_number - 1)
            else:
                plan = self._plan_among_connected(round_number - 1)
            self._plans = {round_number: plan}
        return self._plans[round_number]

    def _plan_among_connected(self, round_index: int) -> RoundPlan:
        """Flower's sampling (``FedAvg.configure_train``), seeded: of the clients whose
        node is connected (sorted), ``max(int(fraction_train * n), min_train_nodes)``,
        once ``max(min_available_nodes, that)`` are connected; then the grouper's chains.

        Raises:
            TrainingError: too few nodes connected within ``node_wait_seconds``.
        """
        directory = self._require_setup()
        grid = self._grid
        assert grid is not None  # set by configure_train
        deadline = time.monotonic() + self.node_wait_seconds
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
                    f"min_train_nodes={self.min_train_nodes}) within {self.node_wait_seconds:.0f}s"
                )
            logger.info(
                "waiting for nodes to connect: %d connected (minimum required: %d)",
                len(candidates),
                needed,
            )
            time.sleep(1.0)
        # The core samples (and injects train.faults' dropout) as on every runtime.
        return self._require_core().plan(round_index, candidates=np.asarray(candidates), count=size)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start a round: plan it and return the messages of every chain's first member.
        Before the first round, run :meth:`setup` and start the aggregator from
        ``arrays`` (or resume from the checkpoint), so Flower's own ``Strategy.start`` and
        wrapping strategies can drive this one."""
        self._grid = grid
        arrays = self._ensure_started(grid, arrays, self._exchange_timeout)
        round_number = server_round + self._offset
        if self._finished is not None and self._finished.round_number != round_number:
            self._record_finished()
        if self._round is None or self._round.server_round != round_number:
            self._round_started = time.perf_counter()  # a retry is part of the same round
        self._round = RoundInProgress(
            round_number,
            self.plan(round_number),
            record_to_vector(arrays, self.layout),
            self.layout,
            self.config.failures.client_timeout_seconds,
            required_extras=self.needs.reply_extras,
            requirement=self.client_requirements,
            required_metrics=self.needs.reply_metrics,
            **self._reply_bounds(),
        )
        self._exchange_config = dict(config)
        payload = self.aggregator.server_payload()
        self._payload_record = tensors_to_record(payload) if payload else None
        self._payload_bytes = tensors_num_bytes(payload)
        self._waiting = {}
        return self._next_messages()

    def configure_hand_off(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Take the replies of one exchange and return the next members' messages, each
        carrying the model its chain's previous member returned ([] when every chain is
        done)."""
        self._absorb(replies)
        return self._next_messages()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take the replies, finish the round's chains (hand-offs through the grid that
        :meth:`configure_train` was given), and let the round core screen, aggregate and,
        under ``train.failures``, replay the round. The metrics are the clients' own,
        averaged by ``train_metrics_aggr_fn`` (weighted by ``num-examples``), plus
        ``accepted``, ``failures``, ``bytes-up`` and ``attempts``.

        Raises:
            TrainingError: too many clients failed in every attempt, the global model
                became non-finite, or a reply lacks what a component needs.
        """
        round_ = self._require_round()
        round_number = round_.server_round
        self._exchange(self.configure_hand_off(round_number, replies))

        def train_attempt(attempt: int) -> list[Outcome]:
            if attempt > 0:
                arrays = self._vector_record(round_.global_vector)
                grid = self._grid
                assert grid is not None  # set by configure_train
                config = ConfigRecord(self._exchange_config)
                self._exchange(
                    list(self.configure_train(round_number - self._offset, arrays, config, grid))
                )
            return self._require_round().outcomes()

        core = self._require_core()
        plan = self.plan(round_number)
        attempt = core.run(round_number - 1, round_.global_vector, plan, train_attempt)
        self._attempt = attempt
        self._finished = _FinishedRound(
            round_number, plan, attempt, self._payload_bytes, self._round_started
        )
        self.final_vector = attempt.vector
        metrics = self.train_metrics_aggr_fn(self._accepted_replies(attempt), NUM_EXAMPLES)
        tally = attempt.tally
        metrics["accepted"] = tally.accepted
        metrics["failures"] = tally.failures
        metrics["bytes-up"] = tally.bytes_up
        metrics["attempts"] = attempt.attempts
        return self._vector_record(attempt.vector), metrics

    def _reply_bounds(self) -> dict[str, Any]:
        """What one reply may hold (:class:`.chains.RoundInProgress`): each required
        extra's declared shape (``"model"``: the flat model's), and the caps of
        ``train.screening`` on ``num-examples`` and ``fedplug.num-steps``."""
        model_size = sum(math.prod(shape) for _, shape in self.layout)
        shapes = {
            name: (model_size,) if extra.shape == MODEL_SHAPE else tuple(extra.shape)
            for name, extra in self.needs.reply_extra_shapes.items()
        }
        screening = self.config.screening
        return {
            "extras_shapes": shapes,
            "max_num_examples": screening.max_num_examples,
            "max_num_steps": screening.max_num_steps,
        }

    def _accepted_replies(self, attempt: Attempt) -> list[Any]:
        """The contents of the replies whose chain the round core accepted: a client it
        dropped (a NaN model, say) must not enter the averaged metrics either."""
        round_ = self._require_round()
        dropped = {client for chain, _ in attempt.tally.dropped for client in chain}
        return [
            content
            for content, client in zip(round_.replies, round_.reply_clients, strict=True)
            if client not in dropped
        ]

    def _exchange(self, messages: list[Message]) -> None:
        """Send ``messages`` and every hand-off they lead to, until the round's chains are
        done; a member that sends nothing within the reply bound fails its chain."""
        grid = self._grid
        while messages:
            assert grid is not None  # set by configure_train
            bounded = ReplyDeadlineGrid.around(grid, self._reply_wait)
            replies = bounded.send_and_receive(messages, timeout=self._exchange_timeout)
            messages = self.configure_hand_off(self._require_round().server_round, replies)

    def _require_round(self) -> RoundInProgress:
        if self._round is None:
            raise RuntimeError("configure_train must start the round first")
        return self._round

    def _absorb(self, replies: Iterable[Message]) -> None:
        if self._waiting:
            self._require_round().absorb(self._waiting, list(replies), self._node_of_reply)
        self._waiting, self._node_of_reply = {}, {}

    def _next_messages(self) -> list[Message]:
        round_ = self._require_round()
        directory = self._require_setup()
        grid = self._grid
        connected = (
            set(grid.get_node_ids()) if grid is not None else set(directory.node_of.values())
        )
        records: dict[int, ArrayRecord] = {}
        messages = []
        for chain in round_.active():
            client = chain.next_client
            node = directory.node_of[client]
            if node not in connected:
                chain.fail(f"client {client}'s node {node} is no longer connected")
                continue
            record = records.get(id(chain.vector))
            if record is None:
                record = records[id(chain.vector)] = self._vector_record(chain.vector)
            config = {
                **self._common_config(round_.server_round, client),
                CHAIN_POSITION: chain.position,
                **self._client_timeout,
                **self._reply_metrics,
                **self._exchange_config,
                ROUND: round_.server_round,  # fedplug's round, also after a resume
            }
            messages.append(
                train_message(
                    node,
                    round_.server_round,
                    record,
                    config,
                    payload=self._payload_record,
                    loss_state=self._loss_records,
                )
            )
            self._waiting[client] = chain
            self._node_of_reply[node] = client
        return messages

    @property
    def _reply_wait(self) -> float | None:
        return reply_wait(self.config.failures.client_timeout_seconds)

    @property
    def _client_timeout(self) -> dict[str, Any]:
        """``train.failures.client_timeout_seconds`` for the train message, when set: a
        FedplugTrainer interrupts its training there (:mod:`.chains`)."""
        timeout = self.config.failures.client_timeout_seconds
        return {CLIENT_TIMEOUT: float(timeout)} if timeout is not None else {}

    @property
    def _reply_metrics(self) -> dict[str, Any]:
        """The metrics a train message asks for (FedplugTrainer and FedplugLoss report
        them when asked; a quickstart ClientApp reports ``train_loss`` on its own)."""
        return {REPLY_METRICS: list(self.needs.reply_metrics)} if self.needs.reply_metrics else {}

    def _common_config(self, round_number: int, client: int) -> dict[str, Any]:
        config: dict[str, Any] = {
            ROUND: round_number,
            CLIENT_ID: client,
            NUM_CLIENTS: self._require_setup().num_clients,
            **self.message_config,
        }
        if self.num_classes is not None:
            config[NUM_CLASSES] = self.num_classes
        return config

    def _vector_record(self, vector: Tensor) -> ArrayRecord:
        vector_to_model(vector.to(self.device), self.model)
        return model_record(self.model)

    def _model_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape in self.layout) * 4

    # --------------------------------------------------------------------- evaluate

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``evaluate`` message per client node (none when federated evaluation is off)."""
        if not self.federated_evaluation:
            return []
        directory = self._require_setup()
        round_number = server_round + self._offset
        connected = set(grid.get_node_ids())
        self._evaluating = {
            node: client for client, node in directory.node_of.items() if node in connected
        }
        return [
            evaluate_message(
                node,
                round_number,
                arrays,
                {**self._common_config(round_number, client), **config, ROUND: round_number},
            )
            for node, client in sorted(self._evaluating.items(), key=lambda item: item[1])
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' metrics averaged by ``evaluate_metrics_aggr_fn`` (weighted by
        ``num-examples``), plus the mean and (population) spread of their ``accuracy``
        (the simulator's ``client-accuracy-mean`` / ``-std``, see
        :func:`.messages.client_accuracy`). Records the round unless a central
        evaluation is still to come."""
        replies = list(replies)
        round_number = server_round + self._offset
        # Only the nodes asked: a reply from any other is not one of this run's clients.
        usable = [
            reply.content
            for reply in replies
            if not reply.has_error() and reply.metadata.src_node_id in self._evaluating
        ]
        metrics = self.evaluate_metrics_aggr_fn(usable, NUM_EXAMPLES) if usable else None
        spread = client_accuracy(replies, self._evaluating, round_number)
        if spread is not None:
            metrics = metrics if metrics is not None else MetricRecord()
            for key, value in spread.items():
                metrics[key] = value
        if metrics is not None and not len(metrics):
            metrics = None
        finished = self._finished
        if finished is not None and finished.round_number == round_number:
            finished.federated = spread
            if not self._central_expected:
                self._record_finished()
        return metrics

    # ----------------------------------------------------------------------- record

    def _record_finished(self) -> None:
        """Write the finished round's record, log it, save the checkpoint, tell the
        observers."""
        finished, self._finished = self._finished, None
        if finished is None:
            return
        central, federated = finished.central, finished.federated
        if central is None and self.evaluate_fn is not None:  # driven by another start()
            central = self.evaluate_fn(finished.round_number, self._vector_record(finished.attempt.vector))
        nan = float("nan")
        evaluation = Evaluation(
            number(central, ACCURACY, nan) if central is not None else nan,
            number(central, LOSS, nan) if central is not None else nan,
            number(federated, "client-accuracy-mean", nan) if federated is not None else nan,
            number(federated, "client-accuracy-std", nan) if federated is not None else nan,
        )
        record = self._require_core().record(
            finished.round_number - 1,
            finished.plan,
            finished.attempt,
            evaluation,
            payload_bytes=finished.payload_bytes,
            bytes_so_far=self._total_bytes,
            started=finished.started,
        )
        self._total_bytes = record.cumulative_bytes
        self.history.append(record)
        self.final_vector = finished.attempt.vector
        self.run_result = self._run_result()
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
        if self.checkpoint_path is not None:
            save_checkpoint(self.checkpoint_path, self._checkpoint_state(finished.attempt.vector))
        for observer in self.observers:
            observer(record)

    def _checkpointed_components(self) -> dict[str, Any]:
        return {"aggregator": self.aggregator, "grouper": self.grouper, "loss_transform": self.loss_transform}

    def _checkpoint_state(self, vector: Tensor) -> dict[str, Any]:
        """The run's :class:`RunState`; no client states: they live on the nodes."""
        assert self.fingerprint is not None  # set by setup()
        components = self._checkpointed_components()
        return RunState.capture(
            self.fingerprint, vector, self.history, self.setup_cost, self.setup_seconds, components, {}
        ).to_dict()

    def _run_result(self) -> RunResult:
        return self._require_core().run_result(
            list(self.history),
            self.loss_transform,
            target_accuracy=self.target_accuracy,
            engine="flower",
            setup_cost=self.setup_cost,
            setup_seconds=self.setup_seconds,
        )

    # ------------------------------------------------------------------------ start

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: CentralEvaluation | None = None,
    ) -> Result:
        """Run the whole experiment: Flower's ``Strategy.start`` (``evaluate_fn`` at
        round 0 too), with ``initial_arrays`` defaulting to :attr:`model`'s and
        ``num_rounds`` to ``train.rounds``, resuming after the checkpoint's last round
        when ``checkpoint_path`` holds this run (``num_rounds`` counts the resumed
        rounds; the Result's rounds are fedplug's).

        ``timeout`` bounds each message exchange; with
        ``train.failures.client_timeout_seconds`` (T) set, an exchange also ends once no
        reply has come for T plus a margin (:func:`.chains.reply_wait`), and the nodes
        still silent fail their chains, so a hung node cannot stall the run.
        ``evaluate_fn(round, arrays)`` evaluates centrally; its ``accuracy`` and ``loss``
        become the round's test metrics. After the run,
        :attr:`run_result` holds fedplug's :class:`RunResult` (the simulator's
        ``metrics.json`` content) and :attr:`final_vector` the final model.

        Raises:
            TrainingError: too many clients failed in every attempt of a round, the
                global model became non-finite, or the checkpoint is another run's.
        """
        num_rounds = self.config.rounds if num_rounds is None else num_rounds
        evaluate_fn = evaluate_fn if evaluate_fn is not None else self.evaluate_fn
        self._exchange_timeout = timeout
        arrays = initial_arrays if initial_arrays is not None else model_record(self.model)
        # Set up before Flower's loop only to know how many rounds a resumed run has left.
        arrays = self._ensure_started(grid, arrays, timeout)
        offset = self._offset
        remaining = num_rounds - offset
        if remaining <= 0:
            logger.info("fedplug: the checkpoint already holds all %d rounds", num_rounds)
            self.run_result = self._run_result()
            return Result(arrays=arrays)

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            assert evaluate_fn is not None
            metrics = evaluate_fn(server_round + offset, arrays)
            finished = self._finished
            if server_round > 0 and finished is not None:
                finished.central = metrics
                self._record_finished()
            return metrics

        self._central_expected = evaluate_fn is not None
        try:
            result = super().start(
                # Flower's loop sends each round's first exchange: bound its wait too.
                ReplyDeadlineGrid.around(grid, self._reply_wait),
                arrays,
                remaining,
                timeout,
                train_config,
                evaluate_config,
                central if evaluate_fn is not None else None,
            )
        finally:
            self._central_expected = False
        self._record_finished()
        if self.final_vector is not None:
            result.arrays = self._vector_record(self.final_vector)
        self.run_result = self._run_result()
        if not offset:
            return result
        return Result(
            arrays=result.arrays,
            train_metrics_clientapp=_shifted(result.train_metrics_clientapp, offset),
            evaluate_metrics_clientapp=_shifted(result.evaluate_metrics_clientapp, offset),
            evaluate_metrics_serverapp=_shifted(result.evaluate_metrics_serverapp, offset),
        )

    def derived_params(self) -> dict[str, Any]:
        """The round core's derived parameters (the simulator's), with ``engine: flower``."""
        return self._require_core().derived_params("flower")


def _shifted(by_round: dict[int, MetricRecord], offset: int) -> dict[int, MetricRecord]:
    return {server_round + offset: metrics for server_round, metrics in by_round.items()}


def central_evaluation(
    model: nn.Module, test_x: Tensor, test_y: Tensor, batch_size: int = 1000
) -> CentralEvaluation:
    """An ``evaluate_fn`` for :meth:`FedplugStrategy.start`: accuracy and mean
    cross-entropy on a held-out test set, computed as the simulator's evaluator does."""
    layout = vector_layout(model)

    @torch.no_grad()
    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        vector_to_model(record_to_vector(arrays, layout).to(test_x.device), model)
        model.eval()
        correct = torch.zeros(len(test_y), dtype=torch.bool, device=test_y.device)
        total_loss = 0.0
        for start in range(0, len(test_y), batch_size):
            logits = model(test_x[start : start + batch_size])
            target = test_y[start : start + batch_size]
            total_loss += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            correct[start : start + batch_size] = logits.argmax(dim=1) == target
        model.train()
        return MetricRecord(
            {ACCURACY: float(correct.float().mean()), LOSS: total_loss / max(len(test_y), 1)}
        )

    return evaluate
