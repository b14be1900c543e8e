"""The declared schemas of what a client sends back in a round: its round reply, its
evaluation reply and its error reply, built from what the server reads them with.

Every schema is a :class:`~fedplug.schema.MessageSchema` of :mod:`fedplug.schema`'s field
kinds, built by a function from what the reader declares: ``train.screening``
(:class:`~fedplug.screening.ScreeningConfig`), the components' needs
(:class:`~fedplug.components.ClientNeeds`: the reply extras and metrics), the model's size
and K, the number of clients. They state, field by field, what the round core's screen
(:func:`fedplug.screening.update_problem`) lets through, what the metric bounds
(:mod:`fedplug.run.reply_metrics`) keep and what an error text becomes
(:func:`fedplug.run.client_text.client_text`); tests/test_schema_fuzz.py checks that the
screen accepts exactly what :func:`round_reply_schema` accepts, and draws its hostile
replies from these schemas (:mod:`fedplug.schema_strategies`) on every runtime.

The round reply is the :class:`~fedplug.components.ClientUpdate` a runtime hands the round
core, as a mapping (:func:`update_fields`). What the screen checks across fields or against
the run's state is not a field's bound and is not here: a chain's last member answering as
itself, ``num-examples`` against the class counts the server holds, the update's norm
against the global model's (``train.screening.max_update_norm``, ``max_norm_ratio``).
Design: docs/reliability.md, 'One schema per message'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from fedplug.components import ClientNeeds, ClientUpdate, ReplyExtra
from fedplug.run.client_text import MAX_CLIENT_TEXT_CHARS, client_text
from fedplug.run.reply_metrics import MAX_METRIC_KEY_CHARS, MAX_METRIC_LIST_ITEMS, MAX_METRICS_BYTES
from fedplug.schema import Count, MessageSchema, Real, SchemaViolation, TensorField
from fedplug.screening import LARGEST_FLOAT, MAX_SECONDS, ScreeningConfig, declared_shape, dtype_problem, range_problem

CLIENT_ID, NUM_EXAMPLES, NUM_STEPS, SECONDS, WEIGHT = "client_id", "num_examples", "num_steps", "seconds", "weight"
VECTOR, EXTRAS, METRICS = "vector", "extras", "metrics"
"""The fields of the round reply: a :class:`~fedplug.components.ClientUpdate`'s."""
EVALUATE_NUM_EXAMPLES, ACCURACY, LOSS = "num-examples", "accuracy", "loss"
"""The fields of the evaluation reply (Flower's ``metrics`` record)."""
REASON = "reason"
"""The field of the error reply: the client's text (Flower's ``Error.reason``, a FedML
worker's ``TaskResult.error``, the message of the exception a simulated client raised)."""


@dataclass(frozen=True)
class TorchTensor(TensorField):
    """A dense torch tensor (numpy's arrays are refused: a runtime decodes them first) of
    one of the screen's dtypes (:func:`fedplug.screening.dtype_problem`: ``float_only``
    for the model, a real float or integer for an extra), finite, of exactly ``shape`` or
    of at most ``max_elements``, every entry in ``[minimum, maximum]`` where given."""

    float_only: bool = False
    minimum: float | None = None
    maximum: float | None = None

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            return f"is a {type(value).__name__}, expected a dense torch tensor"
        if reason := dtype_problem("a tensor", value.dtype, "float" if self.float_only else "real"):
            return reason.removeprefix("sent ")
        if reason := super().problem(value):
            return reason
        reason = range_problem(value, self.minimum, self.maximum)
        return f"has {reason}" if reason else None


@dataclass(frozen=True)
class NamedValues(MessageSchema):
    """A :class:`~fedplug.schema.MessageSchema` whose every key is a string of at most
    ``max_key_chars`` characters (a metric's name)."""

    max_key_chars: int = MAX_METRIC_KEY_CHARS

    def check(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        for key in mapping:
            if isinstance(key, str) and len(key) > self.max_key_chars:
                raise SchemaViolation(
                    self.message,
                    client_text(key, 60),
                    f"is a name of {len(key):,} characters, more than {self.max_key_chars}",
                )
        return super().check(mapping)


@dataclass(frozen=True)
class Nested:
    """A field that is itself a message: a mapping that ``schema`` accepts."""

    schema: MessageSchema
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return f"is a {type(value).__name__}, expected a mapping"
        try:
            self.schema.check(value)
        except SchemaViolation as violation:
            return f"has {violation}"
        except (TypeError, ValueError) as error:  # a hostile mapping's own methods
            return f"could not be read ({type(error).__name__})"
        return None

    def decode(self, value: Any) -> dict[str, Any]:
        return self.schema.check(value)


@dataclass(frozen=True)
class ClientText:
    """A client's text, of any length: kept as :func:`~fedplug.run.client_text.client_text`
    makes it (one escaped line of at most ``limit`` characters), never refused (an error
    reply fails its client whatever it says)."""

    limit: int = MAX_CLIENT_TEXT_CHARS
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        return None

    def decode(self, value: Any) -> str:
        return client_text(value, self.limit)


FINITE_METRIC = Real(-LARGEST_FLOAT, LARGEST_FLOAT)
"""A round reply's metric: a finite number (what the round core's aggregators read)."""


def metrics_schema(needs: ClientNeeds) -> NamedValues:
    """A round reply's metrics: each of ``needs.reply_metrics`` present, every entry a
    finite number under a string name of at most
    :data:`~fedplug.run.reply_metrics.MAX_METRIC_KEY_CHARS` characters, at most
    :data:`~fedplug.run.reply_metrics.MAX_METRICS_BYTES` in all (the bounds
    :func:`~fedplug.run.reply_metrics.bounded_metrics` cuts a runtime's metrics to)."""
    return NamedValues(
        "metric",
        dict.fromkeys(needs.reply_metrics, FINITE_METRIC),
        unknown=FINITE_METRIC,
        max_bytes=MAX_METRICS_BYTES,
    )


def extras_schema(needs: ClientNeeds, model_size: int) -> MessageSchema:
    """A round reply's extras: each declared one (:attr:`ClientNeeds.reply_extra_shapes`)
    of its shape and range, present when :attr:`ClientNeeds.reply_extras` names it; any
    other of at most the model's ``model_size`` elements; every one a dense torch tensor
    of a real float or integer dtype, finite."""
    declared: dict[str, Any] = {}
    for name in dict.fromkeys([*needs.reply_extras, *needs.reply_extra_shapes]):
        shape = needs.reply_extra_shapes.get(name)
        optional = name not in needs.reply_extras
        declared[name] = _extra_kind(shape, model_size, optional) if shape else TorchTensor(
            max_elements=model_size, optional=optional
        )
    return MessageSchema("extra", declared, unknown=TorchTensor(max_elements=model_size), max_bytes=1 << 50)


def _extra_kind(declared: ReplyExtra, model_size: int, optional: bool) -> TorchTensor:
    return TorchTensor(
        shape=declared_shape(declared, (model_size,)),
        minimum=declared.minimum,
        maximum=declared.maximum,
        optional=optional,
    )


def round_reply_schema(
    config: ScreeningConfig,
    needs: ClientNeeds,
    model_size: int,
    num_clients: int | None = None,
    timeout: float | None = None,
) -> MessageSchema:
    """What one client's round reply (a :class:`~fedplug.components.ClientUpdate`, as
    :func:`update_fields` writes it) may hold, field by field.

    Args:
        config: ``train.screening``: the caps on ``num_examples`` (and so the aggregation
            ``weight``) and ``num_steps``.
        needs: the run's components' needs: the reply extras and metrics.
        model_size: P, the flat model's number of parameters: the ``vector`` is a finite
            real float tensor of shape ``(P,)``.
        num_clients: K: ``client_id`` is in ``[0, K)`` (None: any id up to 2^63 - 1).
        timeout: ``train.failures.client_timeout_seconds``: the most ``seconds`` (None:
            :data:`~fedplug.screening.MAX_SECONDS`).
    """
    highest_id = num_clients - 1 if num_clients is not None else 2**63 - 1
    most_seconds = MAX_SECONDS if timeout is None else min(MAX_SECONDS, timeout)
    return MessageSchema(
        "round reply",
        {
            CLIENT_ID: Count(0, highest_id),
            NUM_EXAMPLES: Count(0, config.max_num_examples, optional=True),
            WEIGHT: Real(0.0, float(config.max_num_examples)),
            NUM_STEPS: Count(0, config.max_num_steps),
            SECONDS: Real(0.0, most_seconds),
            VECTOR: TorchTensor(shape=(model_size,), float_only=True),
            EXTRAS: Nested(extras_schema(needs, model_size)),
            METRICS: Nested(metrics_schema(needs)),
        },
        max_bytes=1 << 50,  # the model's and the extras' element bounds bound it
    )


def update_fields(update: ClientUpdate) -> dict[str, Any]:
    """``update``'s fields as the round reply's mapping (``num_examples`` left out when
    None, ``chain`` always: the runtime, not the client, says which chain a reply ends)."""
    values = {item.name: getattr(update, item.name) for item in fields(update) if item.name != "chain"}
    if values[NUM_EXAMPLES] is None:
        del values[NUM_EXAMPLES]
    return values


def evaluation_reply_schema(config: ScreeningConfig | None = None) -> NamedValues:
    """What one client's evaluation reply's metrics may hold: ``num-examples`` a count up
    to ``train.screening.max_num_examples``, ``accuracy`` in ``[0, 1]``, ``loss`` a finite
    non-negative number, any other entry a finite number or a list of at most
    :data:`~fedplug.run.reply_metrics.MAX_METRIC_LIST_ITEMS` finite numbers (the averages
    read it; the metric bounds cut the rest)."""
    cap = (config or ScreeningConfig()).max_num_examples
    return NamedValues(
        "evaluation reply",
        {
            EVALUATE_NUM_EXAMPLES: Count(0, cap),
            ACCURACY: Real(0.0, 1.0, optional=True),
            LOSS: Real(0.0, LARGEST_FLOAT, optional=True),
        },
        unknown=MetricValue(),
        max_bytes=MAX_METRICS_BYTES,
    )


@dataclass(frozen=True)
class MetricValue:
    """A finite number, or a list of at most ``max_items`` finite numbers."""

    max_items: int = MAX_METRIC_LIST_ITEMS
    optional: bool = True

    def problem(self, value: Any) -> str | None:
        items = value if isinstance(value, list) else [value]
        if len(items) > self.max_items:
            return f"has {len(items):,} items, expected at most {self.max_items:,}"
        for item in items:
            if reason := FINITE_METRIC.problem(item):
                return reason
        return None

    def decode(self, value: Any) -> float | list[float]:
        return [float(item) for item in value] if isinstance(value, list) else float(value)


def error_reply_schema() -> MessageSchema:
    """A client's error reply: its text (``reason``), kept as
    :func:`~fedplug.run.client_text.client_text` makes it: one escaped line of at most
    :data:`~fedplug.run.client_text.MAX_CLIENT_TEXT_CHARS` characters, whatever came."""
    return MessageSchema("error reply", {REASON: ClientText()}, max_bytes=1 << 50)
