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

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fedplug.components import TRAIN_LOSS, LocalTraining, LossTransform
from fedplug.config import OptimizerConfig
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.local_training import check_reply_metrics, mean_loss
from fedplug.run.vectors import model_to_vector, split_like

from . import optimizer_rules
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

TRAIN_PENALTY = "train_penalty"
"""The reply metric :meth:`FedplugLoss.finish_round` adds when the algorithm has a
penalty (FedProx's proximal term, SCAFFOLD's correction): the mean over the round's
optimiser steps of the penalty added to the task loss."""


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
    started from. The returned tensor's gradient includes the penalties but its value is
    the task loss alone, so the loop's own ``running_loss += loss.item()`` reports the
    task loss; the penalty's round mean goes to the reply as ``train_penalty``.

    Where a component constrains the optimiser (SCAFFOLD: plain SGD without momentum;
    FedNova: SGD) or its client side reads the learning rate, the optimiser is checked
    before it moves any parameter: in :meth:`begin_round` when it is passed there, else
    at its first ``step()`` of the round (a torch optimiser step pre-hook, held from
    :meth:`begin_round` to :meth:`finish_round`, that reacts only to optimisers over the
    round's model).

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
        self._reads_optimizer = (
            self.needs.client_state
            or self.needs.reply_extras
            or optimizer_rules.constrains_optimizer(self.trainer.config)
        )
        self._step_hook: weakref.finalize | None = None
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
        self,
        message: Message,
        context: Context,
        model: nn.Module,
        data: Any = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
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
            optimizer: the round's optimiser, checked here and read by
                :meth:`finish_round` (default: seen at its first ``step()`` where a
                component reads it; pass it when it is built before ``begin_round``, to
                fail before the first forward pass).

        Raises:
            ConfigError: the optimiser does not fit a component (SCAFFOLD with momentum),
                ``data`` is missing where needed, or the message lacks what a
                component needs (the loss transform's prepared state, the aggregator's
                payload): the server is not :class:`~fedplug.adapters.flower.FedplugStrategy`
                with the same components.
        """
        self._stop_watching_steps()
        self._round = None
        if optimizer is not None:
            self._check_optimizer(optimizer)
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
            optimizer=optimizer,
        )
        if optimizer is None and self._reads_optimizer:
            self._watch_steps()
        return self

    def _watch_steps(self) -> None:
        """Install the torch optimiser step pre-hook that checks the round's optimiser at
        its first step. It holds this object weakly and is removed at
        :meth:`finish_round`, at the next :meth:`begin_round` or when this object goes."""
        owner = weakref.ref(self)

        def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            loss = owner()
            if loss is not None:
                loss._see_optimizer(optimizer)

        handle = register_optimizer_step_pre_hook(before_step)
        self._step_hook = weakref.finalize(self, handle.remove)

    def _stop_watching_steps(self) -> None:
        if self._step_hook is not None:
            self._step_hook()
            self._step_hook = None

    def _see_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer``'s step: the first time an optimiser over the round's model
        steps, check it (raising before any parameter moves) and keep it for
        :meth:`finish_round`; optimisers over other parameters are left alone."""
        round_ = self._round
        if round_ is None or optimizer is round_.optimizer or optimizer in round_.other_optimizers:
            return
        if not optimizer_rules.steps_parameters_of(optimizer, round_.model):
            round_.other_optimizers.add(optimizer)
            return
        self._check_optimizer(optimizer)
        round_.optimizer = optimizer

    def __call__(self, logits: Tensor, targets: Tensor, sample_ids: Tensor | None = None) -> Tensor:
        """The batch loss (see the class docstring). ``sample_ids``: each sample's index
        in the client's training set, for a loss that weighs samples (FedDisk's): wrap
        the dataset with :func:`~.local_data.with_sample_ids` and pass
        ``batch["sample_id"]``."""
        round_ = self._require_round()
        algorithm = self.trainer.algorithm
        transform = algorithm.loss_transform
        if algorithm.plain_cross_entropy:
            task_loss = self.criterion(logits, targets)
        else:
            task_loss = self._per_sample_loss(logits, targets, sample_ids, round_).mean()
        # total: the value the simulator sums into train_loss, terms added in its order.
        total, penalty = task_loss.detach(), None
        if algorithm.has_penalty:
            params = dict(round_.model.named_parameters())
            anchor = round_.anchor_on(params)
            for term in (
                transform.penalty(params, anchor, round_.loss_context),
                algorithm.aggregator.client_penalty(params, anchor, round_.aggregator_context),
            ):
                if term is not None:
                    total = total + term.detach()
                    penalty = term if penalty is None else penalty + term
        if torch.is_grad_enabled() and logits.requires_grad:
            round_.num_steps += 1
            if TRAIN_LOSS in round_.reply_metrics:  # summed on the device: no sync per step
                round_.loss_sum = _add_to_sum(round_.loss_sum, total)
            if penalty is not None:
                round_.penalty_sum = _add_to_sum(round_.penalty_sum, penalty.detach())
        if penalty is None:
            return task_loss
        # The penalty's gradient with the task loss's value: (penalty - penalty) is 0 exactly.
        return task_loss + (penalty - penalty.detach())

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
        momentum: float | None = None,
        num_steps: int | None = None,
    ) -> dict[str, Tensor]:
        """End the round: the aggregator's client side (``client_finish``) runs on the
        trained model, its per-client state goes to ``context.state``, and when
        ``content`` (the reply's RecordDict) is given its extras go in as
        ``"fedplug.extras"`` and the step count into its ``"metrics"``, with
        ``train_penalty`` (:data:`TRAIN_PENALTY`) when the algorithm has a penalty and the
        reply metrics the server asked for (``train_loss``: the mean of this round's batch
        losses with gradients, penalty included, as the simulator reports it,
        :data:`fedplug.components.TRAIN_LOSS`) unless the loop already put its own there.

        The learning rate and momentum the aggregator's client side reads (SCAFFOLD's
        option II divides by steps x lr) come from the round's optimiser: the one given
        here or to :meth:`begin_round`, else the one seen stepping the model. A loop that
        updates the parameters by hand passes ``learning_rate`` and ``momentum``.

        Args:
            content: the reply's content (default: only return the extras).
            optimizer: the round's optimiser (default: the one given to
                :meth:`begin_round` or seen at its first step).
            learning_rate: the step size of a hand-written update; with a seen optimiser,
                it must equal the optimiser's ``lr``.
            momentum: the momentum of a hand-written update, required with
                ``learning_rate`` where a component constrains the optimiser; with a seen
                optimiser, it must equal the optimiser's.
            num_steps: the round's optimiser steps (default: counted, one per loss
                evaluation with gradients).

        Returns:
            The aggregator's extras (SCAFFOLD's ``delta_c``; empty for most).

        Raises:
            ConfigError: the aggregator reads the learning rate and no optimiser was seen
                nor ``learning_rate`` given; ``learning_rate`` without ``momentum`` where
                a component constrains the optimiser; ``learning_rate`` or ``momentum``
                disagreeing with the seen optimiser; an update that does not fit a
                component.
        """
        round_ = self._require_round()
        self._stop_watching_steps()
        if optimizer is not None:
            self._check_optimizer(optimizer)
            round_.optimizer = optimizer
        learning_rate, momentum = self._step_rule(round_.optimizer, learning_rate, momentum)
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
            if self.trainer.algorithm.has_penalty and TRAIN_PENALTY not in metrics:
                metrics[TRAIN_PENALTY] = mean_loss(
                    round_.penalty_sum if round_.penalty_sum is not None else 0.0,
                    round_.num_steps,
                )
        self._round = None
        return extras

    def _step_rule(
        self,
        optimizer: torch.optim.Optimizer | None,
        learning_rate: float | None,
        momentum: float | None,
    ) -> tuple[float, float]:
        """The round's (learning rate, momentum): the optimiser's where one was seen (the
        keywords must agree with it), else the keywords (checked as a plain SGD update)."""
        if optimizer is not None:
            seen = {
                "learning_rate": optimizer_rules.learning_rate(optimizer),
                "momentum": optimizer_rules.momentum(optimizer),
            }
            given = {"learning_rate": learning_rate, "momentum": momentum}
            for keyword, value in given.items():
                if value is not None and not math.isclose(float(value), seen[keyword], rel_tol=1e-6):
                    raise ConfigError(
                        f"finish_round got {keyword}={value} but the round's optimizer "
                        f"{optimizer_rules.describe(optimizer)} has {seen[keyword]}: "
                        f"leave {keyword}= out "
                        "(the optimizer is read) or make them agree"
                    )
            return seen["learning_rate"], seen["momentum"]
        if learning_rate is None:
            if self.needs.client_state or self.needs.reply_extras:
                raise ConfigError(
                    f"aggregator {self.trainer.config.aggregator.name!r} needs the round's "
                    "learning rate and saw no optimizer step: pass begin_round(msg, context, "
                    "model, optimizer=optimizer), or finish_round(content, learning_rate=lr, "
                    "momentum=0.0) for a hand-written update"
                )
            return 0.0, 0.0
        if momentum is None:
            if self._reads_optimizer:
                raise ConfigError(
                    f"{self._names()} reads the optimizer's momentum but saw no optimizer "
                    "step the model: "
                    f"pass begin_round(msg, context, model, optimizer=optimizer), or "
                    f"finish_round(content, learning_rate={learning_rate}, momentum=0.0) "
                    "for a hand-written update without momentum"
                )
            momentum = 0.0
        rule = OptimizerConfig.model_construct(
            name="sgd", lr=float(learning_rate), momentum=float(momentum), weight_decay=0.0
        )
        self._check_rule(
            rule, f"your update (learning_rate={learning_rate}, momentum={momentum})"
        )
        return float(learning_rate), float(momentum)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the user's optimiser against every component's ``incompatibilities``,
        described as ``train.optimizer`` (SGD as ``sgd``, Adam and its subclasses as
        ``adam``, any other by its class name)."""
        shown = f"your optimizer {optimizer_rules.describe(optimizer)}"
        self._check_rule(optimizer_rules.optimizer_config(optimizer), shown)

    def _check_rule(self, rule: OptimizerConfig, shown: str) -> None:
        """Raise a one-line ConfigError naming ``shown`` and what to change when a
        component's ``incompatibilities`` reject ``rule`` as the run's optimiser."""
        reasons = optimizer_rules.optimizer_reasons(self.trainer.config, rule)
        if reasons:
            raise ConfigError(f"{shown} does not fit " + "; ".join(reasons))

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
    optimizer: torch.optim.Optimizer | None = None
    """The round's optimiser: given to ``begin_round`` or seen at its first step."""
    other_optimizers: weakref.WeakSet[torch.optim.Optimizer] = field(default_factory=weakref.WeakSet)
    """Optimisers seen stepping other parameters than the round's model's."""
    loss_sum: Tensor | None = None
    """Sum of the batch losses with gradients, penalties included (``train_loss``)."""
    penalty_sum: Tensor | None = None
    """Sum of the penalties of those batches (``train_penalty``)."""
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


def _add_to_sum(running: Tensor | None, value: Tensor) -> Tensor:
    """``running + value`` in float64 on ``value``'s device, starting from zero: summed
    there, read once at the end of the round."""
    if running is None:
        running = torch.zeros((), dtype=torch.float64, device=value.device)
    return running + value


def _output_width(model: nn.Module, data: Any, trainer: FedplugTrainer) -> int:
    local = trainer._local_data(data, next(model.parameters()).device)
    return trainer._num_classes(ConfigRecord(), model, local)
