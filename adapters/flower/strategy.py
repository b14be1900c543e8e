"""Server side: a Flower strategy (Message API) that runs any fedplug train config.

:class:`FedplugStrategy` is a Flower strategy like ``FedAvg``: Flower's own
``Strategy.start`` drives it, and strategies that wrap another (the DP fixed-clipping
wrappers) can wrap it. This module is Flower's ``Strategy`` surface only; the round itself
is :class:`fedplug.run.federated_round.RoundCore`'s, the same as the simulator's.
Design: docs/flower.md, 'Design notes: strategy'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import Tensor, nn

from fedplug.components import RoundPlan
from fedplug.config import validate_section
from fedplug.cost_model import LinkAndDevice
from fedplug.errors import ConfigError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.run.model import resolve_device
from fedplug.run.round_screen import Outcome
from fedplug.run.vectors import vector_to_model

from .chains import ReplyDeadlineGrid
from .flower_log import report_fedplug_errors_in_one_line
from .messages import MetricsAggregation, weighted_metrics
from .node_sampling import NodeRule
from .node_setup import NodeMessages
from .priors import NodeDirectory
from .records import NUM_EXAMPLES, model_record, record_to_vector, vector_layout
from .round_exchange import TrainExchange
from .round_records import (
    FedplugResult,
    FinishedRound,
    grouping_line,
    log_received,
    log_sampled,
    server_counters,
)
from .server_components import (
    RecordKeys,
    build_components,
    build_global_model,
    check_arrays_match,
    check_evaluation_sizes,
    check_sizes,
    check_stand_in_allowed,
    log_summary,
    model_from_arrays,
    requirement_line,
)
from .server_evaluation import (
    AccuracyKeys,
    CentralEvaluation,
    central_evaluation,
    evaluate_messages,
    federated_metrics,
    nodes_to_evaluate,
)
from .server_run import RoundObserver, RunSettings, ServerRun

__all__ = [
    "CentralEvaluation",
    "FedplugResult",
    "FedplugStrategy",
    "RoundObserver",
    "central_evaluation",
]

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

class FedplugStrategy(Strategy):
    """A Flower strategy driven by a fedplug ``train`` config.

    Two ways to choose the round's nodes:

    - ``num_clients=K`` (the simulator's way): the run has K clients, one per node; each
      round samples ``train.client_fraction`` of them with the simulator's seeded
      streams, so a Flower run with fedplug's client loop equals ``fedplug run``.
    - ``num_clients=None`` (Flower's way, as ``FedAvg``): the clients are the nodes
      connected when the run starts, or, when the nodes are queried and report a
      ``num-partitions``, that many (waited for); each round samples ``fraction_train``
      of those still connected as ``FedAvg`` does, seeded (the round core's sampling
      stream).

    Args:
        train_config: the ``train`` section, validated or as a dict (default None: an
            empty one, which validates to FedAvg with the defaults: so that
            ``FedplugStrategy(fraction_evaluate=...)``, Flower's quickstart with only the
            class name changed, runs FedAvg as Flower's ``FedAvg`` does).
        num_clients: K, the number of nodes (one fedplug client each); ``None``: sample
            among the connected nodes, Flower's way (default).
        num_classes: C; needed when a component needs the clients' class counts, or to
            build ``train.model`` (default: unknown).
        model: the global model, which holds the final one after a run (default:
            ``train.model`` built for ``input_shape`` and ``num_classes`` when both are
            given, seeded like the simulator's; else, for server-side algorithms, a
            stand-in holding the first ``initial_arrays``). Initial arrays unlike its
            ``state_dict()`` raise a ConfigError naming the differing keys.
        input_shape: the shape of one input; with a real model, for the FLOP count of
            the cost model (0 FLOPs without it).
        fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
        min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: ``FedAvg``'s, with its meaning
            and defaults; the nodes are drawn seeded, the same on a rerun. Differences
            (``fraction_train`` defaults to ``train.client_fraction``; renamed record
            keys only without fedplug's client side; the weight is ``num-examples``):
            docs/flower.md, 'FedAvg's keywords'.
        query_nodes: ask every node for its partition id and class counts before round 1
            even when no component needs the counts, so that client k is the node with
            ``partition-id=k`` (the ready ClientApp answers the query; default: only when
            a component needs the counts, as a stock ClientApp has no query handler).
        checkpoint_path: save the run after every round there and, when the file holds
            a run of this very config, resume after its last round (default: none).
        registry: the component registry (default: the installed plugins).
        message_config: entries added to the ConfigRecord of every message this
            strategy sends (the ready apps send the experiment here).
        federated_evaluation: ``False`` turns federated evaluation off whatever
            ``fraction_evaluate`` says (default True: as ``fraction_evaluate`` says).
        node_wait_seconds: how long to wait for the nodes a run or a round needs
            (default 300).
        link: the cost model's link and device rates (default: the FedGSP paper's).
        target_accuracy: for ``rounds_to_target`` in :attr:`run_result`.
        observers: called with every round's :class:`RoundRecord`.
        evaluate_fn: ``(round, arrays) -> MetricRecord`` for the round records' central
            ``accuracy`` and ``loss`` when this strategy is driven by another one's
            ``start`` (a DP wrapper), which keeps its own ``evaluate_fn`` to itself
            (default: the one :meth:`start` receives).
        accuracy_key: the name of the accuracy in the clients' evaluate metrics and in
            ``evaluate_fn``'s MetricRecord (default: the first of ``accuracy``,
            ``eval_acc`` and ``acc`` present; none there is named in one warning).

    Raises:
        ConfigError: a component needs every client's raw data in one place
            (``ClientNeeds.pooled_data``), which a Flower deployment must not do; a
            size is out of range; or a record key cannot be honoured.
    """
    def __init__(
        self,
        train_config: Mapping[str, Any] | Any | None = None,
        *,
        num_clients: int | None = None,
        num_classes: int | None = None,
        model: nn.Module | None = None,
        input_shape: Sequence[int] | None = None,
        fraction_train: float | None = None,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
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
        accuracy_key: str | None = None,
    ) -> None:
        report_fedplug_errors_in_one_line()  # before anything here can raise one
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        if train_config is None:
            train_config = {}
        if isinstance(train_config, Mapping):
            train_config = validate_section("train", dict(train_config), registry)
        fraction = train_config.client_fraction if fraction_train is None else fraction_train
        check_sizes(num_clients, num_classes, fraction, min_train_nodes, min_available_nodes)
        check_evaluation_sizes(fraction_evaluate, min_evaluate_nodes)
        self.config = train_config
        self.registry = registry
        self.num_clients = num_clients
        self.num_classes = num_classes
        self.fraction_train = fraction
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.fraction_evaluate = fraction_evaluate if federated_evaluation else 0.0
        self.min_evaluate_nodes = min_evaluate_nodes if self.fraction_evaluate else 0  # FedAvg's
        self.node_wait_seconds = node_wait_seconds
        self.message_config = dict(message_config or {})
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or weighted_metrics
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or weighted_metrics
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        components = build_components(train_config, registry, num_clients)
        self.sampler, self.loss_transform = components.sampler, components.loss_transform
        self.grouper = components.grouper
        self.needs = components.needs()
        self.client_requirements = requirement_line(train_config, components)
        """What the ClientApp must add to the quickstart shape (``None``: nothing)."""
        if self.needs.class_counts and num_classes is None:
            raise ConfigError(
                "FedplugStrategy needs num_classes= here: "
                f"{self.client_requirements or 'a component needs the class counts'}"
            )
        self.query_nodes = query_nodes or self.needs.class_counts
        self.record_keys = RecordKeys(arrayrecord_key, configrecord_key, weighted_by_key)
        self.record_keys.check(self.client_requirements)
        self.device = resolve_device(train_config.device)
        self.link = link or LinkAndDevice()
        self.target_accuracy = target_accuracy
        self.observers = list(observers)
        self.evaluate_fn = evaluate_fn
        self.accuracy = AccuracyKeys(accuracy_key)
        """Where the user's accuracy is in a MetricRecord (:mod:`.server_evaluation`)."""
        self.train_metrics_serverapp: dict[int, MetricRecord] = {}
        """Per fedplug round, what the server counted while training
        (:func:`.round_records.server_counters`): :class:`FedplugResult`'s, kept here
        too for a run driven by another strategy's ``start`` (a DP wrapper)."""
        self._grouping: str | None = None
        self._components = components
        self._plans: dict[int, RoundPlan] = {}
        self._evaluating: dict[int, int] = {}
        self._evaluate_sent: list[Message] = []
        """The evaluate messages in flight: only replies to them count."""
        self.model: nn.Module | None = None
        if model is None and input_shape is not None and num_classes is not None:
            model = build_global_model(train_config, registry, input_shape, num_classes, self.device)
        if model is None:  # a stand-in from the initial arrays, once they come
            check_stand_in_allowed(self.client_requirements)
        else:
            shape = tuple(input_shape) if input_shape is not None else None
            self._use_model(model, training_flops_per_sample(model, shape) if shape is not None else 0)

    def _use_model(self, model: nn.Module, train_flops: int = 0) -> None:
        """Hold ``model`` as the global model and build the run around its layout."""
        self.model = model
        self.layout = vector_layout(model)
        self.train_flops = train_flops
        settings = RunSettings(
            self.config, self.registry, self.nodes, self.messages, self.query_nodes,
            self.client_requirements, self.layout, self.train_flops, self.link,
            self.checkpoint_path, self.target_accuracy, self.observers,
            self._with_accuracy(self.evaluate_fn),
        )  # fmt: skip
        self.run = ServerRun(settings, self._components, self._vector_record)
        """The run: setup, start or resumption, and records (:mod:`.server_run`)."""
        self.exchange = TrainExchange(self.config, self.needs, self.layout, self.client_requirements)
        """The train messages of the round in progress (:mod:`.round_exchange`)."""

    def _with_accuracy(self, evaluate_fn: CentralEvaluation | None) -> CentralEvaluation | None:
        """``evaluate_fn`` whose metrics hold the user's accuracy also under
        ``accuracy``, for the round records (:meth:`AccuracyKeys.central`)."""
        if evaluate_fn is None:
            return None

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            return self.accuracy.central(evaluate_fn(server_round, arrays))

        return evaluate

    def _model_for(self, arrays: ArrayRecord) -> nn.Module:
        """The global model, a stand-in holding ``arrays`` when none was given."""
        if self.model is None:
            self._use_model(model_from_arrays(arrays, self.device))
        assert self.model is not None  # set just above
        return self.model

    # The run's state, read as the strategy's own (set by setup, start and every round).
    aggregator = property(attrgetter("run.aggregator"), doc="Rebuilt at setup when K is not fixed.")
    directory = property(attrgetter("run.directory"), doc="Which node holds which client.")
    core = property(attrgetter("run.core"), doc="The round core, started by setup.")
    setup_cost = property(attrgetter("run.setup_cost"), doc="The setup's rounds and bytes.")
    setup_seconds = property(attrgetter("run.setup_seconds"), doc="The setup phase's time.")
    fingerprint = property(attrgetter("run.fingerprint"), doc="Identifies the run's checkpoint.")
    history = property(attrgetter("run.history"), doc="fedplug's record of every round so far.")
    run_result = property(attrgetter("run.run_result"), doc="fedplug's RunResult so far.")
    final_vector = property(attrgetter("run.final_vector"), doc="The last global model.")

    @property
    def nodes(self) -> NodeRule:
        """How many nodes the run and each round need (:mod:`.node_sampling`)."""
        sizes = (self.fraction_train, self.min_train_nodes, self.min_available_nodes)
        return NodeRule(self.num_clients, *sizes, self.node_wait_seconds)

    @property
    def messages(self) -> NodeMessages:
        """What every message to a node carries (:mod:`.node_setup`)."""
        return NodeMessages(self.message_config, self.num_classes)

    # ------------------------------------------------------------------------ setup

    def summary(self) -> None:
        """Log what this strategy runs (Flower's ``Strategy.start`` calls this)."""
        evaluation = (self.fraction_evaluate, self.min_evaluate_nodes)
        log_summary(self.config, self.nodes, self.client_requirements, evaluation)

    def setup(self, grid: Grid, timeout: float | None = None) -> NodeDirectory:
        """Find the nodes, gather their class counts when a component needs them (see
        :mod:`.priors`), prepare the loss transform, run its setup phase over messages
        when it declares one, prepare the grouper, and start the round core.

        Raises:
            TrainingError: the nodes did not connect or did not all report, or a node
                failed in the setup phase; the message says what to fix.
        """
        return self.run.setup(grid, timeout)

    def _ensure_started(
        self, grid: Grid, arrays: ArrayRecord, timeout: float | None
    ) -> ArrayRecord:
        model = self._model_for(arrays)
        if self.run.began:
            return arrays
        check_arrays_match(model, arrays)
        if self.run.core is None:
            self.setup(grid, timeout)
        return self.run.begin(arrays)

    # ------------------------------------------------------------------------ train

    def plan(self, round_number: int) -> RoundPlan:
        """The plan of fedplug round ``round_number`` (1-based), computed once per round
        (a retried round trains the same plan)."""
        if round_number not in self._plans:
            if self.num_clients is not None:
                plan = self.run.plan(round_number - 1)
            else:
                directory = self.run.require_setup()
                assert self.exchange.grid is not None  # set by configure_train
                plan = self.nodes.plan_among_connected(
                    self.run.require_core(), directory, self.exchange.grid, round_number - 1
                )
            self._plans = {round_number: plan}
        return self._plans[round_number]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start a round: plan it and return the messages of every chain's first member.
        Before the first round, run :meth:`setup` and start the aggregator from
        ``arrays`` (or resume from the checkpoint), so Flower's own ``Strategy.start`` and
        wrapping strategies can drive this one."""
        self._model_for(arrays)
        self.exchange.grid = grid
        arrays = self._ensure_started(grid, arrays, self.exchange.timeout)
        round_number = server_round + self.run.offset
        self.run.records.round_starting(round_number)
        if self.exchange.round is None or self.exchange.round.server_round != round_number:
            self._log_round_start(self.plan(round_number), grid)
        self.exchange.start_round(
            round_number,
            self.plan,
            record_to_vector(arrays, self.layout),
            config,
            self.aggregator,
        )
        return self._next_messages()

    def _log_round_start(self, plan: RoundPlan, grid: Grid) -> None:
        """Flower's ``configure_train: Sampled N nodes (out of M)`` line (N: the nodes
        that train this round), and, with a grouper, what it does with the sampled
        nodes, whenever that differs from the last round's (:func:`grouping_line`)."""
        training = sum(len(chain) for chain in plan.chains)
        log_sampled("configure_train", training, len(list(grid.get_node_ids())))
        if self.config.grouper.name == "none":
            return
        line = grouping_line(self.config.grouper.name, plan)
        if line is not None and line != self._grouping:
            self._grouping = line
            logger.info("%s", line)

    def configure_hand_off(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Take the replies of one exchange and return the next members' messages, each
        carrying the model its chain's previous member returned ([] when every chain is
        done)."""
        self.exchange.absorb(replies)
        return self._next_messages()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take the replies, finish the round's chains (hand-offs through the grid that
        :meth:`configure_train` was given), and let the round core screen, aggregate and,
        under ``train.failures``, replay the round. The metrics are the clients' own,
        averaged by ``train_metrics_aggr_fn`` (weighted by ``num-examples``), as
        Flower's; what the server counted (``accepted``, ``failures``, ``bytes-up``,
        ``attempts``) goes to :attr:`train_metrics_serverapp`. Logs Flower's
        ``aggregate_train: Received N results and M failures`` line for each attempt
        (every reply of the round's exchanges, hand-offs included).

        Raises:
            TrainingError: too many clients failed in every attempt, the global model
                became non-finite, or a reply lacks what a component needs.
        """
        exchange = self.exchange
        round_ = exchange.require_round()
        round_number = round_.server_round
        exchange.send_until_done(self.configure_hand_off(round_number, replies), self.configure_hand_off)

        def train_attempt(attempt: int) -> list[Outcome]:
            if attempt > 0:
                arrays = self._vector_record(round_.global_vector)
                grid = exchange.grid
                assert grid is not None  # set by configure_train
                config = ConfigRecord(exchange.config)
                messages = self.configure_train(round_number - self.run.offset, arrays, config, grid)
                exchange.send_until_done(list(messages), self.configure_hand_off)
            log_received("aggregate_train", *exchange.received)
            return exchange.require_round().outcomes()

        plan = self.plan(round_number)
        attempt = self.run.require_core().run(round_number - 1, round_.global_vector, plan, train_attempt)
        self.run.records.trained(
            FinishedRound(round_number, plan, attempt, exchange.payload_bytes, exchange.started)
        )
        self.run.final_vector = attempt.vector
        self.train_metrics_serverapp[round_number] = server_counters(attempt)
        metrics = self.train_metrics_aggr_fn(exchange.accepted_replies(attempt), NUM_EXAMPLES)
        return self._vector_record(attempt.vector), metrics

    def _next_messages(self) -> list[Message]:
        return self.record_keys.applied(
            self.exchange.next_messages(
                self.run.require_setup(), self.messages, self._vector_record, self.run.loss_records
            )
        )

    def _vector_record(self, vector: Tensor) -> ArrayRecord:
        assert self.model is not None  # the run is built around a model (_use_model)
        vector_to_model(vector.to(self.device), self.model)
        return model_record(self.model)

    # --------------------------------------------------------------------- evaluate

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``evaluate`` message per node of the round's seeded sample
        (``fraction_evaluate``, ``min_evaluate_nodes``; none at ``fraction_evaluate=0``)."""
        if not self.fraction_evaluate:
            return []
        directory = self.run.require_setup()
        round_number = server_round + self.run.offset
        share = (self.fraction_evaluate, self.min_evaluate_nodes)
        self._evaluating = nodes_to_evaluate(directory, grid, share, self.config.seed, round_number - 1)
        messages = evaluate_messages(
            self._evaluating, round_number, arrays, config, self.messages, directory.num_clients
        )
        self._evaluate_sent = self.record_keys.applied(messages)
        return self._evaluate_sent

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' metrics averaged by ``evaluate_metrics_aggr_fn`` (weighted by
        ``num-examples``), plus the mean and (population) spread of their ``accuracy``
        (the simulator's ``client-accuracy-mean`` / ``-std``, see
        :func:`.messages.client_accuracy`). Records the round unless a central
        evaluation is still to come."""
        round_number = server_round + self.run.offset
        metrics, spread = federated_metrics(
            replies,
            self._evaluating,
            round_number,
            self.evaluate_metrics_aggr_fn,
            self.accuracy,
            sent=self._evaluate_sent,
        )
        self.run.records.evaluated_on_nodes(round_number, spread)
        return metrics

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
    ) -> FedplugResult:
        """Run the whole experiment: Flower's ``Strategy.start`` (``evaluate_fn`` at
        round 0 too), with ``initial_arrays`` defaulting to :attr:`model`'s and
        ``num_rounds`` to ``train.rounds``, resuming after the checkpoint's last round
        when ``checkpoint_path`` holds this run (``num_rounds`` counts the resumed
        rounds; the Result's rounds are fedplug's).

        ``timeout`` bounds each message exchange; with
        ``train.failures.client_timeout_seconds`` (T) set, an exchange also ends once no
        reply has come for T plus a margin (:func:`.chains.reply_wait`), and the nodes
        still silent fail their chains, so a hung node cannot stall the run.
        ``evaluate_fn(round, arrays)`` evaluates centrally; its accuracy (``accuracy_key``)
        and ``loss`` become the round's test metrics. The :class:`FedplugResult` is
        Flower's ``Result`` plus ``train_metrics_serverapp``, the server's counters per
        round. After the run,
        :attr:`run_result` holds fedplug's :class:`RunResult` (the simulator's
        ``metrics.json`` content) and :attr:`final_vector` the final model.

        Raises:
            TrainingError: too many clients failed in every attempt of a round, the
                global model became non-finite, or the checkpoint is another run's.
        """
        num_rounds = self.config.rounds if num_rounds is None else num_rounds
        evaluate_fn = evaluate_fn if evaluate_fn is not None else self.evaluate_fn
        if initial_arrays is None:
            if self.model is None:
                raise ConfigError("FedplugStrategy.start needs initial_arrays= when given no model=")
            initial_arrays = model_record(self.model)
        # Set up before Flower's loop only to know how many rounds a resumed run has left.
        arrays = self._ensure_started(grid, initial_arrays, timeout)
        self.exchange.timeout = timeout
        offset = self.run.offset
        remaining = num_rounds - offset
        if remaining <= 0:
            logger.info("fedplug: the checkpoint already holds all %d rounds", num_rounds)
            self.run.run_result = self.run.result()
            return FedplugResult(arrays=arrays, train_metrics_serverapp=dict(self.train_metrics_serverapp))

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            assert evaluate_fn is not None
            metrics = evaluate_fn(server_round + offset, arrays)
            if server_round > 0:
                self.run.records.evaluated_centrally(self.accuracy.central(metrics))
            else:
                self.accuracy.central(metrics)  # names a missing accuracy before round 1
            return metrics

        self.run.records.central_expected = evaluate_fn is not None
        try:
            result = super().start(
                # Flower's loop sends each round's first exchange: bound its wait too.
                ReplyDeadlineGrid.around(grid, self.exchange.reply_wait),
                arrays,
                remaining,
                timeout,
                train_config,
                evaluate_config,
                central if evaluate_fn is not None else None,
            )
        finally:
            self.run.records.central_expected = False
        self.run.records.finish()
        if self.final_vector is not None:
            result.arrays = self._vector_record(self.final_vector)
        self.run.run_result = self.run.result()
        return FedplugResult(
            arrays=result.arrays,
            train_metrics_clientapp=_shifted(result.train_metrics_clientapp, offset),
            evaluate_metrics_clientapp=_shifted(result.evaluate_metrics_clientapp, offset),
            evaluate_metrics_serverapp=_shifted(result.evaluate_metrics_serverapp, offset),
            train_metrics_serverapp=dict(self.train_metrics_serverapp),
        )

    def derived_params(self) -> dict[str, Any]:
        """The round core's derived parameters (the simulator's), with ``engine: flower``."""
        return self.run.require_core().derived_params("flower")


def _shifted(by_round: dict[int, MetricRecord], offset: int) -> dict[int, MetricRecord]:
    return {server_round + offset: metrics for server_round, metrics in by_round.items()}
