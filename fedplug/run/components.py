"""A run's four components, built in one place and asked together.

Every runtime (the simulator, Flower's strategy and trainer, FedML's coordinator,
workers and drop-in aggregator, the plugin check) builds the sampler, loss transform,
aggregator and grouper of a ``train`` config through :meth:`Components.build`, and asks
them what they need, prepare them, collect their round metrics, setup phases and setup
reports through :class:`Components`, slot by slot in the order of
:data:`fedplug.components.SLOTS`: no runtime asks one slot what another may also say.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedplug.components import (
    SLOT_KINDS,
    SLOTS,
    Aggregator,
    ClientNeeds,
    ComponentHooks,
    FederationView,
    Grouper,
    LossTransform,
    PhaseCost,
    RoundPlan,
    Sampler,
)
from fedplug.errors import ConfigError
from fedplug.run.local_training import ClientAlgorithm
from fedplug.run.state import COMPONENT_KEYS
from fedplug.setup_phase import NO_COST

if TYPE_CHECKING:
    from fedplug.registry import Registry
    from fedplug.setup_phase import SetupPhase

__all__ = ["SLOTS", "Components", "build_component", "merged_by_slot"]

CLIENT_SIDE_SLOTS_WITHOUT_PHASE_STATE = ("sampler", "aggregator")
"""The slots that also train on the clients but whose client side a distributed runtime
cannot hand a setup phase's client state (:meth:`Components.distributed_setup_phases`);
the grouper has no client side, the loss transform gets its phase's ``client_context``."""


def build_component(slot: str, train_config: Any, registry: Registry, num_clients: int = 1) -> Any:
    """The component of ``slot`` (one of :data:`~fedplug.components.SLOTS`) that
    ``train_config`` names, built by its registered factory; the aggregator is given K =
    ``num_clients`` (1 where only its client side runs)."""
    config = getattr(train_config, slot)
    if slot == "aggregator":
        return registry.build(SLOT_KINDS[slot], config, num_clients)
    return registry.build(SLOT_KINDS[slot], config)


def merged_by_slot(reports: Mapping[str, Mapping[str, Any]], what: str) -> dict[str, Any]:
    """The entries of every slot's report (``reports``: slot -> its entries), merged.

    Raises:
        ConfigError: two slots report an entry of the same name (``what`` names the kind
            of entry in the message: "round metric", "setup entry").
    """
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for slot, entries in reports.items():
        for key, value in entries.items():
            if key in owner:
                raise ConfigError(
                    f"the {owner[key]} and the {slot} both report the {what} {key!r}; "
                    f"rename one component's {what}"
                )
            owner[key] = slot
            merged[key] = value
    return merged


@dataclass(frozen=True)
class Components:
    """The sampler, loss transform, aggregator and grouper of one run (or one client)."""

    sampler: Sampler
    loss_transform: LossTransform
    aggregator: Aggregator
    grouper: Grouper

    @classmethod
    def build(cls, train_config: Any, registry: Registry, num_clients: int = 1) -> Components:
        """Build the four components ``train_config`` names, each once, in slot order;
        the aggregator is given K = ``num_clients`` (default 1: a client, where only the
        aggregator's client side runs)."""
        built = {slot: build_component(slot, train_config, registry, num_clients) for slot in SLOTS}
        return cls(**built)

    def by_slot(self) -> dict[str, ComponentHooks]:
        """The components by slot name, in slot order."""
        return {slot: getattr(self, slot) for slot in SLOTS}

    def __iter__(self) -> Iterator[ComponentHooks]:
        return iter(self.by_slot().values())

    def needs(self) -> ClientNeeds:
        """The union of what the four need from the clients."""
        needs = ClientNeeds()
        for component in self:
            needs = needs | component.client_needs()
        return needs

    def prepare(self, federation: FederationView) -> PhaseCost:
        """Run every slot's ``prepare`` with ``federation`` (the simulator's
        :class:`~fedplug.data.federation.Federation`, or a
        :class:`~fedplug.components.FederationSummary` of class counts), in slot order;
        their costs added up."""
        cost = NO_COST
        for component in self:
            cost = cost + (component.prepare(federation) or NO_COST)
        return cost

    def setup_phases(self) -> list[tuple[str, SetupPhase]]:
        """``(slot, phase)`` of every slot that declares a setup phase, in slot order; ask
        after :meth:`prepare`, which may have loaded a phase's result (then the component
        declares none)."""
        phases = []
        for slot, component in self.by_slot().items():
            phase = component.setup_phase()
            if phase is not None:
                phases.append((slot, phase))
        return phases

    def distributed_setup_phases(self, runtime: str) -> list[tuple[str, SetupPhase]]:
        """:meth:`setup_phases`, for a runtime whose clients train in other processes
        (``runtime``: Flower, FedML): there the clients' training meets only the loss
        transform's phase state (its ``client_context``), and the server meets the other
        slots' results through their phase's server side. A sampler's or aggregator's
        phase, whose component also trains on the clients, would leave that client side
        without what the phase kept (the simulator shares one object between both sides),
        so it is refused here.

        Raises:
            ConfigError: the sampler or the aggregator declares a setup phase (the message
                names the slot, the component, the phase and the runtime).
        """
        phases = self.setup_phases()
        for slot, phase in phases:
            if slot in CLIENT_SIDE_SLOTS_WITHOUT_PHASE_STATE:
                component = getattr(self, slot)
                name = getattr(getattr(component, "config", None), "name", type(component).__name__)
                raise ConfigError(
                    f"the {slot} {name!r} declares the setup phase {phase.name!r}, but on {runtime} "
                    f"only the loss transform's phase state reaches the clients' training, so the "
                    f"{slot}'s client side would train without what its phase kept; run it with the "
                    "simulator (`fedplug run`), or declare the phase on the loss transform"
                )
        return phases

    def setup_report(self) -> dict[str, Any]:
        """Every slot's setup report merged (:meth:`~fedplug.components.ComponentHooks.setup_report`).

        Raises:
            ConfigError: two slots report an entry of the same name.
        """
        reports = {slot: component.setup_report() for slot, component in self.by_slot().items()}
        return merged_by_slot(reports, "setup entry")

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """Every slot's metrics of the round of ``plan``, as floats.

        Raises:
            ConfigError: two slots report a metric of the same name.
        """
        reports = {
            slot: component.round_metrics(plan, class_counts) for slot, component in self.by_slot().items()
        }
        return {key: float(value) for key, value in merged_by_slot(reports, "round metric").items()}

    def checkpointed(self) -> dict[str, ComponentHooks]:
        """The components whose state a checkpoint holds, by checkpoint key
        (:data:`fedplug.run.state.COMPONENT_KEYS`)."""
        return {key: getattr(self, key) for key in COMPONENT_KEYS}

    def client_algorithm(self) -> ClientAlgorithm:
        """The client-side pieces (sampler, loss transform, aggregator) as local training
        takes them."""
        return ClientAlgorithm(self.sampler, self.loss_transform, self.aggregator)
