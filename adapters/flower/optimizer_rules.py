"""The user's own optimiser, as fedplug's components judge it: described as a
``train.optimizer`` (:func:`optimizer_config`), judged by every component's
``incompatibilities`` (:func:`optimizer_reasons`), and shown as the user built it
(:func:`describe`). Used by :class:`~.own_loop.FedplugLoss`, which sees the optimiser in
``begin_round(..., optimizer=)`` or at its first ``step()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedplug.component_config import ComponentConfig
from fedplug.config import ALGORITHM_SLOTS, OptimizerConfig


def constrains_optimizer(train: Any) -> bool:
    """Whether a component of ``train`` declares incompatibilities (the only place a
    component can reject the run's optimiser), so the user's optimiser must be seen."""
    return any(
        type(getattr(train, slot)).incompatibilities is not ComponentConfig.incompatibilities
        for slot in ALGORITHM_SLOTS
    )


def optimizer_reasons(train: Any, rule: OptimizerConfig) -> list[str]:
    """Every component's reasons against ``rule`` as ``train.optimizer``, worded for an
    optimiser in the user's own loop (``the optimizer's momentum``)."""
    with_rule = train.model_copy(update={"optimizer": rule})
    return [
        f"{slot} {component.name!r}: " + reason.replace("train.optimizer.", "the optimizer's ")
        for slot in ALGORITHM_SLOTS
        for component in [getattr(with_rule, slot)]
        for reason in component.incompatibilities(with_rule)
    ]


def optimizer_config(optimizer: torch.optim.Optimizer) -> OptimizerConfig:
    """``optimizer`` as a ``train.optimizer`` (not validated: only the components judge)."""
    if isinstance(optimizer, torch.optim.SGD):
        name = "sgd"
    elif isinstance(optimizer, torch.optim.Adam):
        name = "adam"
    else:
        name = type(optimizer).__name__.lower()
    group = optimizer.param_groups[0]
    return OptimizerConfig.model_construct(
        name=name,
        lr=learning_rate(optimizer),
        momentum=momentum(optimizer),
        weight_decay=float(group.get("weight_decay", 0.0) or 0.0),
    )


def learning_rate(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def momentum(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0].get("momentum", 0.0) or 0.0)


def describe(optimizer: torch.optim.Optimizer) -> str:
    """``SGD(lr=0.1, momentum=0.9)``: the optimiser as the user built it."""
    group = optimizer.param_groups[0]
    shown = [f"lr={learning_rate(optimizer):g}"]
    if "momentum" in group:
        shown.append(f"momentum={momentum(optimizer):g}")
    return f"{type(optimizer).__name__}({', '.join(shown)})"


def steps_parameters_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether ``optimizer`` updates any parameter of ``model``."""
    ids = {id(parameter) for parameter in model.parameters()}
    return any(id(parameter) in ids for group in optimizer.param_groups for parameter in group["params"])
