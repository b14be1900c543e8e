"""The fedplug components a :class:`~.strategy.FedplugStrategy` runs, built from its
``train`` config: the sampler, loss transform, aggregator and grouper, what they need from
the clients, and the global model.

It also checks the strategy's sizes and logs its summary. Building is kept here, one function per thing built, so that the strategy never calls
the registry itself: :func:`build_components` (at construction),
:func:`with_aggregator_for_nodes` (at setup, once the connected nodes are counted) and
:func:`build_global_model`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.components import Components, build_component
from fedplug.run.model import build_model

from .node_sampling import NodeRule
from .requirements import Component, client_requirements

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers


@dataclass(frozen=True)
class _ModelShape:
    """What :func:`fedplug.run.model.build_model` reads from a federation."""

    input_shape: tuple[int, ...]
    num_classes: int


def build_components(train_config: Any, registry: Registry, num_clients: int | None) -> Components:
    """Build the config's components (the aggregator for ``num_clients``, 1 when the
    nodes are counted only at setup) and collect what they need from the clients.

    Raises:
        ConfigError: a component needs every client's raw data in one place
            (``ClientNeeds.pooled_data``), which a Flower deployment must not do.
    """
    # The aggregator is rebuilt for the number of connected nodes when that is only known at setup.
    components = Components.build(train_config, registry, num_clients or 1)
    pooled = components.needs().pooled_data
    if pooled is not None:
        name = train_config.loss_transform.name
        raise ConfigError(f"train.loss_transform {name!r} cannot run on Flower: {pooled}")
    return components


def with_aggregator_for_nodes(components: Components, train_config: Any, registry: Registry, num_clients: int) -> Components:
    """``components`` with the aggregator rebuilt for the ``num_clients`` nodes counted at
    setup (when the strategy was not given ``num_clients``)."""
    return replace(components, aggregator=build_component("aggregator", train_config, registry, num_clients))


def build_global_model(
    train_config: Any,
    registry: Registry,
    input_shape: Sequence[int] | None,
    num_classes: int | None,
    device: torch.device,
) -> nn.Module:
    """``train.model`` built for ``input_shape`` and ``num_classes``, initialised from
    ``train.seed`` like the simulator's.

    Raises:
        ConfigError: ``input_shape`` or ``num_classes`` is missing.
    """
    if input_shape is None or num_classes is None:
        raise ConfigError(
            "FedplugStrategy needs model=, or input_shape= and num_classes= to build "
            "train.model"
        )
    shape: Any = _ModelShape(tuple(input_shape), num_classes)
    return build_model(train_config, registry, shape, device)


def requirement_line(train_config: Any, components: Components) -> str | None:
    """What the ClientApp must add to the quickstart shape for these components, in one
    line (``None``: nothing); see :mod:`.requirements`."""
    slots = [
        Component(slot, getattr(train_config, slot).name, component)
        for slot, component in components.by_slot().items()
    ]
    phases = ", ".join(phase.name for _, phase in components.setup_phases())
    return client_requirements(slots, phases or None)


def check_sizes(
    num_clients: int | None,
    num_classes: int | None,
    fraction: float,
    min_train_nodes: int,
    min_available_nodes: int,
) -> None:
    """Raise a ConfigError naming the strategy's argument out of range."""
    if num_clients is not None and num_clients < 1:
        raise ConfigError(f"num_clients ({num_clients}) must be positive")
    if num_classes is not None and num_classes < 1:
        raise ConfigError(f"num_classes ({num_classes}) must be positive")
    if not 0 < fraction <= 1:
        raise ConfigError(f"fraction_train ({fraction}) must be in (0, 1]")
    if min_train_nodes < 1 or min_available_nodes < 1:
        raise ConfigError(
            f"min_train_nodes ({min_train_nodes}) and min_available_nodes "
            f"({min_available_nodes}) must be positive"
        )


def log_summary(train_config: Any, rule: NodeRule, requirement: str | None) -> None:
    """Log what a strategy runs: the components, how clients are chosen, and what each
    ClientApp must send (Flower's ``Strategy.start`` calls ``summary``)."""
    config = train_config
    log = logger.info
    log("\t├──> fedplug train config:")
    log(
        "\t│\t├── sampler=%s loss_transform=%s aggregator=%s grouper=%s",
        config.sampler.name,
        config.loss_transform.name,
        config.aggregator.name,
        config.grouper.name,
    )
    if rule.num_clients is not None:
        log(
            "\t│\t└── clients: %d fixed, fraction %.2f per round (seed %d)",
            rule.num_clients,
            config.client_fraction,
            config.seed,
        )
    else:
        log(
            "\t│\t└── clients: the connected nodes, fraction_train %.2f, "
            "min_train_nodes %d, "
            "min_available_nodes %d (seed %d)",
            rule.fraction_train,
            rule.min_train_nodes,
            rule.min_available_nodes,
            config.seed,
        )
    log(
        "\t└──> from each ClientApp: %s",
        requirement or "arrays and metrics with num-examples (nothing more)",
    )
