"""What a component declares about itself: its strict config (the base classes every
component config subclasses) and what it needs from the clients (:class:`ClientNeeds`).

Part of the public plugin API: import these from :mod:`fedplug.components`, which
re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from fedplug.analysis import Analysis

if TYPE_CHECKING:
    from fedplug.components import PhaseCost


class StrictConfig(BaseModel):
    """Base of every config model: a typo is an error, values are immutable, numbers are
    finite (``.nan`` and ``.inf`` are refused as such, not as "out of range"), and a YAML
    boolean (``yes``, ``on``, ``true``) is not taken for the number 1."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        # A model validator: pydantic forbids field "before" validators on the `name`
        # discriminator. Raising ValidationError keeps each problem at its field's path.
        if not isinstance(data, dict):
            return data
        errors = []
        for key, value in data.items():
            field = cls.model_fields.get(key) if isinstance(key, str) else None
            if isinstance(value, bool) and field is not None:
                accepted = set(get_args(field.annotation)) or {field.annotation}
                if bool not in accepted and accepted & {int, float}:
                    error = PydanticCustomError(
                        "boolean_for_number",
                        "expected a number, got a boolean (YAML reads yes/no/on/off/true/false as booleans)",
                    )
                    errors.append(InitErrorDetails(type=error, loc=(key,), input=value))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


class ComponentConfig(StrictConfig):
    """Base of every component config: strict (a typo is an error) and immutable.

    Subclasses narrow ``name`` to ``Literal["their-name"]`` and add their parameters,
    each with a range and a docstring under it.
    """

    name: str
    analysis: ClassVar[Analysis] = Analysis()
    """What a study summarises and draws of this component's per-round metrics and setup
    report (:class:`fedplug.analysis.Analysis`; default: nothing)."""

    def incompatibilities(self, train: Any) -> list[str]:
        """Reasons why this component cannot run with the rest of ``train`` (the whole
        :class:`fedplug.config.TrainConfig`); empty when it can. Checked before any work
        starts."""
        return []

    def derived_values(self, train: Any) -> dict[str, Any]:
        """Values computed from this config and the rest of ``train`` that a reader wants
        beside the run's params (FedAvgM's effective learning rate); every runtime logs
        them under ``derived`` in metrics.json."""
        return {}

    def setup_file(self, federation: Any) -> str | None:
        """The name of the file in this config's ``cache_dir`` that keeps its component's
        setup-phase result for ``federation`` (named by a key of the data and of every
        parameter the result depends on), so that the pipeline's ``setup`` stage computes
        it once and the train stage's component loads it in ``prepare`` instead of
        running the phase; None (the default): nothing is kept. A config that names a
        file has a ``cache_dir`` field, and its component writes the file when it runs
        the phase with ``cache_dir`` set."""
        return None

    def setup_file_cost(self, path: Any) -> PhaseCost:
        """The rounds and bytes of the setup phase whose result the file ``path`` holds
        (a config that names a :meth:`setup_file` defines it)."""
        raise NotImplementedError(
            f"{type(self).__name__} names a setup file but not its cost; define setup_file_cost"
        )


# ------------------------------------------------------------------------ client needs

TRAIN_LOSS = "train_loss"
"""The reply metric holding a client's mean training loss of the round (Flower's
quickstart key, which Flower's ``QFedAvg`` reads as ``train_loss_key``): the mean, over
every optimiser step of the client's local training (all of its local epochs), of the
batch loss that step minimised, evaluated before the step. The batch loss is the one
fedplug's client trains on: the loss transform's batch mean (plain cross-entropy by
default) plus any penalty (FedProx's, SCAFFOLD's correction). Flower's PyTorch quickstart
reports the same mean (``running_loss / len(trainloader)`` with one local epoch). A client
that trained no batch reports NaN, so its update is screened out. A chain of clients
(FedGSP's groups) reports its last member's."""

REPLY_METRICS: dict[str, str] = {
    TRAIN_LOSS: "the mean training loss of the round's local steps",
}
"""The reply metrics fedplug's client side computes, by name, with what each means; a
component may ask for these in :attr:`ClientNeeds.reply_metrics`."""


MODEL_SHAPE: Literal["model"] = "model"
"""A reply extra's declared shape when it is shaped like the flat model vector ``[P]``
(SCAFFOLD's ``delta_c``)."""


@dataclass(frozen=True)
class ReplyExtra:
    """How one tensor of a client's reply extras must look (:attr:`ClientNeeds.reply_extra_shapes`).

    The round core drops a reply whose extra differs (:mod:`fedplug.screening`), before
    the aggregator reads it: a component that declares its extras never sees one of the
    wrong shape, dtype or range.
    """

    shape: Literal["model"] | tuple[int, ...] = MODEL_SHAPE
    """``"model"`` (:data:`MODEL_SHAPE`, the flat model's ``[P]``) or an exact shape;
    ``()`` is a scalar (FedNova's ``a``)."""
    minimum: float | None = None
    """Every entry must be at least this (None: no lower bound; FedNova's ``a``: 0)."""
    maximum: float | None = None
    """Every entry must be at most this (None: no upper bound)."""


@dataclass(frozen=True)
class ClientNeeds:
    """What a component needs from the clients beyond the model and ``num-examples``.

    Every component reports its needs (``client_needs()``); a runtime reads them to
    decide what to gather before round 1, what to carry with each model, and what a
    client must run. Combine several with ``|``.
    """

    class_counts: bool = False
    """Every client's class counts before round 1 (FedShift's global prior, FedGSP's
    clusters); a federated runtime gathers them from the clients."""
    client_side: bool = False
    """The component changes how a client trains (a sampler, a loss, a penalty), so the
    client must run fedplug's client side (``FedplugTrainer`` or the component itself)."""
    client_state: bool = False
    """The component keeps state on each client across rounds (SCAFFOLD's c_k)."""
    server_payload: tuple[str, ...] = ()
    """Tensors the server sends down with every model (SCAFFOLD's ``c``)."""
    reply_extras: tuple[str, ...] = ()
    """Tensors every client's reply carries besides the model (SCAFFOLD's ``delta_c``,
    FedNova's ``a_k``)."""
    reply_extra_shapes: Mapping[str, ReplyExtra] = field(default_factory=dict, hash=False)
    """How each of :attr:`reply_extras` must look, by name (its shape, and any range):
    SCAFFOLD's ``{"delta_c": ReplyExtra("model")}``, FedNova's
    ``{"a": ReplyExtra((), minimum=0.0)}``. The round core drops a reply whose extra has
    another shape, a dtype other than a real float or integer, or an entry out of range
    or not finite. An extra declared in :attr:`reply_extras` but not here may have any
    shape of at most the model's number of elements."""
    pooled_data: str | None = None
    """Set when the component needs every client's raw data in one place, which only the
    simulator has: the text says why (FedDiskAb, an oracle ablation)."""
    reply_metrics: tuple[str, ...] = ()
    """Numbers every client's reply carries in its metrics, by name, each one of
    :data:`REPLY_METRICS` (``("train_loss",)``: the client's mean training loss, see
    :data:`TRAIN_LOSS`, which Flower's QFedAvg weighs clients by). The clients compute
    them only when some component of the run asks; they arrive in
    :attr:`ClientUpdate.metrics`, and an update whose metric is missing or not finite is
    screened out."""

    def __or__(self, other: ClientNeeds) -> ClientNeeds:
        return ClientNeeds(
            class_counts=self.class_counts or other.class_counts,
            client_side=self.client_side or other.client_side,
            client_state=self.client_state or other.client_state,
            server_payload=tuple(dict.fromkeys(self.server_payload + other.server_payload)),
            reply_extras=tuple(dict.fromkeys(self.reply_extras + other.reply_extras)),
            reply_extra_shapes={**self.reply_extra_shapes, **other.reply_extra_shapes},
            pooled_data=self.pooled_data or other.pooled_data,
            reply_metrics=tuple(dict.fromkeys(self.reply_metrics + other.reply_metrics)),
        )

    def describe(self) -> list[str]:
        """What a client must provide, one phrase each (empty when nothing)."""
        items = []
        if self.class_counts:
            items.append("its class counts before round 1")
        if self.client_side:
            items.append("fedplug's client side in its training loop")
        if self.client_state:
            items.append("state kept across rounds")
        if self.server_payload:
            items.append(f"the server's payload {list(self.server_payload)} with every model")
        if self.reply_extras:
            items.append(f"{list(self.reply_extras)} in every reply")
        if self.reply_metrics:
            meanings = ", ".join(
                f"{name!r} ({REPLY_METRICS.get(name, 'a number')})" for name in self.reply_metrics
            )
            items.append(f"{meanings} in every reply's metrics")
        return items
