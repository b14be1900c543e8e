"""The interfaces every pluggable component implements.

A component is a config class (a strict pydantic model tagged by ``name``) plus the
object built from it. Components describe themselves through these interfaces: what they
need from the clients (:class:`ClientNeeds`), and through the hooks every slot shares
(:class:`ComponentHooks`: ``prepare``, ``round_metrics``, ``setup_phase``,
``setup_report``) what they compute before round 1 and report each round; the values
derived from their config (:meth:`ComponentConfig.derived_values`) and what a study keeps
and draws of those reports (:attr:`ComponentConfig.analysis`).
:class:`fedplug.run.components.Components` builds a run's four and asks them all. The round itself lives in
:mod:`fedplug.run.federated_round`; the simulator, Flower and FedML move models and messages
and read nothing else about an algorithm, so a third-party plugin runs wherever a
built-in does. An aggregator, built-in or not, averages with :class:`WeightedMean` or
:func:`average_models` and refuses what the built-ins refuse with
:func:`check_update_weight` and :func:`no_updates_error`.

Conventions shared by all components:

- Model parameters travel as one flat float32 vector (``torch.Tensor`` of shape ``[P]``),
  in the order of ``model.state_dict()``'s floating-point entries; see
  :mod:`fedplug.run.vectors`.
- Randomness comes in as an explicit ``numpy.random.Generator``; no component touches a
  global seed.
- Per-client tensors that the client's loss needs (a FedShift shift, SCAFFOLD's
  correction) are returned as a ``dict[str, Tensor]`` "context", so that the vectorised
  engine can stack them across clients and ``vmap`` over them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal, Mapping, Protocol, get_args

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from torch import Tensor
from torch.nn import functional as F

from fedplug.analysis import Analysis
from fedplug.errors import TrainingError

if TYPE_CHECKING:
    from fedplug.setup_phase import SetupPhase

Context = dict[str, Any]
"""Tensors (or nested dicts of tensors) a client's loss needs; stacked across clients by
the vectorised engine."""

SLOTS = ("sampler", "loss_transform", "aggregator", "grouper")
"""The component slots of a ``train`` config, in the order a run builds, prepares and
asks them."""
SLOT_KINDS = {
    "sampler": "samplers",
    "loss_transform": "loss_transforms",
    "aggregator": "aggregators",
    "grouper": "groupers",
}
"""The registry kind of each of :data:`SLOTS`."""


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

    def __or__(self, other: "ClientNeeds") -> "ClientNeeds":
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


# ------------------------------------------------------------------ shared hooks


class FederationView(Protocol):
    """What :meth:`ComponentHooks.prepare` receives on every runtime: the K x C class
    counts of all clients and K. The simulator passes its whole
    :class:`fedplug.data.federation.Federation` (which also holds the data, for a
    component whose :class:`ClientNeeds` sets ``pooled_data``); a federated runtime passes
    a :class:`FederationSummary` of the counts it gathered (zeros when no component asked
    for them)."""

    @property
    def class_counts(self) -> np.ndarray: ...

    @property
    def num_clients(self) -> int: ...


@dataclass(frozen=True)
class FederationSummary:
    """A :class:`FederationView` of class counts alone: what a federated runtime (Flower,
    FedML's drop-in aggregator), which never holds the clients' data, prepares the
    components with."""

    class_counts: np.ndarray
    """K x C."""
    num_clients: int = field(init=False)

    def __post_init__(self) -> None:
        counts = np.asarray(self.class_counts)
        if counts.ndim != 2:
            raise ValueError(f"class counts must be a K x C matrix, got shape {counts.shape}")
        object.__setattr__(self, "class_counts", counts)
        object.__setattr__(self, "num_clients", int(counts.shape[0]))


class ComponentHooks:
    """The optional hooks every component slot shares, each a no-op by default; a run
    calls them on all four of its components
    (:class:`fedplug.run.components.Components`)."""

    def client_needs(self) -> ClientNeeds:
        """What this component needs from the clients (default: nothing)."""
        return ClientNeeds()

    def prepare(self, federation: FederationView) -> PhaseCost | None:
        """Compute what the component needs from the whole federation, once per start of
        a run, before round 1 (FedShift's global prior, FedGSP's clusters). ``federation``
        holds ``class_counts`` (K x C) and ``num_clients`` (:class:`FederationView`; the
        whole :class:`~fedplug.data.federation.Federation` on the simulator). Returns the
        communication cost of any extra phase it ran, or ``None``. Runs again when a run
        resumes (what it builds that :meth:`state_dict` does not keep is rebuilt); work on
        the clients' own data belongs in :meth:`setup_phase`."""
        return None

    def setup_phase(self) -> SetupPhase | None:
        """A :class:`fedplug.setup_phase.SetupPhase` that runs on the clients' data before
        round 1, in steps the server drives (FedDisk's MADE training); ``None`` when there
        is none (the default). Every runtime runs it the same way, after :meth:`prepare`,
        on a fresh start only (a resumed run restores its result through
        :meth:`load_state_dict`)."""
        return None

    def setup_report(self) -> dict[str, Any]:
        """What :meth:`prepare` and the setup phase produced that a reader wants to see
        (FedDisk's per-client sample-weight quantiles and their histogram), as JSON-ready
        values; the run's :attr:`fedplug.run.results.RunResult.setup_report` merges every
        slot's. Empty by default, and before :meth:`prepare` has run."""
        return {}

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """Metrics of the round of ``plan``, recorded with it (FedGSP's CPD);
        ``class_counts``: the K x C counts, or ``None`` when the runtime has not gathered
        them. A key two slots report is an error. None by default; a study summarises them
        as the config's ``analysis`` declares."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""


# --------------------------------------------------------------------------- samplers


class Sampler(ComponentHooks, ABC):
    """Decides which local samples a client visits, and in which order, in one epoch."""

    def client_needs(self) -> ClientNeeds:
        """A sampler other than the uniform one runs on the client."""
        return ClientNeeds(client_side=True)

    @abstractmethod
    def epoch_indices(
        self,
        labels: np.ndarray,
        class_counts: np.ndarray,
        round_index: int,
        rng: np.random.Generator,
    ) -> np.ndarray:
        """Return indices into the client's local training set for one local epoch.

        ``labels``: the client's training labels (length n_k); ``class_counts``: their
        C-vector of counts; ``round_index``: the 0-based global round t; ``rng``: a
        generator seeded for this client, round and epoch.
        """


# ---------------------------------------------------------------------- loss transforms


class LossTransform(ComponentHooks, ABC):
    """Forms a client's training loss from its logits.

    The default is plain cross-entropy, so a subclass overrides only what it changes. The
    loss of a batch is ``sum(mask * per_sample_loss) / sum(mask) + penalty``; the mask is
    all ones except in the vectorised engine's padded batches. A loss transform that must
    see the whole federation first does so in :meth:`~ComponentHooks.prepare` (FedShift's
    prior), one that learns from the clients' data in
    :meth:`~ComponentHooks.setup_phase` (FedDisk).
    """

    def client_needs(self) -> ClientNeeds:
        """Any loss but plain cross-entropy runs on the client."""
        return ClientNeeds(client_side=True)

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        """Per-client constant tensors for :meth:`per_sample_loss` and :meth:`penalty`."""
        return {}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        """Loss of each sample of the batch, shape ``[B]``. ``sample_ids`` index the
        client's local training set."""
        return F.cross_entropy(logits, targets, reduction="none")

    def penalty(
        self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Context
    ) -> Tensor | None:
        """A term added once per batch, e.g. FedProx's ``mu/2 ||w - w^t||^2``; ``anchor``
        holds the parameters the client started the round from."""
        return None


@dataclass(frozen=True)
class PhaseCost:
    """Communication spent by a phase outside the main rounds (FedDisk's MADE training)."""

    rounds: int
    bytes_up: int
    bytes_down: int

    def __add__(self, other: PhaseCost) -> PhaseCost:
        """Both phases' rounds and bytes added up."""
        return PhaseCost(self.rounds + other.rounds, self.bytes_up + other.bytes_up, self.bytes_down + other.bytes_down)


# ------------------------------------------------------------------------- aggregators


@dataclass
class LocalTraining:
    """What a client did in one round, as the aggregator's client side needs it."""

    num_steps: int
    learning_rate: float
    momentum: float


@dataclass
class ClientUpdate:
    """One reply to the server: the model a client (or a group chain) ended with."""

    client_id: int
    vector: Tensor
    weight: float
    """Aggregation weight: n_k for a client, or 1 for a uniformly weighted group."""
    num_steps: int
    extras: dict[str, Tensor] = field(default_factory=dict)
    """What the aggregator's client side sends back besides the model (SCAFFOLD's
    control-variate change)."""
    chain: list[int] = field(default_factory=list)
    """The clients that trained this model, in order (one unless a grouper chains them)."""
    seconds: float = 0.0
    """Wall time the chain's local training took."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The reply metrics the run's components ask for (:attr:`ClientNeeds.reply_metrics`,
    e.g. ``train_loss``), the chain's last member's; empty when none is asked for."""
    num_examples: int | None = None
    """The training samples the chain claims it trained on (the sum of its members'
    ``num-examples``), screened against ``train.screening`` and the class counts the
    server holds; ``None`` when the runtime does not know it."""


class Aggregator(ComponentHooks, ABC):
    """Server-side combination of client models, plus the client-side work it needs.

    A registered aggregator class is built as ``cls(config, num_clients)``: its validated
    config and K, the number of clients in the federation (kept as :attr:`num_clients`).

    Server side: :meth:`initialize`, :meth:`server_payload`, :meth:`aggregate`.
    Client side (runs where the client runs; ``client_state`` persists across rounds for
    that client): :meth:`client_context`, :meth:`client_penalty`, :meth:`client_finish`.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def client_needs(self) -> ClientNeeds:
        """What the aggregator's client side needs (default: nothing; server-only)."""
        return ClientNeeds()

    def initialize(self, global_vector: Tensor) -> None:
        """Called once with the initial global model."""

    def server_payload(self) -> dict[str, Tensor]:
        """Tensors sent to every sampled client along with the model."""
        return {}

    def client_context(self, payload: dict[str, Tensor], client_state: dict[str, Tensor]) -> Context:
        """Per-client tensors for :meth:`client_penalty`."""
        return {}

    def client_penalty(
        self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Context
    ) -> Tensor | None:
        """A term added to every batch's loss on the client (SCAFFOLD's correction)."""
        return None

    def client_finish(
        self,
        start_vector: Tensor,
        end_vector: Tensor,
        training: LocalTraining,
        payload: dict[str, Tensor],
        client_state: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """After local training: update ``client_state`` in place and return the extras
        to send with the model."""
        return {}

    def check_update(self, update: ClientUpdate) -> str | None:
        """Why this aggregator cannot use ``update``, for relations between its fields
        that only the algorithm knows (FedNova: ``a`` against ``num_steps``); ``None``
        when it can (the default). The round core calls it after its own screen
        (:mod:`fedplug.screening`: every field's type, dtype, shape, finiteness and
        bounds), and drops the update with the returned reason."""
        return None

    @abstractmethod
    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """Return the next global model. ``updates`` is consumed once, as a stream, so
        the simulator never holds every client's model at once; keep running sums."""

    def state_dict(self) -> dict[str, Any]:
        """Server state to checkpoint (momentum buffers, control variates)."""
        return {}


class WeightedMean:
    """Running weighted mean of vectors: the building block of most aggregators."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.weight = 0.0
        self.count = 0

    def add(self, vector: Tensor, weight: float) -> None:
        if self.total is None:
            self.total = vector.detach().double() * weight
        else:
            self.total.add_(vector.detach().double(), alpha=weight)
        self.weight += weight
        self.count += 1

    @property
    def empty(self) -> bool:
        """True until a vector with positive total weight has been added."""
        return self.total is None or self.weight <= 0

    def mean(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``sum_k weight_k v_k / sum_k weight_k``, summed in float64 and returned as
        ``dtype``; ask for ``torch.float64`` to go on computing at full precision.

        Raises:
            ValueError: nothing with positive weight was added (:attr:`empty`).
        """
        if self.total is None or self.empty:
            raise ValueError("no client update reached the aggregator this round")
        return (self.total / self.weight).to(dtype)


@dataclass(frozen=True)
class ModelAverage:
    """The weighted mean of one round's client models."""

    mean: Tensor
    """sum_k p_k w_k in float64, on the device of the client vectors."""
    total_weight: float
    """sum_k weight_k."""
    count: int
    """How many updates were averaged."""


def check_update_weight(update: ClientUpdate) -> None:
    """Reject a weight that would corrupt a weighted mean (negative, NaN or infinite)."""
    if not (math.isfinite(update.weight) and update.weight >= 0):
        raise ValueError(
            f"client {update.client_id} sent aggregation weight {update.weight!r}; "
            "weights must be finite and non-negative"
        )


def no_updates_error(aggregator_name: str) -> TrainingError:
    """The error every aggregator raises when a round produced nothing to aggregate."""
    return TrainingError(
        f"no client update reached the {aggregator_name!r} aggregator this round (every "
        "sampled client failed or held no training samples); check the partition and the "
        "fraction of clients sampled per round"
    )


def average_models(updates: Iterable[ClientUpdate], aggregator_name: str) -> ModelAverage:
    """Consume ``updates`` once and return their weighted mean, in float64.

    Args:
        updates: the round's client replies, read as a stream.
        aggregator_name: named in the error raised when ``updates`` is empty.

    Raises:
        TrainingError: no update arrived, or all of them had weight 0.
    """
    accumulator = WeightedMean()
    for update in updates:
        check_update_weight(update)
        accumulator.add(update.vector, update.weight)
    if accumulator.empty:
        raise no_updates_error(aggregator_name)
    return ModelAverage(
        mean=accumulator.mean(torch.float64),
        total_weight=accumulator.weight,
        count=accumulator.count,
    )


# ---------------------------------------------------------------------------- groupers


@dataclass(frozen=True)
class RoundPlan:
    """Who trains with whom in one round.

    Each chain trains in sequence (the first member starts from the global model and
    hands its model to the next); chains are independent of each other. Every sampled
    client training alone is a plan of chains of length one.
    """

    chains: list[list[int]]
    weighting: Literal["samples", "uniform"] = "samples"
    """How the aggregator weighs a chain's final model: by the samples its members
    trained on, or equally (FedGSP's mean of group models)."""
    groups: list[list[int]] | None = None
    """All groups formed this round (sampled or not), for the CPD metric."""


class Grouper(ComponentHooks, ABC):
    """Forms the round's chains from the sampled clients."""

    def client_needs(self) -> ClientNeeds:
        """What forming the groups needs (default: nothing)."""
        return ClientNeeds()

    @abstractmethod
    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        """Return the plan of round ``round_number`` (1-based) for the sampled ``clients``."""


def as_tensor_context(values: dict[str, np.ndarray]) -> Context:
    """Convert numpy per-client constants to float32 tensors."""
    return {key: torch.as_tensor(value, dtype=torch.float32) for key, value in values.items()}
