"""Client side: fedplug's sampler, loss transform and aggregator client side for a
user's own Flower ClientApp, model and data.

:class:`FedplugTrainer` trains with :func:`fedplug.run.local_training.train_locally`, the
simulator's loop, so a client behaves identically on both; what must outlive a message
(SCAFFOLD's c_k, a setup phase's result) lives in ``context.state``.
Guide: docs/flower.md, 'FedplugTrainer: fedplug's loop in your ClientApp'; design:
'Design notes: trainer'.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.components import Context as LossContext
from fedplug.components import FederationSummary, LossTransform
from fedplug.config import validate_section
from fedplug.deadline import deadline
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.components import Components
from fedplug.run.local_training import (
    ClientAlgorithm,
    LocalSchedule,
    local_rng,
    train_locally,
)
from fedplug.run.vectors import move_tensors, vector_to_model
from fedplug.setup_phase import PhaseInputs, SetupPhase

from .capabilities import CLIENT_SLOTS, declare
from .local_data import DEFAULT_LABEL_KEY, LocalData, as_local_data, batches
from .records import (
    ACCURACY,
    CLASS_COUNTS,
    CLIENT_ID,
    CLIENT_TIMEOUT,
    CONFIG_KEY,
    EXTRAS_KEY,
    LOSS,
    LOSS_INFO_KEY,
    LOSS_STATE_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_CLASSES,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    NUM_STEPS,
    PARTITION_ID,
    PAYLOAD_KEY,
    REPLY_METRICS,
    ROUND,
    SECONDS,
    decode_loss_state,
    integer,
    model_record,
    number,
    record_to_tensors,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)
from .setup_phase import answer_setup_step, load_phase_state

DEFAULT_STATE_NAMESPACE = "fedplug"
DATA_CACHE_SIZE = 4
"""Data objects whose labels a trainer remembers."""


def _needs_prepare(loss_transform: LossTransform) -> bool:
    return type(loss_transform).prepare is not LossTransform.prepare


class FedplugTrainer:
    """Trains a user's model on a user's data with fedplug's client-side components.

    Args:
        train_config: a validated ``train`` section (:func:`fedplug.config.validate_section`).
            Its ``model``, ``engine``, ``client_fraction`` and ``rounds`` are not used here
            (the model is the user's; the server decides rounds and sampling).
        registry: the component registry (default: the installed plugins).
        num_classes: C, for the class counts the sampler and FedShift read (default: the
            server's ``fedplug.num-classes`` when it sends one, else the width of the
            model's output).
        label_key: the label's key in dict samples (flwr-datasets' ``batch["label"]``;
            default ``"label"``).
        input_key: the inputs' key in dict samples (e.g. ``"img"``; default: the one key
            besides the label and ``"sample_id"``).
        app: the ClientApp whose ``@app.train()`` calls :meth:`fit` (default: none); its
            components are declared on the app's capability handler
            (:mod:`.capabilities`), which the server asks before round 1.
    """

    def __init__(
        self,
        train_config: Any,
        *,
        registry: Registry | None = None,
        num_classes: int | None = None,
        label_key: str = DEFAULT_LABEL_KEY,
        input_key: str | None = None,
        app: ClientApp | None = None,
    ) -> None:
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        self.config = train_config
        self.registry = registry
        self.num_classes = num_classes
        self.label_key = label_key
        self.input_key = input_key
        # K only matters to the server side of an aggregator.
        self.components = Components.build(train_config, registry, num_clients=1)
        self.algorithm: ClientAlgorithm = self.components.client_algorithm()
        self.schedule = LocalSchedule(
            train_config.local_epochs, train_config.batch_size, train_config.optimizer
        )
        self.reply_metrics = self.components.needs().reply_metrics
        """The metrics every reply carries because the run's components read them; a
        server adds more by naming them in ``fedplug.reply-metrics``."""
        self._prepared = not _needs_prepare(self.algorithm.loss_transform)
        self._phases: dict[str, SetupPhase] = {
            phase.name: phase for _, phase in self.components.setup_phases()
        }
        """Every slot's setup phase by name: the ``train.<name>`` messages this node answers."""
        self._phase: SetupPhase | None = self.algorithm.loss_transform.setup_phase()
        """The loss transform's setup phase, whose state gives the loss its client context."""
        self._payload_keys = frozenset(self.algorithm.aggregator.client_needs().server_payload)
        """What the aggregator's server side sends with every model, as it declares it."""
        self._data_cache: dict[int, tuple[Any, torch.device, LocalData]] = {}
        if app is not None:
            self.declare_on(app)

    def declare_on(self, app: ClientApp) -> None:
        """Declare this trainer's components on ``app``'s capability handler (what
        ``app=`` does at construction), for a trainer built before its ClientApp."""
        declare(app, {slot: getattr(self.config, slot).name for slot in CLIENT_SLOTS})

    @classmethod
    def from_config(
        cls,
        train: Mapping[str, Any] | Any,
        *,
        registry: Registry | None = None,
        num_classes: int | None = None,
        label_key: str = DEFAULT_LABEL_KEY,
        input_key: str | None = None,
        app: ClientApp | None = None,
    ) -> FedplugTrainer:
        """Build from a ``train`` section as a dict (validated here, strictly: a typo is
        a :class:`~fedplug.errors.ConfigError` naming its path) or an already validated
        config. Unset fields take their defaults (uniform sampler, cross-entropy, FedAvg).
        The other arguments are :class:`FedplugTrainer`'s."""
        config = (
            validate_section("train", dict(train), registry)
            if isinstance(train, Mapping)
            else train
        )
        return cls(
            config,
            registry=registry,
            num_classes=num_classes,
            label_key=label_key,
            input_key=input_key,
            app=app,
        )

    # ------------------------------------------------------------------ preparation

    def prepare_from_class_counts(self, class_counts: np.ndarray) -> None:
        """Prepare the loss transform locally from the K x C class counts of all clients,
        for a server that does not send fedplug's prepared state (e.g. Flower's stock
        FedAvg). With :class:`~fedplug.adapters.flower.FedplugStrategy` on the server this
        is not needed: the server gathers the counts by a query message and sends the
        result."""
        self.algorithm.loss_transform.prepare(FederationSummary(np.asarray(class_counts)))
        self._prepared = True

    def _load_loss_state(self, content: RecordDict) -> None:
        state = decode_loss_state(
            content.array_records.get(LOSS_STATE_KEY), content.config_records.get(LOSS_INFO_KEY)
        )
        if state is not None:
            self.algorithm.loss_transform.load_state_dict(state)
            self._prepared = True
        if not self._prepared:
            name = self.config.loss_transform.name
            raise ConfigError(
                f"loss transform {name!r} needs state prepared from every client's class counts "
                "before training (FedShift's global prior), and the server sent none; run the "
                "server with fedplug.adapters.flower.FedplugStrategy, or call "
                "trainer.prepare_from_class_counts(counts) with the K x C class counts"
            )

    def _loss_context(
        self,
        content: RecordDict,
        context: Context,
        state_namespace: str,
        client_id: int,
        class_counts: np.ndarray,
        device: torch.device,
    ) -> LossContext:
        """The loss transform's client context: from what its setup phase left on this
        node when it declares one, else from the state the server sent."""
        if self._phase is not None:
            state = load_phase_state(context, state_namespace, self._phase.name, device)
            self._phase.check_data(state, int(class_counts.sum()))
            return move_tensors(self._phase.client_context(state), device)
        self._load_loss_state(content)
        return move_tensors(
            self.algorithm.loss_transform.client_context(client_id, class_counts), device
        )

    def _check_payload(self, payload: dict[str, Tensor]) -> None:
        """The keys the aggregator's server side sends (SCAFFOLD's ``c``) must be here."""
        missing = self._payload_keys - set(payload)
        if missing:
            raise ConfigError(
                f"aggregator {self.config.aggregator.name!r} needs {sorted(missing)} from the server "
                "with every model, and the message has none; run the server with "
                "fedplug.adapters.flower.FedplugStrategy"
            )

    def _local_data(self, data: Any, device: torch.device) -> LocalData:
        """``data`` as :class:`LocalData`. The labels of a dataset are read once per
        dataset object (reading them can mean loading every sample); a few objects are
        remembered, e.g. a train and a test loader used in turn."""
        cached = self._data_cache.get(id(data))
        if cached is not None and cached[0] is data and cached[1] == device:
            return cached[2]
        local = as_local_data(data, device, label_key=self.label_key, input_key=self.input_key)
        if len(self._data_cache) >= DATA_CACHE_SIZE:
            self._data_cache.pop(next(iter(self._data_cache)))
        self._data_cache[id(data)] = (data, device, local)
        return local

    # --------------------------------------------------------------------- messages

    def _num_classes(self, config: ConfigRecord, model: nn.Module | None, data: LocalData) -> int:
        if self.num_classes is not None:
            return self.num_classes
        if NUM_CLASSES in config:
            return integer(config, NUM_CLASSES)
        if model is None or data.num_samples == 0:
            raise ConfigError(
                "the number of classes is unknown; pass num_classes= to FedplugTrainer.from_config"
            )
        with torch.no_grad():
            was_training = model.training
            model.eval()
            width = int(model(data.inputs[torch.arange(1, device=data.labels.device)]).shape[-1])
            model.train(was_training)
        return width

    @staticmethod
    def _client_id(config: ConfigRecord, context: Context | None) -> int:
        return client_id_of(config, context)

    def fit(
        self,
        model: nn.Module,
        data: Any,
        message: Message,
        context: Context,
        *,
        state_namespace: str = DEFAULT_STATE_NAMESPACE,
    ) -> Message:
        """Train ``model`` on ``data`` from the model in ``message``; return the reply.

        Args:
            model: the user's torch model, of the architecture the server sends.
            data: ``(inputs, labels)`` tensors, a map-style Dataset of ``(input, label)``
                pairs or dict samples (a Hugging Face / flwr-datasets ``Dataset`` with its
                transform set, too), or a DataLoader over one (its batch size then
                replaces ``train.batch_size``; its shuffling is not used: the sampler
                decides the order). A dataset's labels are read
                once and kept while the same object is passed again; pass a new object
                when the data changes.
            message: the train message (Flower's ``"arrays"`` record and ``"config"``
                with ``server-round``; plus fedplug's payload and loss state when the
                server is :class:`~fedplug.adapters.flower.FedplugStrategy`).
            context: the ClientApp's context; ``context.state`` keeps the aggregator's
                per-client state between rounds.
            state_namespace: prefix of the keys in ``context.state`` (default
                ``"fedplug"``).

        Returns:
            The reply: the trained model as ``"arrays"`` (a state_dict record), a
            ``"metrics"`` record with ``num-examples`` (Flower's weighting key),
            ``fedplug.num-steps`` and ``fedplug.seconds``, plus the metrics the server
            asks for in ``fedplug.reply-metrics`` or this trainer's components read
            (``train_loss``, :data:`fedplug.components.TRAIN_LOSS`; computed only then),
            and the aggregator's extras when it has any.

        Raises:
            ClientTimeout: the training ran past the deadline (the server's
                ``fedplug.client-timeout-seconds``, or this trainer's
                ``train.failures.client_timeout_seconds``) and was interrupted; the
                ClientApp replies with this error, which the server counts as the client's
                failure.
        """
        started = time.perf_counter()
        content = message.content
        config = content.config_records.get(CONFIG_KEY, ConfigRecord())
        client_id = self._client_id(config, context)
        with deadline(self.client_timeout(config), f"client {client_id}"):
            return self._fit(
                model, data, message, context, config, client_id, state_namespace, started
            )

    def client_timeout(self, config: ConfigRecord) -> float | None:
        """The deadline of one :meth:`fit`: the smaller of the server's
        ``fedplug.client-timeout-seconds`` (its ``train.failures.client_timeout_seconds``)
        and this trainer's own ``train.failures.client_timeout_seconds`` (``None``: neither
        is set)."""
        limits = [self.config.failures.client_timeout_seconds]
        if CLIENT_TIMEOUT in config:
            limits.append(number(config, CLIENT_TIMEOUT))
        present = [float(limit) for limit in limits if limit is not None]
        return min(present) if present else None

    def _fit(
        self,
        model: nn.Module,
        data: Any,
        message: Message,
        context: Context,
        config: ConfigRecord,
        client_id: int,
        state_namespace: str,
        started: float,
    ) -> Message:
        content = message.content
        device = next(model.parameters()).device
        local = self._local_data(data, device)
        num_classes = self._num_classes(config, model, local)
        round_index = integer(config, ROUND, 1) - 1
        start_vector = record_to_vector(content.array_records[MODEL_KEY], vector_layout(model)).to(
            device
        )
        class_counts = local.class_counts(num_classes)
        loss_context = self._loss_context(
            content, context, state_namespace, client_id, class_counts, device
        )
        payload = record_to_tensors(content.array_records.get(PAYLOAD_KEY), device)
        self._check_payload(payload)
        client_state = load_client_state(context, state_namespace, round_index, device)
        schedule = self.schedule
        if local.batch_size is not None:
            schedule = dataclasses.replace(schedule, batch_size=local.batch_size)
        result = train_locally(
            model,
            start_vector,
            local.inputs,  # type: ignore[arg-type]  # a Tensor or IndexedInputs: both index by ids
            local.labels,
            class_counts,
            algorithm=self.algorithm,
            loss_context=loss_context,
            payload=payload,
            client_state=client_state,
            schedule=schedule,
            round_index=round_index,
            rng=local_rng(self.config.seed, round_index, client_id),
            reply_metrics=requested_metrics(config, self.reply_metrics),
        )
        save_client_state(context, state_namespace, client_state)
        metrics = MetricRecord(
            {
                NUM_EXAMPLES: result.num_samples,
                NUM_STEPS: result.num_steps,
                SECONDS: time.perf_counter() - started,
                CLIENT_ID: client_id,
                **result.metrics,
            }
        )
        reply = RecordDict({MODEL_KEY: model_record(model), METRICS_KEY: metrics})
        if result.extras:
            reply[EXTRAS_KEY] = tensors_to_record(result.extras)
        return Message(reply, reply_to=message)

    def setup_phase(
        self,
        data: Any,
        message: Message,
        context: Context,
        *,
        device: torch.device | str = "cpu",
        state_namespace: str = DEFAULT_STATE_NAMESPACE,
    ) -> Message:
        """Answer one message of the loss transform's setup phase (type
        ``train.<phase name>``, see :mod:`.setup_phase`): register it with
        ``@app.train("<phase name>")`` (FedDisk: ``"feddisk"``). What the phase keeps, and
        leaves at its end, stays in ``context.state``; later :meth:`fit` calls take the
        loss's context from it.

        Args:
            data: the training data :meth:`fit` receives (a phase's per-sample results
                follow its sample order).
            message: the server's setup-phase message.
            context: the ClientApp's context.
            device: where the phase computes (default ``"cpu"``).
            state_namespace: as in :meth:`fit` (default ``"fedplug"``).

        Raises:
            ConfigError: the loss transform declares no setup phase, or another one.
        """
        message_type = message.metadata.message_type
        phase = self._phases.get(message_type.partition(".")[2])
        if phase is None:
            declared = sorted(self._phases) or "none"
            raise ConfigError(
                f"a {message_type!r} message arrived, but the components declare no such setup "
                f"phase (their setup phases: {declared})"
            )
        config = message.content.config_records.get(CONFIG_KEY, ConfigRecord())
        local = self._local_data(data, torch.device(device))
        inputs = local.inputs[torch.arange(local.num_samples, device=local.labels.device)]
        client = PhaseInputs(self._client_id(config, context), inputs, local.labels)
        return answer_setup_step(phase, client, message, context, state_namespace, device)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Any, message: Message) -> Message:
        """Accuracy and mean cross-entropy of the message's model on ``data``, with raw
        logits (no loss transform: FedShift's shift is for training only). Reply metrics:
        ``num-examples``, ``accuracy``, ``loss`` (NaN for an empty split)."""
        device = next(model.parameters()).device
        local = self._local_data(data, device)
        vector = record_to_vector(message.content.array_records[MODEL_KEY], vector_layout(model))
        vector_to_model(vector.to(device), model)
        was_training = model.training
        model.eval()
        correct, total_loss = 0, 0.0
        for batch_ids in batches(local, local.batch_size or self.config.eval_batch_size):
            logits = model(local.inputs[batch_ids])
            targets = local.labels[batch_ids]
            total_loss += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(dim=1) == targets).sum())
        model.train(was_training)
        count = local.num_samples
        metrics = MetricRecord(
            {
                NUM_EXAMPLES: count,
                ACCURACY: correct / count if count else float("nan"),
                LOSS: total_loss / count if count else float("nan"),
            }
        )
        return Message(RecordDict({METRICS_KEY: metrics}), reply_to=message)

    def describe(self, data: Any, message: Message, context: Context | None = None) -> Message:
        """Answer the server's query for this client's class counts (what FedShift's
        prior and FedGSP's grouping need; the raw data never leaves the node).

        Reply metrics: ``num-examples``, ``fedplug.class-counts`` (C integers) and the
        node's ``fedplug.partition-id`` / ``fedplug.num-partitions`` (-1 when the node
        config has none)."""
        config = message.content.config_records.get(CONFIG_KEY, ConfigRecord())
        local = self._local_data(data, torch.device("cpu"))
        num_classes = self.num_classes
        if num_classes is None and NUM_CLASSES in config:
            num_classes = integer(config, NUM_CLASSES)
        if num_classes is None:
            raise ConfigError(
                "the number of classes is unknown; pass num_classes= to FedplugTrainer.from_config"
            )
        counts = local.class_counts(num_classes)
        node_config = context.node_config if context is not None else {}
        metrics = MetricRecord(
            {
                NUM_EXAMPLES: local.num_samples,
                CLASS_COUNTS: [int(count) for count in counts],
                PARTITION_ID: integer(node_config, "partition-id", -1),
                NUM_PARTITIONS: integer(node_config, "num-partitions", -1),
            }
        )
        return Message(RecordDict({METRICS_KEY: metrics}), reply_to=message)


def requested_metrics(config: ConfigRecord, own: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The reply metrics a train message's ``fedplug.reply-metrics`` asks for, after
    ``own`` (those the node's own components read), each once."""
    asked = config.get(REPLY_METRICS, [])
    if isinstance(asked, str):
        asked = [asked]
    return tuple(dict.fromkeys([*own, *(str(name) for name in asked)]))


def client_id_of(config: ConfigRecord, context: Context | None) -> int:
    """The server's ``fedplug.client-id``, else the node's ``partition-id``, else its
    node id: the key of the client's random stream
    (:func:`fedplug.run.local_training.local_rng`)."""
    if CLIENT_ID in config:
        return integer(config, CLIENT_ID)
    if context is not None and "partition-id" in context.node_config:
        return integer(context.node_config, "partition-id")
    return int(context.node_id) if context is not None else 0


# ------------------------------------------------------------------- client state


def load_client_state(
    context: Context, namespace: str, round_index: int, device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """The aggregator's per-client state for round ``round_index``.

    The state the round started from is kept beside the current one: when the server
    retries a round (too many clients failed), a client that already trained in the
    failed attempt starts again from the same state, as in the built-in simulator.
    """
    state = context.state
    current = state.array_records.get(f"{namespace}.client-state")
    marker = state.config_records.get(f"{namespace}.client-round")
    if marker is not None and integer(marker, "round") == round_index:
        return record_to_tensors(state.array_records.get(f"{namespace}.client-state-start"), device)
    state[f"{namespace}.client-state-start"] = current if current is not None else ArrayRecord()
    state[f"{namespace}.client-round"] = ConfigRecord({"round": round_index})
    return record_to_tensors(current, device)


def save_client_state(context: Context, namespace: str, client_state: dict[str, Tensor]) -> None:
    context.state[f"{namespace}.client-state"] = tensors_to_record(client_state)
