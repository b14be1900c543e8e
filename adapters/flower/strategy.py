"""Server side: a Flower strategy (Message API) that runs any fedplug train config.

:class:`FedplugStrategy` moves models and messages; the round itself is
:class:`fedplug.federated_round.RoundCore`'s, the same as the simulator's:

1. **setup** (once): a ``query`` message asks every node for its class counts
   (:mod:`.priors`); that also tells which node holds which client. The loss transform is
   prepared from the counts (FedShift's prior), then its setup phase, if it declares one,
   runs over messages (FedDisk's density models; the result stays on the nodes). The
   grouper is prepared from the counts too (FedGSP's clusters).
2. **each round**: the core plans it (sampling and the grouper's chains, with the
   simulator's random streams); one exchange per chain position (:mod:`.chains`), a
   chain's model handed to its next member through the server. The aggregator's server
   payload (SCAFFOLD's c) goes down with every model, its client extras (SCAFFOLD's
   delta_c, FedNova's a_k) come back in the reply, ``fedplug.num-steps`` carries the
   local step count.
3. **screen, aggregate or retry**: every chain becomes a ``ClientUpdate`` or a
   ``ClientFailure``, and :meth:`RoundCore.run` screens them, aggregates, and retries
   the round under ``train.failures``; clients that trained in a failed attempt start
   again from the state they had (see :func:`.trainer.load_client_state`).
4. **evaluate and record**: ``evaluate_fn`` (central, on the server's test set) and,
   optionally, an ``evaluate`` message to every node for its local test split; the core
   writes the round's record.

A component that needs every client's raw data in one place (``ClientNeeds.pooled_data``,
FedDiskAb) is refused with the component's own reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor, nn

from fedplug.cost_model import LinkAndDevice
from fedplug.components import PhaseCost, RoundPlan
from fedplug.config import validate_section
from fedplug.errors import ConfigError
from fedplug.federated_round import Attempt, Evaluation, Outcome, RoundCore, client_needs
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.simulation.results import RoundRecord, RunResult
from fedplug.simulation.simulator import build_model, resolve_device
from fedplug.simulation.vectors import tensors_num_bytes, vector_to_model

from .chains import RoundInProgress
from .messages import client_accuracy, evaluate_message, train_message
from .priors import ClassCounts, NodeDirectory, gather_class_counts
from .records import (
    ACCURACY,
    CHAIN_POSITION,
    CLIENT_ID,
    LOSS,
    NUM_CLASSES,
    NUM_CLIENTS,
    ROUND,
    encode_loss_state,
    model_record,
    number,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)
from .setup_phase import run_setup_phase

logger = logging.getLogger("fedplug.adapters.flower")

RoundObserver = Callable[[RoundRecord], None]
CentralEvaluation = Callable[[int, ArrayRecord], "MetricRecord | None"]


@dataclass(frozen=True)
class _ModelShape:
    """What :func:`fedplug.simulation.simulator.build_model` reads from a federation."""

    input_shape: tuple[int, ...]
    num_classes: int


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
        ConfigError: a component needs every client's raw data in one place
            (``ClientNeeds.pooled_data``), which a Flower deployment must not do.
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
        if num_clients < 1 or num_classes < 1:
            raise ConfigError(
                f"num_clients ({num_clients}) and num_classes ({num_classes}) must be positive"
            )
        self.config = train_config
        self.registry = registry
        self.num_clients = num_clients
        self.num_classes = num_classes
        self.loss_transform = registry.build("loss_transforms", train_config.loss_transform)
        self.aggregator = registry.build("aggregators", train_config.aggregator, num_clients)
        self.grouper = registry.build("groupers", train_config.grouper)
        sampler = registry.build("samplers", train_config.sampler)
        needs = client_needs(sampler, self.loss_transform, self.aggregator, self.grouper)
        if needs.pooled_data is not None:
            raise ConfigError(
                f"train.loss_transform {train_config.loss_transform.name!r} cannot run on "
                f"Flower: {needs.pooled_data}"
            )
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
        # Set by setup(), once the nodes have reported.
        self.directory: NodeDirectory | None = None
        self.core: RoundCore | None = None
        self.setup_cost = PhaseCost(0, 0, 0)
        self._loss_records: tuple[ArrayRecord, ConfigRecord] | None = None
        # The round in progress (configure_train .. aggregate_train).
        self._plans: dict[int, RoundPlan] = {}
        self._round: RoundInProgress | None = None
        self._grid: Grid | None = None
        self._exchange_timeout = train_config.failures.client_timeout_seconds or 3600.0
        self._exchange_config: dict[str, Any] = {}
        self._payload_record: ArrayRecord | None = None
        self._payload_bytes = 0
        self._waiting: dict[int, Any] = {}
        self._node_of_reply: dict[int, int] = {}
        self._attempt: Attempt | None = None
        self._evaluating: dict[int, int] = {}
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
        """Gather the nodes' class counts (see :mod:`.priors`), prepare the loss
        transform from them, run its setup phase over messages when it declares one,
        prepare the grouper, and start the round core.

        Raises:
            TrainingError: the nodes did not all report, or a node failed in the setup
                phase.
        """
        directory = gather_class_counts(
            grid,
            self.num_clients,
            self.num_classes,
            config=self.message_config,
            wait_seconds=self.node_wait_seconds,
            timeout=timeout,
        )
        self.setup_cost = self._prepare_loss_transform(grid, directory, timeout)
        self.grouper.prepare(directory.class_counts)
        self.core = RoundCore(
            self.config,
            aggregator=self.aggregator,
            grouper=self.grouper,
            num_clients=self.num_clients,
            class_counts=directory.class_counts,
            client_sizes=directory.sizes,
            model_bytes=self._model_bytes(),
            train_flops=self.train_flops,
            link=self.link,
            runtime="flower",
        )
        self.directory = directory
        return directory

    def _prepare_loss_transform(
        self, grid: Grid, directory: NodeDirectory, timeout: float | None
    ) -> PhaseCost:
        """Prepare the loss transform from the class counts, then run its setup phase on
        the nodes; keep the prepared state to send with every train message."""
        message_config = {
            NUM_CLIENTS: self.num_clients,
            NUM_CLASSES: self.num_classes,
            **self.message_config,
        }
        transform = self.loss_transform
        cost = transform.prepare(ClassCounts(directory.class_counts)) or PhaseCost(0, 0, 0)
        phase = transform.setup_phase()  # after prepare, which may have loaded its result
        if phase is not None:
            extra = run_setup_phase(
                grid, directory.node_of, phase, message_config=message_config, timeout=timeout
            )
            cost = PhaseCost(
                cost.rounds + extra.rounds,
                cost.bytes_up + extra.bytes_up,
                cost.bytes_down + extra.bytes_down,
            )
        state = transform.state_dict()
        name = self.config.loss_transform.name
        self._loss_records = encode_loss_state(state, name) if state else None
        return cost

    def _require_core(self) -> RoundCore:
        if self.core is None:
            raise RuntimeError(
                "call FedplugStrategy.setup(grid) (start() does) before the first round"
            )
        return self.core

    def _require_setup(self) -> NodeDirectory:
        self._require_core()
        assert self.directory is not None  # set with the core
        return self.directory

    # ------------------------------------------------------------------------ train

    def plan(self, server_round: int) -> RoundPlan:
        """The round's chains, computed once per round (a retried round trains the same
        plan)."""
        if server_round not in self._plans:
            self._plans = {server_round: self._require_core().plan(server_round - 1)}
        return self._plans[server_round]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start a round: plan it and return the messages of every chain's first member.
        Before the first round, when :meth:`start` did not, run :meth:`setup` and start
        the aggregator from ``arrays`` (so Flower's own ``Strategy.start`` and wrapping
        strategies can drive this one)."""
        if self.core is None:
            self.setup(grid)
            self.aggregator.initialize(record_to_vector(arrays, self.layout))
        self._grid = grid
        self._round = RoundInProgress(
            server_round,
            self.plan(server_round),
            record_to_vector(arrays, self.layout),
            self.layout,
            self.config.failures.client_timeout_seconds,
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
        under ``train.failures``, replay the round.

        Raises:
            TrainingError: too many clients failed in every attempt, or the global model
                became non-finite.
        """
        round_ = self._require_round()
        self._exchange(self.configure_hand_off(server_round, replies))

        def train_attempt(attempt: int) -> list[Outcome]:
            if attempt > 0:
                arrays = self._vector_record(round_.global_vector)
                grid = self._grid
                assert grid is not None  # set by configure_train
                config = ConfigRecord(self._exchange_config)
                self._exchange(self.configure_train(server_round, arrays, config, grid))
            return self._require_round().outcomes()

        core = self._require_core()
        attempt = core.run(server_round - 1, round_.global_vector, round_.plan, train_attempt)
        self._attempt = attempt
        tally = attempt.tally
        metrics = MetricRecord(
            {
                "accepted": tally.accepted,
                "failures": tally.failures,
                "bytes-up": tally.bytes_up,
                "attempts": attempt.attempts,
            }
        )
        return self._vector_record(attempt.vector), metrics

    def _exchange(self, messages: list[Message]) -> None:
        """Send ``messages`` and every hand-off they lead to, until the round's chains are done."""
        grid = self._grid
        while messages:
            assert grid is not None  # set by configure_train
            replies = grid.send_and_receive(messages, timeout=self._exchange_timeout)
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
                **self._exchange_config,
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
            evaluate_message(
                node, server_round, arrays, {**self._common_config(server_round, client), **config}
            )
            for node, client in sorted(self._evaluating.items(), key=lambda item: item[1])
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean and (population) spread of the per-client accuracies (see
        :func:`.messages.client_accuracy`)."""
        return client_accuracy(replies, self._evaluating, server_round)

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
        client_timeout = self.config.failures.client_timeout_seconds
        self._exchange_timeout = timeout if client_timeout is None else min(timeout, client_timeout)
        arrays = initial_arrays if initial_arrays is not None else model_record(self.model)
        global_vector = record_to_vector(arrays, self.layout)
        self.aggregator.initialize(global_vector)
        train_config = train_config if train_config is not None else ConfigRecord()
        evaluate_config = evaluate_config if evaluate_config is not None else ConfigRecord()
        result = Result()
        history: list[RoundRecord] = []
        total_bytes = self.setup_cost.bytes_up + self.setup_cost.bytes_down
        for server_round in range(1, num_rounds + 1):
            started = time.perf_counter()
            messages = list(self.configure_train(server_round, arrays, train_config, grid))
            replies = grid.send_and_receive(messages, timeout=self._exchange_timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            assert new_arrays is not None and self._attempt is not None  # or it raised
            arrays, global_vector = new_arrays, self._attempt.vector
            result.train_metrics_clientapp[server_round] = train_metrics
            evaluation = self._evaluate(
                server_round, arrays, evaluate_config, evaluate_fn, grid, result
            )
            record = self._require_core().record(
                server_round - 1,
                self.plan(server_round),
                self._attempt,
                evaluation,
                payload_bytes=self._payload_bytes,
                bytes_so_far=total_bytes,
                started=started,
            )
            logger.info(
                "round %d: accuracy %.4f, %d/%d chains accepted, %.2fs",
                server_round,
                record.accuracy,
                self._attempt.tally.accepted,
                len(self.plan(server_round).chains),
                record.seconds,
            )
            total_bytes = record.cumulative_bytes
            history.append(record)
            for observer in self.observers:
                observer(record)
        self.final_vector = global_vector
        result.arrays = self._vector_record(global_vector)
        self.run_result = RunResult(
            history,
            self.target_accuracy,
            setup_rounds=self.setup_cost.rounds,
            setup_bytes=self.setup_cost.bytes_up + self.setup_cost.bytes_down,
            derived_params=self.derived_params(),
        )
        return result

    def _evaluate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        evaluate_config: ConfigRecord,
        evaluate_fn: CentralEvaluation | None,
        grid: Grid,
        result: Result,
    ) -> Evaluation:
        """The round's central and federated evaluation (NaN where there is none)."""
        accuracy = loss = client_mean = client_std = float("nan")
        if evaluate_fn is not None:
            central = evaluate_fn(server_round, arrays)
            if central is not None:
                result.evaluate_metrics_serverapp[server_round] = central
                accuracy = number(central, ACCURACY, float("nan"))
                loss = number(central, LOSS, float("nan"))
        messages = list(self.configure_evaluate(server_round, arrays, evaluate_config, grid))
        if messages:
            replies = grid.send_and_receive(messages, timeout=self._exchange_timeout)
            federated = self.aggregate_evaluate(server_round, replies)
            if federated is not None:
                result.evaluate_metrics_clientapp[server_round] = federated
                client_mean = number(federated, "client-accuracy-mean")
                client_std = number(federated, "client-accuracy-std")
        return Evaluation(accuracy, loss, client_mean, client_std)

    def derived_params(self) -> dict[str, Any]:
        """The round core's derived parameters (the simulator's), with ``engine: flower``."""
        return self._require_core().derived_params("flower")


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
