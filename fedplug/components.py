"""The interfaces every pluggable component implements: the four slots' base classes
(:class:`Sampler`, :class:`LossTransform`, :class:`Aggregator`, :class:`Grouper`), the hooks
they share (:class:`ComponentHooks`), and what a run hands them (:class:`ClientUpdate`,
:class:`RoundPlan`, :class:`PhaseCost`).

The public plugin API: every name of :mod:`fedplug.component_config` (config bases, client
needs) and :mod:`fedplug.aggregation` (weighted averaging) is importable from here too.
Design: docs/round.md, 'Design notes: components'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from fedplug.aggregation import (
    ModelAverage,
    WeightedMean,
    average_models,
    check_update_weight,
    no_updates_error,
)
from fedplug.component_config import (
    MODEL_SHAPE,
    REPLY_METRICS,
    TRAIN_LOSS,
    ClientNeeds,
    ComponentConfig,
    ReplyExtra,
    StrictConfig,
)

__all__ = [
    "MODEL_SHAPE",
    "REPLY_METRICS",
    "SLOTS",
    "SLOT_KINDS",
    "TRAIN_LOSS",
    "Aggregator",
    "ClientNeeds",
    "ClientUpdate",
    "ComponentConfig",
    "ComponentHooks",
    "Context",
    "FederationSummary",
    "FederationView",
    "Grouper",
    "LocalTraining",
    "LossTransform",
    "ModelAverage",
    "PhaseCost",
    "ReplyExtra",
    "RoundPlan",
    "Sampler",
    "StrictConfig",
    "WeightedMean",
    "as_tensor_context",
    "average_models",
    "check_update_weight",
    "no_updates_error",
]

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
