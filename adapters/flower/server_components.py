"""The fedplug components a :class:`~.strategy.FedplugStrategy` runs, built from its
``train`` config: the sampler, loss transform, aggregator and grouper, what they need from
the clients, and the global model.

It also checks the strategy's sizes and Flower's record keys, builds a stand-in model
from an ``ArrayRecord`` when no model is given, and logs its summary. Building is kept here, one function per thing built, so that the strategy never calls
the registry itself: :func:`build_components` (at construction),
:func:`with_aggregator_for_nodes` (at setup, once the connected nodes are counted) and
:func:`build_global_model`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.components import Components, build_component
from fedplug.run.model import build_model

from .node_sampling import NodeRule
from .records import CONFIG_KEY, MODEL_KEY, NUM_EXAMPLES
from .requirements import Component, client_requirements, needs_only

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


def model_from_arrays(arrays: ArrayRecord, device: torch.device) -> nn.Module:
    """A stand-in global model holding ``arrays`` under their own names: every
    floating-point array a parameter, in the record's order, every other a buffer.

    It has no ``forward``: the strategy uses its model only to turn vectors into
    records and back, which needs the names, shapes and order alone. The order is the
    user's model's own vector order when that model has no floating-point buffers
    (BatchNorm's running statistics); no component on the server depends on it, but
    fedplug's client side does (see :func:`check_stand_in_allowed`).
    """
    root = nn.Module()
    for name, array in arrays.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            child = module._modules[part]
            assert child is not None  # added just above
            module = child
        tensor = torch.from_numpy(np.array(array.numpy()))
        if tensor.is_floating_point():
            module.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            module.register_buffer(leaf, tensor)
    return root.to(device)


def check_stand_in_allowed(client_requirements: str | None) -> None:
    """Refuse to run without ``model=`` when fedplug's client side takes part: it shares
    flat vectors with the server in its model's order (parameters, then floating-point
    buffers), which an ``ArrayRecord`` does not tell apart."""
    if client_requirements is not None:
        raise ConfigError(
            "FedplugStrategy needs model= (or input_shape= and num_classes= to build "
            "train.model) for this config: its client-side pieces exchange flat vectors "
            "in the model's parameter order, which initial_arrays alone does not give "
            f"({client_requirements})"
        )


def check_arrays_match(model: nn.Module, arrays: ArrayRecord) -> None:
    """Raise a ConfigError naming the entries in which ``arrays`` (``initial_arrays``)
    and ``model``'s ``state_dict()`` differ: keys in only one of them, or shapes."""
    state = model.state_dict()
    only_model = sorted(set(state) - set(arrays.keys()))
    only_arrays = sorted(set(arrays.keys()) - set(state))
    shapes = [
        f"{name!r} {list(arrays[name].shape)} vs {list(tensor.shape)}"
        for name, tensor in state.items()
        if name in arrays and tuple(arrays[name].shape) != tuple(tensor.shape)
    ]
    if only_model or only_arrays or shapes:
        differences = []
        if only_model:
            differences.append(f"only in model=: {only_model}")
        if only_arrays:
            differences.append(f"only in initial_arrays: {only_arrays}")
        if shapes:
            differences.append(f"shapes (initial_arrays vs model=): {', '.join(shapes)}")
        raise ConfigError(
            "initial_arrays do not match model='s state_dict(): "
            + "; ".join(differences)
            + "; pass the arrays of that very model, or leave model= out"
        )


@dataclass(frozen=True)
class RecordKeys:
    """Flower's ``FedAvg`` record keys: where a message carries the model
    (``arrayrecord_key``) and its config (``configrecord_key``), and the reply metric
    that weighs a model and its metrics (``weighted_by_key``)."""

    arrays: str = MODEL_KEY
    config: str = CONFIG_KEY
    weight: str = NUM_EXAMPLES

    def check(self, client_requirements: str | None) -> None:
        """Raise a ConfigError for keys fedplug cannot honour: another weighting key (the
        round core weighs each reply's model by ``num-examples``), or renamed records
        when fedplug's client side, which reads the default keys, takes part."""
        if self.weight != NUM_EXAMPLES:
            raise ConfigError(
                f"weighted_by_key={self.weight!r}: fedplug weighs each reply's model and "
                f"metrics by its {NUM_EXAMPLES!r} metric; have the ClientApp send the "
                f"number of examples under {NUM_EXAMPLES!r} and leave weighted_by_key out"
            )
        renamed = (self.arrays, self.config) != (MODEL_KEY, CONFIG_KEY)
        if renamed and client_requirements is not None:
            raise ConfigError(
                f"arrayrecord_key={self.arrays!r}, configrecord_key={self.config!r}: "
                f"fedplug's client-side pieces read {MODEL_KEY!r} and {CONFIG_KEY!r}, "
                f"which this config needs ({client_requirements}); leave the keys out"
            )

    def applied(self, messages: Iterable[Message]) -> list[Message]:
        """``messages`` with their model and config records moved to these keys."""
        messages = list(messages)
        for message in messages:
            content = message.content
            if self.arrays != MODEL_KEY and MODEL_KEY in content:
                content[self.arrays] = content.pop(MODEL_KEY)
            if self.config != CONFIG_KEY and CONFIG_KEY in content:
                content[self.config] = content.pop(CONFIG_KEY)
        return messages


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


def check_evaluation_sizes(fraction_evaluate: float, min_evaluate_nodes: int) -> None:
    """Raise a ConfigError naming the evaluation argument out of range."""
    if not 0 <= fraction_evaluate <= 1:
        raise ConfigError(f"fraction_evaluate ({fraction_evaluate}) must be in [0, 1]")
    if min_evaluate_nodes < 0:
        raise ConfigError(f"min_evaluate_nodes ({min_evaluate_nodes}) must not be negative")


def log_summary(
    train_config: Any, rule: NodeRule, requirement: str | None, evaluation: tuple[float, int] = (1.0, 2)
) -> None:
    """Log what a strategy runs: the components, how clients are chosen for training and
    for evaluation (``evaluation``: ``fraction_evaluate``, ``min_evaluate_nodes``), and
    what each ClientApp must send (Flower's ``Strategy.start`` calls ``summary``)."""
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
            "\t│\t├── clients: %d fixed, fraction %.2f per round (seed %d)",
            rule.num_clients,
            config.client_fraction,
            config.seed,
        )
    else:
        log(
            "\t│\t├── clients: the connected nodes, fraction_train %.2f, "
            "min_train_nodes %d, "
            "min_available_nodes %d (seed %d)",
            rule.fraction_train,
            rule.min_train_nodes,
            rule.min_available_nodes,
            config.seed,
        )
    log("\t│\t└── evaluate: fraction_evaluate %.2f, min_evaluate_nodes %d", *evaluation)
    log(
        "\t└──> from each ClientApp: %s",
        needs_only(requirement) if requirement else "arrays and metrics with num-examples",
    )
