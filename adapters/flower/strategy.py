"""Server side: a Flower strategy (Message API) that runs any fedplug train config.

:class:`FedplugStrategy` does on a Flower grid what :class:`fedplug.simulation.simulator.Simulator`
does in one process, with the same components and the same random streams:

1. **setup** (once): a ``query`` message asks every node for its class counts
   (:mod:`.priors`); the loss transform (FedShift's prior) and the grouper (FedGSP's
   clusters) are prepared from them, and the aggregator is built for K clients. A loss
   transform whose preparation needs the clients' data runs it over messages instead
   (FedDisk's phase 1, :mod:`.density`), and its result stays on the nodes.
2. **each round**: sample clients (:func:`~fedplug.simulation.simulator.sample_clients`),
   let the grouper plan the chains (generator ``[seed, round, 0x6E0]``), and train:
   one exchange per chain position (:mod:`.chains`); a chain's model is handed to its
   next member through the server. The aggregator's server payload (SCAFFOLD's c) goes
   down with every model, its client extras (SCAFFOLD's delta_c, FedNova's a_k) come
   back in the reply, and ``fedplug.num-steps`` carries the local step count.
3. **screen and aggregate**: error replies, missing replies and replies with a wrong
   shape or non-finite values are dropped with a logged reason; the rest stream, in plan
   order, into :meth:`fedplug.components.Aggregator.aggregate`. Too many failures retry
   the round (``train.failures``), as in the simulator; clients that trained in the
   failed attempt start again from the state they had (see
   :func:`.trainer.load_client_state`).
4. **evaluate**: ``evaluate_fn`` (central, on the server's test set) and, optionally,
   an ``evaluate`` message to every node for its local test split.

Not supported on Flower: FedDiskAb, which pools raw data (see
:data:`UNSUPPORTED_LOSS_TRANSFORMS`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor, nn

from fedplug.algorithms.cost_model import LinkAndDevice, round_cost
from fedplug.algorithms.fedgsp import cpd_summary
from fedplug.components import PhaseCost, RoundPlan
from fedplug.config import validate_section
from fedplug.errors import ConfigError, TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.simulation.results import RoundRecord, RunResult
from fedplug.simulation.simulator import build_model, resolve_device, sample_clients
from fedplug.simulation.vectors import model_to_vector, tensors_num_bytes, vector_to_model

from .chains import RoundInProgress
from .density import MESSAGE_PHASES
from .priors import ClassCounts, NodeDirectory, gather_class_counts
from .records import (
    ACCURACY,
    CHAIN_POSITION,
    CLIENT_ID,
    CONFIG_KEY,
    LOSS,
    LOSS_INFO_KEY,
    LOSS_STATE_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_CLASSES,
    NUM_CLIENTS,
    NUM_EXAMPLES,
    PAYLOAD_KEY,
    ROUND,
    encode_loss_state,
    integer,
    model_record,
    number,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)

logger = logging.getLogger("fedplug.adapters.flower")

UNSUPPORTED_LOSS_TRANSFORMS = {
    "feddisk_ab": (
        "FedDiskAb is an oracle ablation that pools raw client data, which a Flower "
        "deployment must not do; run it with the built-in simulator (`fedplug run`)"
    ),
}
"""Loss transforms this adapter refuses, with the reason (FedDiskAb's ``prepare`` needs
every client's raw data)."""

RoundObserver = Callable[[RoundRecord], None]
CentralEvaluation = Callable[[int, ArrayRecord], "MetricRecord | None"]


@dataclass(frozen=True)
class _ModelShape:
    """What :func:`fedplug.simulation.simulator.build_model` reads from a federation."""

    input_shape: tuple[int, ...]
    num_classes: int


@dataclass
class _RoundOutcome:
    vector: Tensor | None
    accepted: int
    failures: int
    bytes_up: int


class FedplugStrategy(Strategy):
    """A Flower strategy driven by a fedplug ``train`` config.

    Args:
        train_config: the ``train`` section, validated or as a dict.
        num_clients: K, the number of nodes (one fedplug client each).
        num_classes: C.
        model: the global model (default: ``train.model`` built for ``input_shape`` and
            ``num_classes``, initialised from ``train.seed`` like the simulator's). The
            strategy loads every global model into it; after :meth:`start` it holds the
            final one.
        input_shape: the shape of one input; needed when ``model`` is not given, and
            for the FLOP count of the cost model (0 FLOPs without it).
        registry: the component registry (default: the installed plugins).
        message_config: entries added to the ConfigRecord of every message this
            strategy sends (the ready apps send the experiment here).
        federated_evaluation: send an ``evaluate`` message to every node after each
            round for its local test accuracy (default True).
        node_wait_seconds: how long setup waits for K nodes to connect (default 300).
        link: the cost model's link and device rates (default: the FedGSP paper's).
        target_accuracy: for ``rounds_to_target`` in :attr:`run_result`.
        observers: called with every round's :class:`RoundRecord`.

    Raises:
        ConfigError: the config names a component this adapter cannot run on Flower.
    """

    def __init__(
        self,
        train_config: Mapping[str, Any] | Any,
        *,
        num_clients: int,
        num_classes: int,
        model: nn.Module | None = None,
        input_shape: Sequence[int] | None = None,
        registry: Registry | None = None,
        message_config: Mapping[str, Any] | None = None,
        federated_evaluation: bool = True,
        node_wait_seconds: float = 300.0,
        link: LinkAndDevice | None = None,
        target_accuracy: float | None = None,
        observers: Iterable[RoundObserver] = (),
    ) -> None:
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        if isinstance(train_config, Mapping):
            train_config = validate_section("train", dict(train_config), registry)
        reason = UNSUPPORTED_LOSS_TRANSFORMS.get(train_config.loss_transform.name)
        if reason is not None:
            raise ConfigError(
                f"train.loss_transform {train_config.loss_transform.name!r} cannot run on Flower: {reason}"
            )
        if num_clients < 1 or num_classes < 1:
            raise ConfigError(
                f"num_clients ({num_clients}) and num_classes ({num_classes}) must be positive"
            )
        self.config = train_config
        self.registry = registry
        self.num_clients = num_clients
        self.num_classes = num_classes
        self.device = resolve_device(train_config.device)
        if model is None:
            if input_shape is None:
                raise ConfigError(
                    "FedplugStrategy needs either model= or input_shape= to build train.model"
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
        # Built in setup(), once the nodes have reported.
        self.directory: NodeDirectory | None = None
        self.loss_transform: Any = None
        self.aggregator: Any = None
        self.grouper: Any = None
        self.setup_cost = PhaseCost(0, 0, 0)
        self._loss_records: tuple[ArrayRecord, ConfigRecord] | None = None
        self._plans: dict[int, RoundPlan] = {}
        self._round: RoundInProgress | None = None
        self._grid: Grid | None = None
        self._exchange_config: dict[str, Any] = {}
        self._payload_record: ArrayRecord | None = None
        self._payload_bytes = 0
        self._evaluating: dict[int, int] = {}
        self._waiting: dict[int, Any] = {}
        self._node_of_reply: dict[int, int] = {}
        self.run_result: RunResult | None = None
        self.final_vector: Tensor | None = None

    # ------------------------------------------------------------------------ setup

    def summary(self) -> None:
        """Log what this strategy runs."""
        config = self.config
        logger.info(
            "fedplug strategy: sampler=%s loss_transform=%s aggregator=%s grouper=%s K=%d fraction=%.2f rounds=%d",
            config.sampler.name,
            config.loss_transform.name,
            config.aggregator.name,
            config.grouper.name,
            self.num_clients,
            config.client_fraction,
            config.rounds,
        )

    def setup(self, grid: Grid, timeout: float | None = None) -> NodeDirectory:
        """Gather the nodes' class counts and prepare the components (see :mod:`.priors`),
        running FedDisk's phase 1 over messages when the loss transform is FedDisk
        (:mod:`.density`).

        Raises:
            TrainingError: the nodes did not all report, or a node failed in FedDisk's
                phase 1.
            ConfigError: the loss transform needs more than class counts to prepare.
        """
        directory = gather_class_counts(
            grid,
            self.num_clients,
            self.num_classes,
            config=self.message_config,
            wait_seconds=self.node_wait_seconds,
            timeout=timeout,
        )
        config = self.config
        self.loss_transform = self.registry.build("loss_transforms", config.loss_transform)
        phase = MESSAGE_PHASES.get(config.loss_transform.name)
        if phase is not None:
            self.setup_cost = phase(
                grid,
                directory,
                config.loss_transform,
                message_config={
                    NUM_CLIENTS: self.num_clients,
                    NUM_CLASSES: self.num_classes,
                    **self.message_config,
                },
                timeout=timeout,
            )
            self._loss_records = None
        else:
            self._prepare_from_class_counts(directory)
        self.aggregator = self.registry.build("aggregators", config.aggregator, self.num_clients)
        self.grouper = self.registry.build("groupers", config.grouper)
        self.grouper.prepare(directory.class_counts)
        self.directory = directory
        return directory

    def _prepare_from_class_counts(self, directory: NodeDirectory) -> None:
        """Prepare the loss transform on the server and keep its state to send."""
        name = self.config.loss_transform.name
        try:
            self.setup_cost = self.loss_transform.prepare(
                ClassCounts(directory.class_counts)
            ) or PhaseCost(0, 0, 0)
        except AttributeError as error:
            raise ConfigError(
                f"train.loss_transform {name!r} cannot run on Flower: its prepare() reads more "
                f"than the clients' class counts ({error})"
            ) from None
        state = self.loss_transform.state_dict()
        self._loss_records = encode_loss_state(state, name) if state else None

    def _require_setup(self) -> NodeDirectory:
        if self.directory is None:
            raise RuntimeError(
                "call FedplugStrategy.setup(grid) (start() does) before the first round"
            )
        return self.directory

    # ------------------------------------------------------------------------ train

    def plan(self, server_round: int) -> RoundPlan:
        """The round's chains: the simulator's sampling and grouping, computed once per
        round (a retried round trains the same plan)."""
        if server_round not in self._plans:
            config = self.config
            round_index = server_round - 1
            clients = sample_clients(
                self.num_clients, config.client_fraction, config.seed, round_index
            )
            rng = np.random.default_rng([config.seed, round_index, 0x6E0])
            self._plans = {server_round: self.grouper.plan(server_round, clients, rng)}
        return self._plans[server_round]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start a round: plan it and return the messages of every chain's first member."""
        self._require_setup()
        self._grid = grid
        global_vector = record_to_vector(arrays, self.layout)
        self._round = RoundInProgress(server_round, self.plan(server_round), global_vector)
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
        """Take the last replies, screen every chain's result and aggregate them."""
        outcome, metrics = self._aggregate(replies)
        if outcome.vector is None:
            return None, metrics
        return self._vector_record(outcome.vector), metrics

    def _aggregate(self, replies: Iterable[Message]) -> tuple[_RoundOutcome, MetricRecord]:
        self._absorb(replies)
        round_ = self._require_round()
        if not round_.complete:
            raise RuntimeError(
                "chains of this round still have members to train; drive the round with "
                "FedplugStrategy.start() (or configure_hand_off) rather than one exchange"
            )
        updates = list(round_.updates(self.config.failures.client_timeout_seconds))
        model_bytes = self._model_bytes()
        bytes_up = sum(
            len(update.chain) * model_bytes + tensors_num_bytes(update.extras) for update in updates
        )
        try:
            vector: Tensor | None = self.aggregator.aggregate(round_.global_vector, iter(updates))
        except ValueError:
            if updates:
                raise
            vector = None
        metrics = MetricRecord(
            {"accepted": len(updates), "failures": round_.failures, "bytes-up": bytes_up}
        )
        return _RoundOutcome(vector, len(updates), round_.failures, bytes_up), metrics

    def _require_round(self) -> RoundInProgress:
        if self._round is None:
            raise RuntimeError("configure_train must start the round first")
        return self._round

    def _absorb(self, replies: Iterable[Message]) -> None:
        if self._waiting:
            self._require_round().absorb(
                self._waiting, list(replies), self.layout, self._node_of_reply
            )
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
                chain.fail(f"its node {node} is no longer connected")
                logger.warning(
                    "round %d: dropped client(s) %s: %s",
                    round_.server_round,
                    chain.chain,
                    chain.failure,
                )
                continue
            record = records.get(id(chain.vector))
            if record is None:
                record = records[id(chain.vector)] = self._vector_record(chain.vector)
            content = RecordDict(
                {
                    MODEL_KEY: record,
                    CONFIG_KEY: ConfigRecord(
                        {
                            **self._common_config(round_.server_round, client),
                            CHAIN_POSITION: chain.position,
                            **self._exchange_config,
                        }
                    ),
                }
            )
            if self._payload_record is not None:
                content[PAYLOAD_KEY] = self._payload_record
            if self._loss_records is not None:
                content[LOSS_STATE_KEY], content[LOSS_INFO_KEY] = self._loss_records
            messages.append(
                Message(
                    content,
                    dst_node_id=node,
                    message_type=MessageType.TRAIN,
                    group_id=str(round_.server_round),
                )
            )
            self._waiting[client] = chain
            self._node_of_reply[node] = client
        return messages

    def _common_config(self, server_round: int, client: int) -> dict[str, Any]:
        return {
            ROUND: server_round,
            CLIENT_ID: client,
            NUM_CLASSES: self.num_classes,
            NUM_CLIENTS: self.num_clients,
            **self.message_config,
        }

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
        connected = set(grid.get_node_ids())
        self._evaluating = {
            node: client for client, node in directory.node_of.items() if node in connected
        }
        return [
            Message(
                RecordDict(
                    {
                        MODEL_KEY: arrays,
                        CONFIG_KEY: ConfigRecord(
                            {**self._common_config(server_round, client), **dict(config)}
                        ),
                    }
                ),
                dst_node_id=node,
                message_type=MessageType.EVALUATE,
                group_id=str(server_round),
            )
            for node, client in sorted(self._evaluating.items(), key=lambda item: item[1])
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean and (population) spread of the per-client accuracies, over the clients
        with a non-empty local test split (the simulator's definition)."""
        accuracies: dict[int, float] = {}
        for reply in replies:
            client = self._evaluating.get(reply.metadata.src_node_id)
            if reply.has_error():
                logger.warning(
                    "round %d: client %s failed to evaluate: %s",
                    server_round,
                    client,
                    reply.error.reason,
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
        """Run the whole experiment: setup, then ``num_rounds`` rounds (default
        ``train.rounds``).

        ``timeout`` bounds each message exchange (``train.failures.client_timeout_seconds``
        bounds it further when set). ``evaluate_fn(round, arrays)`` evaluates centrally;
        its ``accuracy`` and ``loss`` become the round's test metrics. After the run,
        :attr:`run_result` holds fedplug's :class:`RunResult` (the simulator's
        ``metrics.json`` content) and :attr:`final_vector` the final model.

        Raises:
            TrainingError: too many clients failed in every attempt of a round, or the
                global model became non-finite.
        """
        self.summary()
        started_setup = time.perf_counter()
        self.setup(grid, timeout)
        logger.info(
            "fedplug setup: %d nodes reported in %.1fs",
            self.num_clients,
            time.perf_counter() - started_setup,
        )
        num_rounds = self.config.rounds if num_rounds is None else num_rounds
        exchange_timeout = timeout
        if self.config.failures.client_timeout_seconds is not None:
            exchange_timeout = min(timeout, self.config.failures.client_timeout_seconds)
        global_vector = (
            record_to_vector(initial_arrays, self.layout)
            if initial_arrays is not None
            else model_to_vector(self.model)
        )
        self.aggregator.initialize(global_vector)
        train_config = train_config if train_config is not None else ConfigRecord()
        evaluate_config = evaluate_config if evaluate_config is not None else ConfigRecord()
        result = Result()
        history: list[RoundRecord] = []
        total_bytes = self.setup_cost.bytes_up + self.setup_cost.bytes_down
        for server_round in range(1, num_rounds + 1):
            global_vector, record, train_metrics = self._run_round(
                grid,
                server_round,
                global_vector,
                exchange_timeout,
                train_config,
                evaluate_config,
                evaluate_fn,
                total_bytes,
                result,
            )
            total_bytes = record.cumulative_bytes
            history.append(record)
            result.train_metrics_clientapp[server_round] = train_metrics
            for observer in self.observers:
                observer(record)
        result.arrays = self._vector_record(global_vector)
        self.final_vector = global_vector
        self.run_result = RunResult(
            history,
            self.target_accuracy,
            setup_rounds=self.setup_cost.rounds,
            setup_bytes=self.setup_cost.bytes_up + self.setup_cost.bytes_down,
            derived_params=self.derived_params(),
        )
        return result

    def derived_params(self) -> dict[str, Any]:
        """As the simulator reports them, with ``engine: flower``."""
        derived: dict[str, Any] = {
            "train_flops_per_sample": int(self.train_flops),
            "model_bytes": self._model_bytes(),
            "engine": "flower",
        }
        if hasattr(self.config.aggregator, "effective_learning_rate"):
            derived["effective_learning_rate"] = self.config.aggregator.effective_learning_rate()
        return derived

    def _run_round(
        self,
        grid: Grid,
        server_round: int,
        global_vector: Tensor,
        timeout: float,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        evaluate_fn: CentralEvaluation | None,
        bytes_so_far: int,
        result: Result,
    ) -> tuple[Tensor, RoundRecord, MetricRecord]:
        config = self.config
        started = time.perf_counter()
        plan = self.plan(server_round)
        participants = sum(len(chain) for chain in plan.chains)
        arrays = self._vector_record(global_vector)
        policy = config.failures
        for attempt in range(policy.max_round_retries + 1):
            saved = copy.deepcopy(self.aggregator.state_dict())
            messages = list(self.configure_train(server_round, arrays, train_config, grid))
            while messages:
                replies = grid.send_and_receive(messages, timeout=timeout)
                messages = self.configure_hand_off(server_round, replies)
            outcome, train_metrics = self._aggregate([])
            failed_fraction = outcome.failures / max(len(plan.chains), 1)
            if outcome.vector is not None and failed_fraction <= policy.max_failed_fraction:
                new_vector = outcome.vector
                break
            self.aggregator.load_state_dict(saved)
            logger.warning(
                "round %d: %d of %d updates failed (limit %.0f%%); attempt %d of %d",
                server_round,
                outcome.failures,
                len(plan.chains),
                100 * policy.max_failed_fraction,
                attempt + 1,
                policy.max_round_retries + 1,
            )
        else:
            raise TrainingError(
                f"round {server_round}: {outcome.failures} of {len(plan.chains)} client updates failed in each of "
                f"{policy.max_round_retries + 1} attempts (train.failures.max_failed_fraction = "
                f"{policy.max_failed_fraction}); see the log for each client's reason"
            )
        if not torch.isfinite(new_vector).all():
            raise TrainingError(
                f"the global model became non-finite at round {server_round}; lower train.optimizer.lr "
                "or the server learning rate"
            )
        new_arrays = self._vector_record(new_vector)
        accuracy = loss = float("nan")
        if evaluate_fn is not None:
            central = evaluate_fn(server_round, new_arrays)
            if central is not None:
                result.evaluate_metrics_serverapp[server_round] = central
                accuracy = number(central, ACCURACY, float("nan"))
                loss = number(central, LOSS, float("nan"))
        client_mean = client_std = float("nan")
        evaluate_messages = list(
            self.configure_evaluate(server_round, new_arrays, evaluate_config, grid)
        )
        if evaluate_messages:
            federated = self.aggregate_evaluate(
                server_round, grid.send_and_receive(evaluate_messages, timeout=timeout)
            )
            if federated is not None:
                result.evaluate_metrics_clientapp[server_round] = federated
                client_mean = number(federated, "client-accuracy-mean")
                client_std = number(federated, "client-accuracy-std")
        directory = self._require_setup()
        groups = plan.groups if plan.groups is not None else plan.chains
        cpd_median, cpd_mean = cpd_summary(
            groups, directory.class_counts, getattr(config.grouper, "cpd_sigma", 1.0)
        )
        model_bytes = self._model_bytes()
        cost = round_cost(
            plan.chains,
            directory.sizes,
            config.local_epochs,
            self.train_flops,
            model_bytes,
            self.link,
        )
        bytes_down = (model_bytes + self._payload_bytes) * participants
        record = RoundRecord(
            round=server_round,
            accuracy=accuracy,
            loss=loss,
            client_accuracy_mean=client_mean,
            client_accuracy_std=client_std,
            bytes_up=outcome.bytes_up,
            bytes_down=bytes_down,
            cumulative_bytes=bytes_so_far + outcome.bytes_up + bytes_down,
            seconds=time.perf_counter() - started,
            participants=participants,
            failures=outcome.failures,
            cpd_median=float(cpd_median),
            cpd_mean=float(cpd_mean),
            compute_seconds_model=float(cost.compute_seconds),
            communication_seconds_model=float(cost.communication_seconds),
        )
        logger.info(
            "round %d: accuracy %.4f, %d/%d chains accepted, %.2fs",
            server_round,
            accuracy,
            outcome.accepted,
            len(plan.chains),
            record.seconds,
        )
        return new_vector, record, train_metrics


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
