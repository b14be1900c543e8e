"""FedProx: a proximal term that keeps each client near the round's global model.

    Federated Optimization in Heterogeneous Networks.
    Tian Li, Anit Kumar Sahu, Manzil Zaheer, Maziar Sanjabi, Ameet Talwalkar, Virginia Smith.
    MLSys 2020, arXiv:1812.06127.

Client k minimises its cross-entropy plus ``(mu / 2) ||w - w^t||^2``, where ``w^t`` is the
global model it started the round from. FedProx changes only the local objective, so it
is a loss transform; its server side is plain FedAvg (pair it with the ``fedavg``
aggregator, or with any other one). The paper's tolerance on inexact local solutions
(variable local work per client) is the simulator's business, not this module's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from fedplug.components import ComponentConfig, Context, LossTransform
from fedplug.hookspecs import RegisterLossTransform, hookimpl


class FedProxConfig(ComponentConfig):
    """FedProx (Li et al. 2020): cross-entropy plus (mu / 2) ||w - w^t||^2."""

    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(default=0.01, ge=0.0, le=100.0)
    """Weight of the proximal term (default 0.01). 0.0 makes this plain cross-entropy,
    i.e. FedAvg; the paper tunes it over {0.001, 0.01, 0.1, 1}."""


def proximal_term(params: dict[str, Tensor], anchor: dict[str, Tensor], mu: float) -> Tensor:
    """``(mu / 2) * sum_name ||params[name] - anchor[name]||^2``.

    Pure torch, so it runs under ``torch.func.vmap``. Its gradient with respect to
    ``params[name]`` is ``mu * (params[name] - anchor[name])``; ``anchor`` is treated as a
    constant (detached).
    """
    squared_distances = [(params[key] - anchor[key].detach()).square().sum() for key in params]
    if not squared_distances:
        raise ValueError("FedProx's proximal term needs at least one parameter")
    total = squared_distances[0]
    for distance in squared_distances[1:]:
        total = total + distance
    return 0.5 * mu * total


class FedProx(LossTransform):
    """Per-sample cross-entropy (inherited) and the proximal penalty.

    Args:
        config: the validated :class:`FedProxConfig`.
    """

    def __init__(self, config: FedProxConfig) -> None:
        self.config = config

    def penalty(
        self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Context
    ) -> Tensor | None:
        """``(mu / 2) ||w - w^t||^2`` over every parameter in ``params``."""
        return proximal_term(params, anchor, self.config.mu)


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(FedProxConfig, FedProx)
