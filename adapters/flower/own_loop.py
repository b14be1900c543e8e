"""fedplug's client side as pieces of the user's own training loop: their model, their
DataLoader, their optimiser, their criterion.

:class:`FedplugLoss` wraps the user's criterion with the loss transform's and the
aggregator's client side (FedProx, FedShift, SCAFFOLD, FedDisk's weights); with the
sampler (:class:`~fedplug.adapters.flower.round_sampler.RoundSampler`) it turns a Flower
PyTorch ``@app.train()`` loop into any fedplug algorithm's client in a few lines.
Guide: docs/flower.md, 'Client-side algorithms: a few lines of your loop';
design: 'Design notes: own_loop'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor, nn

from fedplug.components import TRAIN_LOSS, LocalTraining, LossTransform
from fedplug.config import validate_section
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.local_training import check_reply_metrics, mean_loss
from fedplug.run.vectors import model_to_vector, split_like

from .capabilities import declare
from .local_data import DEFAULT_LABEL_KEY
from .own_loop_common import (
    ComponentSpec,
    DataOf,
    LabelCache,
    answer_class_counts,
    component_spec,
    message_config,
    registry_or_default,
)
from .records import (
    EXTRAS_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_CLASSES,
    NUM_STEPS,
    PAYLOAD_KEY,
    ROUND,
    integer,
    record_to_tensors,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)
from .trainer import (
    DEFAULT_STATE_NAMESPACE,
    FedplugTrainer,
    client_id_of,
    load_client_state,
    requested_metrics,
    save_client_state,
)


class FedplugLoss:
    """The user's criterion plus what fedplug's loss transform and aggregator add on the
    client, for their own loop and optimiser.

    Per round: :meth:`begin_round` (returns ``self``: use it as the criterion), then
    ``criterion(logits, targets[, sample_ids])`` for every batch, then, when the
    aggregator has a client side (SCAFFOLD), :meth:`finish_round` on the reply.

    The batch loss is fedplug's: the criterion's value, or, for a loss transform with its
    own per-sample loss (FedShift's shifted logits, Reweighting's and FedDisk's weights),
    that loss's batch mean (it replaces the criterion, which is then expected to be plain
    cross-entropy); plus the loss transform's penalty (FedProx) and the aggregator's
    client penalty (SCAFFOLD's correction), measured from the parameters the round
    started from.

    Args:
        loss_transform: the loss transform's config (default: plain cross-entropy).
        aggregator: the aggregator's config, for its client side (default: FedAvg, none).
        criterion: the user's criterion (default ``nn.CrossEntropyLoss()``).
        app: the ClientApp; with ``data``, the handlers the components need are
            registered on it: ``@app.query()`` answering the server's class-count query
            when a component needs class counts, ``@app.train("<phase>")`` answering the
            loss transform's setup phase when it declares one (FedDisk's).
        data: the node's training data given the context (:data:`DataOf`), for those
            handlers.
        num_classes: C (default: the server's ``fedplug.num-classes``, else the model's
            output width).
        label_key: the label's key in dict samples (default ``"label"``).
        input_key: the inputs' key in dict samples, for a setup phase (default: the one
            key besides the label).
        registry: the component registry (default: the installed plugins).
        state_namespace: prefix of this object's keys in ``context.state`` (default
            ``"fedplug"``).
    """

    def __init__(
        self,
        *,
        loss_transform: ComponentSpec | None = None,
        aggregator: ComponentSpec | None = None,
        criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
        app: ClientApp | None = None,
        data: DataOf | None = None,
        num_classes: int | None = None,
        label_key: str = DEFAULT_LABEL_KEY,
        input_key: str | None = None,
        registry: Registry | None = None,
        state_namespace: str = DEFAULT_STATE_NAMESPACE,
    ) -> None:
        registry = registry_or_default(registry)
        train: dict[str, Any] = {}
        if loss_transform is not None:
            train["loss_transform"] = component_spec(loss_transform)
        if aggregator is not None:
            train["aggregator"] = component_spec(aggregator)
        self.trainer = FedplugTrainer.from_config(
            train,
            registry=registry,
            num_classes=num_classes,
            label_key=label_key,
            input_key=input_key,
        )
        algorithm = self.trainer.algorithm
        self.criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
        self.state_namespace = state_namespace
        self.needs = self.trainer.components.needs()
        self._phases = [phase for _, phase in self.trainer.components.setup_phases()]
        self._uses_client_data = (
            self.needs.class_counts
            or bool(self._phases)
            or type(algorithm.loss_transform).client_context is not LossTransform.client_context
        )
        self._labels = LabelCache(label_key)
        self._round: _Round | None = None
        if app is not None:
            self.register(app, data)

    # ------------------------------------------------------------------ handlers

    def register(self, app: ClientApp, data: DataOf | None) -> None:
        """Register on ``app`` what the components need the node to answer: the class
        counts query (``@app.query()``) and every component's setup phase
        (``@app.train("<phase name>")``), and its components on the app's capability
        handler (:mod:`.capabilities`), which the server asks before round 1."""
        config = self.trainer.config
        declare(
            app,
            {"loss_transform": config.loss_transform.name, "aggregator": config.aggregator.name},
        )
        if not (self.needs.class_counts or self._phases):
            return
        if data is None:
            raise ConfigError(
                f"{self._names()} needs the node's training data to answer the server "
                f"({', '.join(self._data_uses())}): pass data=<context -> training data>"
            )
        if self.needs.class_counts:
            answer_class_counts(app, data, trainer=self.trainer)
        if self._phases:
            trainer, namespace = self.trainer, self.state_namespace

            def setup_phase(message: Message, context: Context) -> Message:
                return trainer.setup_phase(
                    data(context), message, context, state_namespace=namespace
                )

            for phase in self._phases:
                app.train(phase.name)(setup_phase)

    def _names(self) -> str:
        config = self.trainer.config
        return (
            f"loss transform {config.loss_transform.name!r} with aggregator "
            f"{config.aggregator.name!r}"
        )

    def _data_uses(self) -> list[str]:
        uses = ["its class counts"] if self.needs.class_counts else []
        uses.extend(f"the setup phase {phase.name!r}" for phase in self._phases)
        return uses

    # --------------------------------------------------------------------- round

    def begin_round(
        self, message: Message, context: Context, model: nn.Module, data: Any = None
    ) -> FedplugLoss:
        """Start the round of the train ``message`` for ``model``: the parameters the
        round starts from (the message's ``arrays``), the loss transform's context for
        this client, the aggregator's payload and per-client state. Returns ``self``, to
        use as the criterion.

        Args:
            message: the train message.
            context: the ClientApp's context (``context.state`` keeps per-client state).
            model: the model being trained (its parameters enter the penalties).
            data: the node's training data (a dataset, a DataLoader or the labels); needed
                when the loss transform works from the client's labels or its setup
                phase's result (FedShift, Reweighting, FedDisk).

        Raises:
            ConfigError: ``data`` is missing where needed, or the message lacks what a
                component needs (the loss transform's prepared state, the aggregator's
                payload): the server is not :class:`~fedplug.adapters.flower.FedplugStrategy`
                with the same components.
        """
        content = message.content
        config = message_config(message)
        client_id = client_id_of(config, context)
        round_index = integer(config, ROUND, 1) - 1
        device = next(model.parameters()).device
        if MODEL_KEY in content.array_records:
            start_vector = record_to_vector(content.array_records[MODEL_KEY], vector_layout(model))
        else:
            start_vector = model_to_vector(model).cpu()
        start_vector = start_vector.to(device)
        class_counts = np.zeros(0, dtype=np.int64)
        if self._uses_client_data:
            if data is None:
                raise ConfigError(
                    f"{self._names()} works from this client's own data: pass it, "
                    "criterion = loss.begin_round(msg, context, model, trainset)"
                )
            labels = self._labels(data)
            num_classes = self.trainer.num_classes
            if num_classes is None and NUM_CLASSES in config:
                num_classes = integer(config, NUM_CLASSES)
            if num_classes is None:
                with torch.no_grad():
                    num_classes = int(_output_width(model, data, self.trainer))
            class_counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
        loss_context = self.trainer._loss_context(
            content, context, self.state_namespace, client_id, class_counts, device
        )
        payload = record_to_tensors(content.array_records.get(PAYLOAD_KEY), device)
        self.trainer._check_payload(payload)
        client_state = load_client_state(context, self.state_namespace, round_index, device)
        aggregator = self.trainer.algorithm.aggregator
        start_parameters = split_like(start_vector, dict(model.named_parameters()))
        reply_metrics = requested_metrics(config, self.needs.reply_metrics)
        check_reply_metrics(reply_metrics)
        self._round = _Round(
            model=model,
            context=context,
            start_vector=start_vector,
            anchor={key: value.detach().clone() for key, value in start_parameters.items()},
            loss_context=loss_context,
            payload=payload,
            client_state=client_state,
            aggregator_context=aggregator.client_context(payload, client_state),
            reply_metrics=reply_metrics,
        )
        return self

    def __call__(self, logits: Tensor, targets: Tensor, sample_ids: Tensor | None = None) -> Tensor:
        """The batch loss (see the class docstring). ``sample_ids``: each sample's index
        in the client's training set, for a loss that weighs samples (FedDisk's): wrap
        the dataset with :func:`~.local_data.with_sample_ids` and pass
        ``batch["sample_id"]``."""
        round_ = self._require_round()
        algorithm = self.trainer.algorithm
        transform = algorithm.loss_transform
        if algorithm.plain_cross_entropy:
            loss = self.criterion(logits, targets)
        else:
            loss = self._per_sample_loss(logits, targets, sample_ids, round_).mean()
        if algorithm.has_penalty:
            params = dict(round_.model.named_parameters())
            anchor = round_.anchor_on(params)
            for term in (
                transform.penalty(params, anchor, round_.loss_context),
                algorithm.aggregator.client_penalty(params, anchor, round_.aggregator_context),
            ):
                if term is not None:
                    loss = loss + term
        if torch.is_grad_enabled() and logits.requires_grad:
            round_.num_steps += 1
            if TRAIN_LOSS in round_.reply_metrics:  # summed on the device: no sync per step
                detached = loss.detach()
                if round_.loss_sum is None:
                    round_.loss_sum = torch.zeros((), dtype=torch.float64, device=detached.device)
                round_.loss_sum += detached
        return loss

    def _per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor | None, round_: _Round
    ) -> Tensor:
        transform = self.trainer.algorithm.loss_transform
        if sample_ids is None:
            missing = torch.full_like(targets, -1, dtype=torch.long)
            try:
                return transform.per_sample_loss(logits, targets, missing, round_.loss_context)
            except (IndexError, RuntimeError) as error:
                raise ConfigError(
                    f"loss transform {self.trainer.config.loss_transform.name!r} weighs each "
                    "sample by its index in the client's training set: wrap the dataset with "
                    "with_sample_ids(trainset) and call criterion(logits, labels, "
                    f'batch["sample_id"]) ({type(error).__name__}: {error})'
                ) from None
        ids = torch.as_tensor(sample_ids, dtype=torch.long, device=logits.device)
        return transform.per_sample_loss(logits, targets, ids, round_.loss_context)

    @property
    def num_steps(self) -> int:
        """Optimiser steps of this round so far: the loss evaluations with gradients."""
        return self._require_round().num_steps

    def finish_round(
        self,
        content: RecordDict | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        learning_rate: float | None = None,
        num_steps: int | None = None,
    ) -> dict[str, Tensor]:
        """End the round: the aggregator's client side (``client_finish``) runs on the
        trained model, its per-client state goes to ``context.state``, and when
        ``content`` (the reply's RecordDict) is given its extras go in as
        ``"fedplug.extras"`` and the step count into its ``"metrics"``, with the reply
        metrics the server asked for (``train_loss``: the mean of this round's batch
        losses with gradients, :data:`fedplug.components.TRAIN_LOSS`) unless the loop
        already put its own there.

        Args:
            content: the reply's content (default: only return the extras).
            optimizer: the round's optimiser: its first parameter group's ``lr`` and
                ``momentum`` are what the aggregator's client side reads (SCAFFOLD's
                option II divides by steps x lr).
            learning_rate: instead of ``optimizer``.
            num_steps: the round's optimiser steps (default: counted, one per loss
                evaluation with gradients).

        Returns:
            The aggregator's extras (SCAFFOLD's ``delta_c``; empty for most).

        Raises:
            ConfigError: the aggregator keeps client state or sends extras and neither
                ``optimizer`` nor ``learning_rate`` was given.
        """
        round_ = self._require_round()
        momentum = 0.0
        if optimizer is not None:
            group = optimizer.param_groups[0]
            learning_rate = float(group["lr"]) if learning_rate is None else learning_rate
            momentum = float(group.get("momentum", 0.0) or 0.0)
            self._check_optimizer(optimizer)
        if learning_rate is None:
            if self.needs.client_state or self.needs.reply_extras:
                raise ConfigError(
                    f"aggregator {self.trainer.config.aggregator.name!r} needs the round's "
                    "learning rate: pass finish_round(content, optimizer)"
                )
            learning_rate = 0.0
        steps = round_.num_steps if num_steps is None else int(num_steps)
        end_vector = model_to_vector(round_.model)
        training = LocalTraining(num_steps=steps, learning_rate=learning_rate, momentum=momentum)
        extras = self.trainer.algorithm.aggregator.client_finish(
            round_.start_vector, end_vector, training, round_.payload, round_.client_state
        )
        save_client_state(round_.context, self.state_namespace, round_.client_state)
        if content is not None:
            if extras:
                content[EXTRAS_KEY] = tensors_to_record(extras)
            metrics = content.metric_records.get(METRICS_KEY)
            if metrics is None:
                content[METRICS_KEY] = metrics = MetricRecord()
            metrics[NUM_STEPS] = steps
            if TRAIN_LOSS in round_.reply_metrics and TRAIN_LOSS not in metrics:
                metrics[TRAIN_LOSS] = mean_loss(
                    round_.loss_sum if round_.loss_sum is not None else 0.0, round_.num_steps
                )
        self._round = None
        return extras

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Validate the components against the user's optimiser as ``train.optimizer``
        (each component's ``incompatibilities``): SGD and Adam are described, others are
        not checked."""
        group = optimizer.param_groups[0]
        if isinstance(optimizer, torch.optim.SGD):
            described = {"name": "sgd", "momentum": float(group.get("momentum", 0.0))}
        elif isinstance(optimizer, torch.optim.Adam):
            described = {"name": "adam"}
        else:
            return
        config = self.trainer.config
        validate_section(
            "train",
            {
                "loss_transform": config.loss_transform.model_dump(),
                "aggregator": config.aggregator.model_dump(),
                "optimizer": {**described, "lr": float(group["lr"])},
            },
            self.trainer.registry,
        )

    def _require_round(self) -> _Round:
        if self._round is None:
            raise RuntimeError(
                "call criterion = loss.begin_round(msg, context, model) at the start of the round"
            )
        return self._round


@dataclass(kw_only=True, eq=False)
class _Round:
    """What one round of :class:`FedplugLoss` keeps."""

    model: nn.Module
    context: Context
    start_vector: Tensor
    anchor: dict[str, Tensor]
    loss_context: Any
    payload: dict[str, Tensor]
    client_state: dict[str, Tensor]
    aggregator_context: Any
    reply_metrics: tuple[str, ...] = ()
    loss_sum: Tensor | None = None
    num_steps: int = 0

    def anchor_on(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The anchor on the parameters' device (the user may move the model after
        ``begin_round``)."""
        first = next(iter(params.values()), None)
        if first is not None and self.anchor:
            sample = next(iter(self.anchor.values()))
            if sample.device != first.device:
                self.anchor = {key: value.to(first.device) for key, value in self.anchor.items()}
        return self.anchor


def _output_width(model: nn.Module, data: Any, trainer: FedplugTrainer) -> int:
    local = trainer._local_data(data, next(model.parameters()).device)
    return trainer._num_classes(ConfigRecord(), model, local)
