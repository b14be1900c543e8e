"""FedAvgM: FedAvg with momentum (heavy ball or Nesterov) on the server.

    Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification. Tzu-Ming Harry Hsu, Hang Qi, Matthew Brown. 2019, arXiv:1909.06335.

The update, the effective learning rate and why ``beta = 0`` is FedAvg bit for bit:
docs/algorithms.md, "FedAvgM".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedplug.algorithms.attribute_state import AttributeState
from fedplug.components import Aggregator, ClientUpdate, ComponentConfig, average_models
from fedplug.hookspecs import RegisterAggregator, hookimpl


class FedAvgMConfig(ComponentConfig):
    """FedAvgM (Hsu, Qi, Brown 2019): FedAvg with server momentum."""

    name: Literal["fedavgm"] = "fedavgm"
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Server momentum beta (default 0.9); 0.0 makes this FedAvg."""
    server_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    """Server learning rate eta_s (default 1.0, as in the paper)."""
    nesterov: bool = False
    """Use Nesterov momentum (default False; the paper's experiments use True)."""

    def derived_values(self, train: Any) -> dict[str, Any]:
        """The paper's effective learning rate, from the clients' ``train.optimizer.lr``."""
        return {"effective_learning_rate": self.effective_learning_rate(train.optimizer.lr)}

    def effective_learning_rate(self, client_learning_rate: float = 1.0) -> float:
        """The paper's effective learning rate ``eta / (1 - beta)``.

        Args:
            client_learning_rate: the client's learning rate eta (default 1.0, which gives
                the server-side factor alone). The result also carries ``server_lr``,
                which the paper holds at 1.0: ``client_lr * server_lr / (1 - momentum)``.
        """
        return client_learning_rate * self.server_lr / (1.0 - self.momentum)


class FedAvgM(AttributeState, Aggregator):
    """Server side of FedAvgM, built from a :class:`FedAvgMConfig`; the client side is
    plain local training."""

    state_attributes = ("velocity",)

    def __init__(self, config: FedAvgMConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config
        self.velocity: Tensor | None = None

    def initialize(self, global_vector: Tensor) -> None:
        """Start with zero momentum."""
        self.velocity = torch.zeros_like(global_vector, dtype=torch.float32)

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """Apply one momentum step with the pseudo-gradient ``w^t - mean_k w_k``."""
        mean = average_models(updates, self.config.name).mean
        beta = self.config.momentum
        rate = self.config.server_lr
        current = global_vector.detach().double()
        if self.velocity is None:
            previous_velocity = torch.zeros_like(current)
        else:
            previous_velocity = self.velocity.double()
        pseudo_gradient = current - mean
        velocity = beta * previous_velocity + pseudo_gradient
        # w - rate * step, rewritten around `mean` so that beta = 0, rate = 1 is exact FedAvg.
        momentum_part = velocity if self.config.nesterov else previous_velocity
        next_vector = (1.0 - rate) * current + rate * mean - (rate * beta) * momentum_part
        self.velocity = velocity.float()
        return next_vector.float()


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedAvgMConfig, FedAvgM)
